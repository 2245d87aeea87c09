// Package controlplane starts a real, throwaway Kubernetes control plane on loopback: etcd and
// kube-apiserver built from their upstream Go modules (see hack/tools), with ipwarden's CRDs
// installed. Integration tests, end-to-end tests and the local demo all use it.
//
// Everything it starts lives in one scratch directory and one process group per program, and dies
// with the process that started it (Pdeathsig), also when a test panics.
package controlplane

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/ipwarden/ipwarden/internal/localcluster"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Options configure Start. The zero value works from anywhere inside the repository.
type Options struct {
	// Root is the repository root; found from the working directory when empty.
	Root string
	// BinDir holds (or will hold) kube-apiserver and etcd; see BinDir.
	BinDir string
	// Dir is the scratch directory; a new temporary one when empty. Removed by Stop unless Keep.
	Dir string
	// Keep leaves Dir in place after Stop (for looking at logs).
	Keep bool
	// CRDDir holds CRD YAML to install; Root/config/crd when empty. "-" installs none.
	CRDDir string
	// Log receives progress lines; io.Discard when nil.
	Log io.Writer
	// StartTimeout bounds how long etcd and kube-apiserver may take to become ready (default 90 s).
	StartTimeout time.Duration
	// ServiceAccounts keeps the ServiceAccount admission plugin on, so pods a real kubelet runs
	// get service account tokens (the real-node suite). Off, pods need no service accounts.
	ServiceAccounts bool
}

// ControlPlane is a running etcd and kube-apiserver.
type ControlPlane struct {
	// Config is an admin (system:masters) client configuration.
	Config *rest.Config
	// Kubeconfig is the path of a kubeconfig file for Config, usable by kubectl.
	Kubeconfig string
	// Dir is the scratch directory with data, certificates and logs.
	Dir string
	// URL is the API server's address, https://127.0.0.1:PORT.
	URL string
	// EtcdURL is etcd's client address.
	EtcdURL string

	keep      bool
	log       io.Writer
	bins      Binaries
	etcd      *localcluster.Process
	apiserver *localcluster.Process
	stopOnce  sync.Once
	stopErr   error
	etcdPeer  string
	apiArgs   []string
	etcdArgs  []string

	serviceAccounts bool
}

// Start builds the binaries if needed, starts etcd and kube-apiserver on free loopback ports,
// waits until the API server is ready and installs the CRDs. On error nothing is left running.
func Start(ctx context.Context, opts Options) (cp *ControlPlane, err error) {
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 90 * time.Second
	}
	if opts.Root == "" {
		if opts.Root, err = RepoRoot(); err != nil {
			return nil, err
		}
	}
	if opts.BinDir == "" {
		opts.BinDir = BinDir(opts.Root)
	}
	if opts.CRDDir == "" {
		opts.CRDDir = filepath.Join(opts.Root, "config", "crd")
	}
	bins, err := EnsureBinaries(opts.Root, opts.BinDir, opts.Log)
	if err != nil {
		return nil, err
	}
	if opts.Dir == "" {
		if opts.Dir, err = os.MkdirTemp("", "ipwarden-controlplane-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return nil, err
	}
	cp = &ControlPlane{Dir: opts.Dir, keep: opts.Keep, log: opts.Log, bins: bins, serviceAccounts: opts.ServiceAccounts}
	defer func() {
		if err != nil {
			_ = cp.Stop()
			cp = nil
		}
	}()

	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()
	if err := cp.startEtcd(ctx); err != nil {
		return cp, err
	}
	if err := cp.startAPIServer(ctx); err != nil {
		return cp, err
	}
	if opts.CRDDir != "-" {
		if err := InstallCRDs(ctx, cp.Config, opts.CRDDir); err != nil {
			return cp, err
		}
	}
	if err := InstallFencePolicy(ctx, cp.Config, opts.Root); err != nil {
		return cp, err
	}
	fmt.Fprintf(cp.log, "controlplane: ready at %s (kubeconfig %s)\n", cp.URL, cp.Kubeconfig)
	return cp, nil
}

func (cp *ControlPlane) startEtcd(ctx context.Context) error {
	ports, err := localcluster.FreePorts(2)
	if err != nil {
		return err
	}
	cp.EtcdURL = "http://127.0.0.1:" + strconv.Itoa(ports[0])
	cp.etcdPeer = "http://127.0.0.1:" + strconv.Itoa(ports[1])
	cp.etcdArgs = []string{
		"--data-dir", filepath.Join(cp.Dir, "etcd"),
		"--listen-client-urls", cp.EtcdURL,
		"--listen-peer-urls", cp.etcdPeer,
		"--unsafe-no-fsync",
	}
	return cp.RestartEtcd(ctx)
}

// RestartEtcd starts etcd again on the same ports and data (after StopEtcd), and waits until it
// answers. Chaos tests use it.
func (cp *ControlPlane) RestartEtcd(ctx context.Context) error {
	p, err := startProcess(cp.bins.Etcd, cp.etcdArgs, filepath.Join(cp.Dir, "etcd.log"))
	if err != nil {
		return fmt.Errorf("start etcd: %w", err)
	}
	cp.etcd = p
	health := &http.Client{Timeout: 2 * time.Second}
	return waitFor(ctx, p, "etcd", func() bool {
		resp, err := health.Get(cp.EtcdURL + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// StopEtcd kills etcd (SIGKILL), leaving its data for RestartEtcd.
func (cp *ControlPlane) StopEtcd() error { return kill(cp.etcd) }

func (cp *ControlPlane) startAPIServer(ctx context.Context) error {
	ports, err := localcluster.FreePorts(1)
	if err != nil {
		return err
	}
	certDir := filepath.Join(cp.Dir, "certs")
	if err := os.MkdirAll(certDir, 0o700); err != nil {
		return err
	}
	saKey := filepath.Join(cp.Dir, "sa.key")
	if err := writeRSAKey(saKey); err != nil {
		return err
	}
	token, err := randomToken()
	if err != nil {
		return err
	}
	tokenFile := filepath.Join(cp.Dir, "tokens.csv")
	if err := os.WriteFile(tokenFile, []byte(token+",ipwarden-admin,ipwarden-admin,\"system:masters\"\n"), 0o600); err != nil {
		return err
	}
	cp.URL = "https://127.0.0.1:" + strconv.Itoa(ports[0])
	cp.apiArgs = []string{
		"--etcd-servers", cp.EtcdURL,
		"--cert-dir", certDir,
		"--secure-port", strconv.Itoa(ports[0]),
		"--bind-address", "127.0.0.1",
		"--advertise-address", "127.0.0.1",
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", saKey,
		"--service-account-signing-key-file", saKey,
		"--token-auth-file", tokenFile,
		"--authorization-mode", "RBAC",
		"--service-cluster-ip-range", "10.96.0.0/16",
		"--enable-priority-and-fairness=false",
		"--profiling=false",
		"--v", "0",
	}
	if !cp.serviceAccounts {
		cp.apiArgs = append(cp.apiArgs, "--disable-admission-plugins", "ServiceAccount")
	}
	if err := cp.RestartAPIServer(ctx); err != nil {
		return err
	}
	ca, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		return fmt.Errorf("read API server certificate: %w", err)
	}
	cp.Config = &rest.Config{
		Host:            cp.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		QPS:             1000,
		Burst:           2000,
	}
	cp.Kubeconfig = filepath.Join(cp.Dir, "kubeconfig")
	return writeKubeconfig(cp.Kubeconfig, cp.Config)
}

// RestartAPIServer starts kube-apiserver again with the same flags (after StopAPIServer) and waits
// until it is ready.
func (cp *ControlPlane) RestartAPIServer(ctx context.Context) error {
	p, err := startProcess(cp.bins.KubeAPIServer, cp.apiArgs, filepath.Join(cp.Dir, "kube-apiserver.log"))
	if err != nil {
		return fmt.Errorf("start kube-apiserver: %w", err)
	}
	cp.apiserver = p
	insecure := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: insecureTLS(), // readiness probe only; clients verify the certificate
	}}
	return waitFor(ctx, p, "kube-apiserver", func() bool {
		resp, err := insecure.Get(cp.URL + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		// /readyz needs no authentication; 200 means etcd, informers and post-start hooks are done.
		return resp.StatusCode == http.StatusOK
	})
}

// StopAPIServer kills kube-apiserver (SIGKILL).
func (cp *ControlPlane) StopAPIServer() error { return kill(cp.apiserver) }

// PauseAPIServer stops kube-apiserver with SIGSTOP: its connections stay open and the kernel
// still accepts new ones, but nothing is answered. The returned resume sends SIGCONT.
func (cp *ControlPlane) PauseAPIServer() (resume func() error, err error) {
	pid := cp.apiserver.Pid()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return nil, fmt.Errorf("pause kube-apiserver (pid %d): %w", pid, err)
	}
	return func() error {
		if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
			return fmt.Errorf("resume kube-apiserver (pid %d): %w", pid, err)
		}
		return nil
	}, nil
}

// Stop terminates kube-apiserver and etcd and removes the scratch directory (unless Keep).
// It is safe to call more than once.
func (cp *ControlPlane) Stop() error {
	cp.stopOnce.Do(func() {
		var errs []error
		if cp.apiserver != nil {
			errs = append(errs, terminate(cp.apiserver))
		}
		if cp.etcd != nil {
			errs = append(errs, terminate(cp.etcd))
		}
		if !cp.keep && cp.Dir != "" {
			errs = append(errs, os.RemoveAll(cp.Dir))
		}
		cp.stopErr = errors.Join(errs...)
	})
	return cp.stopErr
}

// LogTail returns the last bytes of a component's log ("etcd" or "kube-apiserver"), for
// failure messages.
func (cp *ControlPlane) LogTail(component string, n int) string {
	return tail(filepath.Join(cp.Dir, component+".log"), n)
}

// waitFor polls ready until it is true, the process exits, or ctx ends (localcluster.WaitFor;
// ctx bounds the wait).
func waitFor(ctx context.Context, p *localcluster.Process, name string, ready func() bool) error {
	errNotReady := errors.New("not ready")
	err := localcluster.WaitFor(ctx, 24*time.Hour, 100*time.Millisecond, func() error {
		if ready() {
			return nil
		}
		if !p.Running() {
			return localcluster.Abort(fmt.Errorf("%s exited before it was ready (%v)", name, p.ExitErr()))
		}
		return errNotReady
	})
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		err = fmt.Errorf("%s not ready: %w", name, ctx.Err())
	}
	return fmt.Errorf("%w; its log ends:\n%s", err, tail(p.Log, 3000))
}

func writeRSAKey(path string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	der := x509.MarshalPKCS1PrivateKey(key)
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: der}), 0o600)
}

func randomToken() (string, error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

func writeKubeconfig(path string, cfg *rest.Config) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["ipwarden-local"] = &clientcmdapi.Cluster{
		Server:                   cfg.Host,
		CertificateAuthorityData: cfg.CAData,
		TLSServerName:            cfg.ServerName,
	}
	kc.AuthInfos["ipwarden-admin"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["ipwarden-local"] = &clientcmdapi.Context{Cluster: "ipwarden-local", AuthInfo: "ipwarden-admin"}
	kc.CurrentContext = "ipwarden-local"
	return clientcmd.WriteToFile(*kc, path)
}

// startProcess runs bin in its own process group, killed if this process dies
// (localcluster.Start).
func startProcess(bin string, args []string, logPath string) (*localcluster.Process, error) {
	return localcluster.Start(filepath.Base(bin), bin, logPath, args...)
}

// kill sends SIGKILL to the process group and waits for the exit (nil: not started).
func kill(p *localcluster.Process) error {
	if p != nil {
		p.Kill()
	}
	return nil
}

// terminate sends SIGTERM, then SIGKILL after 10 s, and waits for the exit.
func terminate(p *localcluster.Process) error {
	if p != nil {
		p.Stop()
	}
	return nil
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(b)
}

// SnapshotEtcd saves an etcd snapshot to path, as `etcdctl snapshot save` does (a backup).
func (cp *ControlPlane) SnapshotEtcd(ctx context.Context, path string) error {
	out, err := exec.CommandContext(ctx, cp.bins.Etcd, "snapshot", "save", cp.EtcdURL, path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("etcd snapshot save: %v: %s", err, out)
	}
	return nil
}

// RestoreEtcd restores etcd from a snapshot the way Kubernetes documents it: stop kube-apiserver
// and etcd, restore the snapshot into a new data directory with the revision bumped by
// 1,000,000,000 and marked compacted (so every watcher relists rather than miss a change), start
// etcd on it, start kube-apiserver. Everything written since the snapshot is gone.
func (cp *ControlPlane) RestoreEtcd(ctx context.Context, path string) error {
	_ = kill(cp.apiserver)
	_ = kill(cp.etcd)
	dataDir := filepath.Join(cp.Dir, "etcd")
	if err := os.Rename(dataDir, dataDir+fmt.Sprintf(".before-restore-%d", time.Now().UnixNano())); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, cp.bins.Etcd, "snapshot", "restore", path, dataDir, cp.etcdPeer).CombinedOutput()
	if err != nil {
		return fmt.Errorf("etcd snapshot restore: %v: %s", err, out)
	}
	if err := cp.RestartEtcd(ctx); err != nil {
		return err
	}
	return cp.RestartAPIServer(ctx)
}
