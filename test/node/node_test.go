package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

const (
	nodeName = "ipwn-node"
	// nodeIP is the kubelet's node address, in the suite's own network namespace (the kubelet
	// refuses a loopback address). Nothing is ever sent to it from outside.
	nodeIP = "10.250.0.2"
)

// hostDirs are the node paths the shipped manifests and the runtime use. The suite mounts its
// own scratch directories over them in its private mount namespace, so the manifests run
// unchanged and the host's own directories are never touched.
var hostDirs = []string{
	"/run/netns", "/run/containerd", "/run/ipwarden", "/var/lib/ipwarden", "/var/lib/kubelet",
	"/var/lib/containerd", "/var/log/pods", "/var/log/containers", "/opt/cni/bin", "/etc/cni/net.d", "/var/lib/cni/networks",
}

// realNode is a control plane, containerd, kubelet, kube-controller-manager and kube-scheduler
// in the suite's namespaces.
type realNode struct {
	t          *testing.T
	dir        string
	cp         *controlplane.ControlPlane
	kube       kubernetes.Interface
	k8s        client.Client
	containerd *localcluster.Process
	kubelet    *localcluster.Process
	kcm        *localcluster.Process
	scheduler  *localcluster.Process
	cri        runtimeapi.RuntimeServiceClient
	criConn    *grpc.ClientConn
	criSock    string
	cgroupRoot string
	cgroupDirs []string
	pool       ipwardenv1.IPPoolSpec // scaling and cooldown of the pool deployIpwarden creates
	// overlayPatches are more entries of the test overlay's patches list (deployIpwarden).
	overlayPatches string
	// overlayComponents are kustomize components (paths from the repository's root) the test
	// overlay adds (deployIpwarden), e.g. deploy/kustomize/dra.
	overlayComponents []string
	second            *secondNode // the controller-only second node, once started
	// others counts pool addresses of workload-namespace pods outside the Deployment (the
	// sticky StatefulSet's), which waitPods expects on the node beside the Deployment's.
	others int
	// refuseSquatter: while set, the sticky StatefulSet's waits fail the test if the squatter
	// pod has an address (sticky_test.go).
	refuseSquatter bool
	// cniNetworks is containerd's max_conf_num: every pod is attached to the first cniNetworks
	// configs in /etc/cni/net.d, as eth0, eth1, ... (0: containerd's default, 1).
	cniNetworks int
}

// runtimeSocket is where the shipped agent DaemonSet finds containerd's CRI socket (its hostPath
// volume "cri", type Socket). containerd listens in the suite's scratch directory (its shims'
// command lines name it); the node path is a symlink to it, which the kubelet's hostPath check
// and the runtime's bind mount follow.
const runtimeSocket = "/run/containerd/containerd.sock"

func (n *realNode) logf(format string, args ...any) {
	n.t.Helper()
	n.t.Logf("%s "+format, append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

// startNode brings the node up. Cleanup tears it down and checks nothing is left.
func startNode(t *testing.T, ctx context.Context) *realNode {
	return startNodeIn(t, ctx, "node", "fs")
}

// startNodeIn brings the node up with its logs and state in the scratch directory's dir and
// its node paths (hostDirs) backed by fs, so a test that runs after another in the same suite
// starts from empty node paths (no journal, kubelet or containerd state of the earlier node).
// Each opt configures the node before anything starts.
func startNodeIn(t *testing.T, ctx context.Context, dir, fs string, opts ...func(*realNode)) *realNode {
	n := &realNode{t: t, dir: filepath.Join(prep.Scratch, dir)}
	for _, o := range opts {
		o(n)
	}
	t.Cleanup(n.teardown)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(n.dir, 0o755))
	// Mounts are shared within the suite's mount namespace, as systemd makes them on a real
	// node (the namespace is new, so nothing propagates to the host): the agent DaemonSet mounts
	// /var/run/netns and /run/netns with HostToContainer propagation, which the runtime refuses
	// on a private mount.
	must(syscall.Mount("", "/", "", syscall.MS_SHARED|syscall.MS_REC, ""))
	// Mount the suite's directories over the node paths (private mount namespace).
	for _, d := range hostDirs {
		src := filepath.Join(prep.Scratch, fs, strings.ReplaceAll(strings.Trim(d, "/"), "/", "_"))
		must(os.MkdirAll(src, 0o755))
		must(os.MkdirAll(d, 0o755))
		// A node path may already be a mount point inherited from the host (`ip netns add`
		// makes /run/netns one): detach it in this private namespace, so the runtime's mount
		// lookup finds the suite's mount and no private one below it.
		for syscall.Unmount(d, syscall.MNT_DETACH) == nil {
		}
		if err := syscall.Mount(src, d, "", syscall.MS_BIND, ""); err != nil {
			t.Fatalf("bind %s over %s: %v", src, d, err)
		}
	}
	// As on a real node (`ip netns` and the runtimes make it so), /run/netns is a shared mount:
	// the agent's DaemonSet mounts it with HostToContainer propagation to see pods' namespaces,
	// which the kubelet refuses on a private mount.
	if err := syscall.Mount("", "/run/netns", "", syscall.MS_SHARED|syscall.MS_REC, ""); err != nil {
		t.Fatalf("make /run/netns a shared mount: %v", err)
	}
	// The node address sits on the namespace's loopback interface (no dummy module on every
	// machine); the kubelet refuses only loopback addresses, not the interface. replace, not
	// add: an earlier test's node in this namespace left it there.
	must(run("ip", "link", "set", "lo", "up"))
	must(run("ip", "addr", "replace", nodeIP+"/32", "dev", "lo"))
	// The node's CNI plugins; the agent DaemonSet adds ipwarden and the config.
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		must(copyFile(filepath.Join(prep.CNIDir, p), filepath.Join("/opt/cni/bin", p)))
	}

	start := time.Now()
	cp, err := controlplane.Start(ctx, controlplane.Options{Root: prep.Root, BinDir: prep.BinDir,
		Dir: filepath.Join(n.dir, "controlplane"), Keep: true, ServiceAccounts: true})
	must(err)
	n.cp = cp
	n.kube, err = kubernetes.NewForConfig(cp.Config)
	must(err)
	n.k8s, err = client.New(cp.Config, client.Options{Scheme: scheme})
	must(err)
	n.logf("control plane ready in %s", time.Since(start).Round(time.Millisecond))

	must(n.startContainerd(ctx))
	must(n.importImages(ctx))
	must(n.startKubelet())
	must(n.startControllers())
	must(localcluster.WaitFor(ctx, 2*time.Minute, 200*time.Millisecond, func() error {
		node, err := n.kube.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				// Not Ready until a CNI config exists: the agent DaemonSet installs it.
				return nil
			}
		}
		return fmt.Errorf("node %s has no Ready condition yet", nodeName)
	}))
	n.logf("node registered")
	return n
}

func (n *realNode) startContainerd(ctx context.Context) error {
	dir := filepath.Join(n.dir, "containerd")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	// The socket lives in the scratch directory, so the shims' command lines name it.
	n.criSock = filepath.Join(dir, "containerd.sock")
	cfg := fmt.Sprintf(`version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # runc cannot start sandboxes here otherwise: root lacks CAP_SYS_RESOURCE.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
    max_conf_num = %d
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
`, n.criSock, n.criSock+".ttrpc", pauseImage, max(n.cniNetworks, 1))
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	p, err := localcluster.Start("containerd", "containerd", filepath.Join(dir, "containerd.log"), "--config", cfgPath)
	if err != nil {
		return err
	}
	n.containerd = p
	conn, err := grpc.NewClient("unix://"+n.criSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	n.criConn = conn
	n.cri = runtimeapi.NewRuntimeServiceClient(conn)
	if err := linkRuntimeSocket(n.criSock); err != nil {
		return err
	}
	return n.waitContainerd(ctx)
}

// linkRuntimeSocket makes the node's containerd socket path (runtimeSocket) lead to sock. A
// power cycle empties /run/containerd; the link is made again at boot.
func linkRuntimeSocket(sock string) error {
	if err := os.MkdirAll(filepath.Dir(runtimeSocket), 0o755); err != nil {
		return err
	}
	if err := os.Remove(runtimeSocket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return os.Symlink(sock, runtimeSocket)
}

func (n *realNode) waitContainerd(ctx context.Context) error {
	return localcluster.WaitFor(ctx, time.Minute, 100*time.Millisecond, func() error {
		if !n.containerd.Running() {
			return fmt.Errorf("containerd exited: %s", n.containerd.LogTail(2000))
		}
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := n.cri.Version(c, &runtimeapi.VersionRequest{})
		return err
	})
}

func (n *realNode) importImages(ctx context.Context) error {
	for _, img := range prep.Images {
		out, err := exec.CommandContext(ctx, "ctr", "--address", n.criSock, "-n", "k8s.io", "images", "import", img).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ctr images import %s: %v\n%s", img, err, out)
		}
	}
	return nil
}

func (n *realNode) startKubelet() error {
	dir := filepath.Join(n.dir, "kubelet")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	// The kubelet's pod cgroups go under a cgroup of the suite's own, removed at teardown.
	n.cgroupRoot = "/" + filepath.Base(prep.Scratch)
	if err := n.makeCgroupRoot(); err != nil {
		return err
	}
	ports, err := localcluster.FreePorts(2)
	if err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: %s
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
maxPods: 110
serializeImagePulls: false
`, ports[0], ports[1], n.cgroupRoot, n.criSock)
	cfgPath := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	n.kubelet, err = localcluster.Start("kubelet", prep.Node.Kubelet, filepath.Join(dir, "kubelet.log"),
		"--config", cfgPath, "--kubeconfig", n.cp.Kubeconfig, "--hostname-override", nodeName,
		"--node-ip", nodeIP, "--cert-dir", filepath.Join(dir, "pki"), "--v", "2")
	return err
}

func (n *realNode) startControllers() error {
	ca := filepath.Join(n.cp.Dir, "certs", "apiserver.crt")
	kc := n.cp.Kubeconfig
	ports, err := localcluster.FreePorts(2)
	if err != nil {
		return err
	}
	n.kcm, err = localcluster.Start("kube-controller-manager", prep.Node.KubeControllerManager,
		filepath.Join(n.dir, "kube-controller-manager.log"),
		"--kubeconfig", kc, "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(ports[0]),
		"--root-ca-file", ca, "--cert-dir", filepath.Join(n.dir, "kcm-certs"), "--v", "1")
	if err != nil {
		return err
	}
	n.scheduler, err = localcluster.Start("kube-scheduler", prep.Node.KubeScheduler,
		filepath.Join(n.dir, "kube-scheduler.log"),
		"--kubeconfig", kc, "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(ports[1]),
		"--cert-dir", filepath.Join(n.dir, "scheduler-certs"), "--v", "1")
	return err
}

// makeCgroupRoot creates the kubelet's cgroup root in every cgroup v1 hierarchy (cpuset needs
// its cpus and mems before anything can join).
func (n *realNode) makeCgroupRoot() error {
	dirs, err := makeCgroupRoot(n.cgroupRoot)
	n.cgroupDirs = append(n.cgroupDirs, dirs...)
	return err
}

// makeCgroupRoot creates root in every cgroup v1 hierarchy and returns the directories made.
func makeCgroupRoot(root string) ([]string, error) {
	var made []string
	ents, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return made, err
	}
	for _, e := range ents {
		if !e.IsDir() || e.Type()&os.ModeSymlink != 0 {
			continue
		}
		base := filepath.Join("/sys/fs/cgroup", e.Name())
		d := filepath.Join(base, root)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return made, fmt.Errorf("cgroup %s: %w", d, err)
		}
		made = append(made, d)
		if e.Name() == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(base, f))
				if err != nil {
					return made, err
				}
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return made, fmt.Errorf("%s/%s: %w", d, f, err)
				}
			}
		}
	}
	return made, nil
}

// teardown stops everything in order and fails the test if anything is left: processes, pod
// sandboxes, network namespaces, mounts or cgroups.
func (n *realNode) teardown() {
	t := n.t
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	keepLogs := t.Failed()
	if n.k8s != nil && n.kubelet != nil && n.kubelet.Running() && n.containerd != nil && n.containerd.Running() {
		// The kubelet stops the workload pods while the agent still serves their DEL.
		_ = n.kube.CoreV1().Namespaces().Delete(ctx, testNamespace, metav1.DeleteOptions{})
		if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
			return n.noPodsIn(ctx, testNamespace)
		}); err != nil {
			t.Errorf("teardown: workload pods not gone: %v", err)
		}
		for _, obj := range []client.Object{&ipwardenDaemonSet, &ipwardenDeployment} {
			_ = n.k8s.Delete(ctx, obj.DeepCopyObject().(client.Object))
		}
		if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
			return n.noPodsIn(ctx, "ipwarden-system")
		}); err != nil {
			t.Errorf("teardown: ipwarden pods not gone: %v", err)
		}
	}
	if n.second != nil {
		n.second.teardown(ctx, t)
	}
	for _, p := range []*localcluster.Process{n.scheduler, n.kcm, n.kubelet} {
		if p != nil {
			p.Stop()
		}
	}
	if n.cri != nil && n.containerd != nil && n.containerd.Running() {
		// The kubelet removes stopped sandboxes only on its minute-long GC: remove them here.
		if err := n.removeSandboxes(ctx); err != nil {
			t.Errorf("teardown: %v", err)
		}
		// Each shim exits once containerd has removed its sandbox; on a loaded machine that
		// takes a moment (after the bench's 300 sandboxes at load average 80, 11 shims were
		// still running after a minute).
		if err := localcluster.WaitFor(ctx, 3*time.Minute, 200*time.Millisecond, func() error {
			if left := processesMentioning(n.criSock); len(left) > 0 {
				return fmt.Errorf("%d shims still running", len(left))
			}
			return nil
		}); err != nil {
			t.Errorf("teardown: %v", err)
		}
	}
	if n.criConn != nil {
		n.criConn.Close()
	}
	if n.containerd != nil {
		n.containerd.Stop()
	}
	if n.cp != nil {
		_ = n.cp.Stop()
	}
	if left := processesMentioning(prep.Scratch); len(left) > 0 {
		t.Errorf("teardown: processes left: %v", left)
	}
	// Nothing may remain mounted below the node paths but the suite's own bind mounts.
	if extra := mountsBelow(hostDirs); len(extra) > 0 {
		t.Errorf("teardown: mounts left: %v", extra)
	}
	if ents, _ := os.ReadDir("/run/netns"); len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("teardown: network namespaces left in /run/netns: %v", names)
	}
	for i := len(n.cgroupDirs) - 1; i >= 0; i-- {
		if err := removeCgroupTree(n.cgroupDirs[i]); err != nil {
			t.Errorf("teardown: cgroup %s: %v", n.cgroupDirs[i], err)
		}
	}
	for i := len(hostDirs) - 1; i >= 0; i-- {
		_ = syscall.Unmount(hostDirs[i], syscall.MNT_DETACH)
	}
	if keepLogs {
		t.Logf("logs kept in %s", n.dir)
		copyLogs(n.dir)
	}
}

// copyLogs keeps a failed run's logs under /tmp, outside the scratch directory the parent
// removes.
func copyLogs(dir string) {
	dst := filepath.Join(os.TempDir(), "ipwarden-node-logs-"+time.Now().Format("150405"))
	_ = exec.Command("cp", "-r", dir, dst).Run()
	_ = exec.Command("cp", "-r", "/var/log/pods", dst+"/pods").Run()
	fmt.Fprintln(os.Stderr, "node: logs of the failed run copied to", dst)
}

func (n *realNode) noPodsIn(ctx context.Context, ns string) error {
	pods, err := n.kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	if len(pods.Items) > 0 {
		return fmt.Errorf("%d pods left in %s", len(pods.Items), ns)
	}
	return nil
}

func (n *realNode) removeSandboxes(ctx context.Context) error {
	resp, err := n.cri.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return fmt.Errorf("list sandboxes: %w", err)
	}
	var errs []error
	for _, s := range resp.Items {
		if s.State == runtimeapi.PodSandboxState_SANDBOX_READY {
			errs = append(errs, fmt.Errorf("sandbox %s of %s/%s still ready after its pod was deleted", s.Id[:12], s.Metadata.Namespace, s.Metadata.Name))
			if _, err := n.cri.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: s.Id}); err != nil {
				errs = append(errs, err)
			}
		}
		if _, err := n.cri.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil {
			errs = append(errs, fmt.Errorf("remove sandbox %s: %w", s.Id[:12], err))
		}
	}
	return errors.Join(errs...)
}

// mountsBelow lists mount points strictly below any of dirs (the dirs themselves are the
// suite's bind mounts).
func mountsBelow(dirs []string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return []string{err.Error()}
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := fields[4]
		for _, d := range dirs {
			if strings.HasPrefix(mp, d+"/") {
				out = append(out, mp)
			}
		}
	}
	return out
}

func removeCgroupTree(dir string) error {
	var dirs []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	var errs []error
	for _, d := range dirs {
		if err := syscall.Rmdir(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("%s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// podAddresses scans every pod network namespace on the node (/run/netns, where containerd
// keeps them) and returns address -> namespaces that carry it (IPv4 and IPv6, global scope).
func podAddresses() (map[netip.Addr][]string, error) {
	ents, err := os.ReadDir("/run/netns")
	if err != nil {
		return nil, err
	}
	out := map[netip.Addr][]string{}
	for _, e := range ents {
		b, err := exec.Command("ip", "-n", e.Name(), "-o", "addr", "show", "scope", "global").CombinedOutput()
		if err != nil {
			// A namespace being torn down right now: its file is gone or no longer a namespace.
			if _, statErr := os.Stat(filepath.Join("/run/netns", e.Name())); errors.Is(statErr, os.ErrNotExist) || strings.Contains(string(b), "Invalid argument") {
				continue
			}
			return nil, fmt.Errorf("ip -n %s addr: %v: %s", e.Name(), err, b)
		}
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			for i := 0; i+1 < len(f); i++ {
				if f[i] == "inet" || f[i] == "inet6" {
					if p, err := netip.ParsePrefix(f[i+1]); err == nil {
						out[p.Addr()] = append(out[p.Addr()], e.Name())
					}
				}
			}
		}
	}
	return out, nil
}

// duplicates are addresses on more than one pod network namespace.
func duplicates(addrs map[netip.Addr][]string) []string {
	var d []string
	for a, ns := range addrs {
		if len(ns) > 1 {
			d = append(d, fmt.Sprintf("%s on %v", a, ns))
		}
	}
	sort.Strings(d)
	return d
}

func run(name string, args ...string) error {
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %v: %v: %s", name, args, err, out)
	}
	return nil
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}

// volatileDirs are the node paths a reboot empties (tmpfs on a real node).
var volatileDirs = []string{"/run/netns", "/run/containerd", "/run/ipwarden"}

// powerCycle simulates a node losing power and booting again: the kubelet, containerd, every
// shim and container are SIGKILLed; what a reboot drops goes (mounts, /run, network namespaces,
// the bridge and veths, iptables, cgroups); what is on disk stays (/var/lib/containerd,
// /var/lib/kubelet, the agent's journal in /var/lib/ipwarden). The control plane lives on other
// machines and keeps running. Then containerd and the kubelet start again.
func (n *realNode) powerCycle(ctx context.Context) error {
	n.kubelet.Kill()
	n.containerd.Kill()
	// Every container process: all of them live in the kubelet's cgroup root.
	for i := 0; i < 3; i++ {
		for _, d := range n.cgroupDirs {
			_ = filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
				if err != nil || e.IsDir() || e.Name() != "cgroup.procs" {
					return nil
				}
				b, _ := os.ReadFile(p)
				for _, f := range strings.Fields(string(b)) {
					if pid, err := strconv.Atoi(f); err == nil {
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
				return nil
			})
		}
		// The shims (their command lines name the containerd socket).
		for pid := range processesMentioning(n.criSock) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if err := localcluster.WaitFor(ctx, 30*time.Second, 100*time.Millisecond, func() error {
		if left := processesMentioning(n.criSock); len(left) > 0 {
			return fmt.Errorf("shims still running: %v", left)
		}
		return nil
	}); err != nil {
		return err
	}
	// Unmount everything below the node paths, deepest first (tmpfs volumes, rootfs overlays,
	// sandbox shm, network namespace bind mounts).
	mounts := mountsBelow(hostDirs)
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
	for _, m := range mounts {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
			return fmt.Errorf("unmount %s: %w", m, err)
		}
	}
	for _, d := range volatileDirs {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if err := os.RemoveAll(filepath.Join(d, e.Name())); err != nil {
				return fmt.Errorf("power cycle: clear %s: %w", d, err)
			}
		}
	}
	// Links and iptables of the node's network namespace (this one) go with a reboot.
	links, _ := exec.Command("ip", "-o", "link", "show").Output()
	for _, line := range strings.Split(string(links), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if name != "lo" {
			_ = exec.Command("ip", "link", "del", name).Run()
		}
	}
	for _, table := range []string{"filter", "nat", "mangle"} {
		_ = exec.Command("iptables", "-t", table, "-F").Run()
		_ = exec.Command("iptables", "-t", table, "-X").Run()
	}
	for i := len(n.cgroupDirs) - 1; i >= 0; i-- {
		if err := removeCgroupTree(n.cgroupDirs[i]); err != nil {
			return fmt.Errorf("power cycle: cgroups: %w", err)
		}
	}
	n.cgroupDirs = nil
	if err := n.makeCgroupRoot(); err != nil {
		return err
	}
	n.logf("power cycle: everything on the node killed and volatile state dropped; booting")
	if err := n.containerd.Restart(); err != nil {
		return err
	}
	if err := linkRuntimeSocket(n.criSock); err != nil {
		return err
	}
	if err := n.waitContainerd(ctx); err != nil {
		return err
	}
	return n.kubelet.Restart()
}
