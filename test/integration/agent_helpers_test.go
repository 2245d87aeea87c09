package integration

// Helpers of the node agent's integration tests: real `ipwarden agent` processes and the real
// ipwarden-cni binary, against the package's API server and a real controller process.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// cniBinary builds cmd/ipwarden-cni once per test binary into _bin/test/.
func cniBinary(t *testing.T) string {
	t.Helper()
	return testBinary(t, "ipwarden-cni", "./cmd/ipwarden-cni")
}

// agentProcess is a real `ipwarden agent` process.
type agentProcess struct {
	node     string
	socket   string
	stateDir string
	metrics  string
	bin      string   // the ipwarden binary ("": ipwardenBinary)
	env      []string // extra environment (NAME=value) of the next start, e.g. IPWARDEN_FAILPOINT
	proc     *localcluster.Process
	cmd      *exec.Cmd
	log      string
	done     <-chan struct{}
}

// startAgent runs `ipwarden agent` for node with its socket in a fresh short directory (unix
// socket paths are limited to 108 bytes) and the journal in stateDir ("" for a fresh one). It
// does not wait for the agent to serve; see waitServing. The agent is killed at the end of the
// test and its log printed if the test failed (or IPWARDEN_TEST_LOGS is set).
func startAgent(t *testing.T, node, stateDir string, args ...string) *agentProcess {
	t.Helper()
	return startAgentBinary(t, "", node, stateDir, args...)
}

// startAgentBinary is startAgent running the ipwarden binary bin ("": ipwardenBinary).
func startAgentBinary(t *testing.T, bin, node, stateDir string, args ...string) *agentProcess {
	t.Helper()
	return startAgentEnv(t, bin, nil, node, stateDir, args...)
}

// startAgentEnv is startAgentBinary with env (NAME=value) added to the agent's environment, at
// this start and the next ones until a.env is changed.
func startAgentEnv(t *testing.T, bin string, env []string, node, stateDir string, args ...string) *agentProcess {
	t.Helper()
	runDir, err := os.MkdirTemp("", "ipw-run-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	if stateDir == "" {
		stateDir = t.TempDir()
	}
	a := &agentProcess{node: node, socket: filepath.Join(runDir, "s", "agent.sock"), stateDir: stateDir, metrics: freeAddr(t), bin: bin, env: env}
	a.start(t, args...)
	return a
}

func (a *agentProcess) start(t *testing.T, args ...string) {
	t.Helper()
	logf, err := os.CreateTemp(t.TempDir(), "agent-*.log")
	if err != nil {
		t.Fatal(err)
	}
	logf.Close()
	base := []string{"agent", "--kubeconfig", kubeconfigPath, "--node-name", a.node, "--socket", a.socket,
		"--state-dir", a.stateDir, "--metrics-bind-address", a.metrics, "--health-probe-bind-address=0", "--zap-log-level=debug",
		"--netns-dirs", netnsDir}
	bin := a.bin
	if bin == "" {
		bin = ipwardenBinary(t)
	}
	argv := append(base, args...)
	if len(a.env) > 0 {
		// env(1) execs the agent: same process, same process group, so kill still reaches it.
		argv = append(append(append([]string{}, a.env...), bin), argv...)
		if bin, err = exec.LookPath("env"); err != nil {
			t.Fatal(err)
		}
	}
	a.proc = startProgram(t, bin, "agent "+a.node, logf.Name(), argv...)
	a.cmd, a.log, a.done = a.proc.Cmd(), a.proc.Log, a.proc.Done()
}

// kill sends SIGKILL, as a crash would.
func (a *agentProcess) kill() { a.proc.Kill() }

// restart kills the agent and starts it again on the same journal and socket.
func (a *agentProcess) restart(t *testing.T, args ...string) {
	t.Helper()
	a.kill()
	a.start(t, args...)
}

func (a *agentProcess) logContains(s string) bool {
	b, _ := os.ReadFile(a.log)
	return bytes.Contains(b, []byte(s))
}

// list asks the agent for its attachments and pools.
func (a *agentProcess) list(t *testing.T) (*cniproto.Response, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cniproto.Call(ctx, a.socket, cniproto.Request{Op: cniproto.OpList})
	if err != nil {
		return nil, err
	}
	return resp, resp.AsError()
}

// waitServing waits until the agent serves ADD: it answers on its socket (at once, from its
// journal) and STATUS no longer says that it waits for the API server or another agent's Lease.
func (a *agentProcess) waitServing(t *testing.T) {
	t.Helper()
	eventually(t, 60*time.Second, "agent "+a.node+" to serve on its socket", func() error {
		select {
		case <-a.done:
			t.Fatalf("agent %s exited", a.node)
		default:
		}
		if _, err := a.list(t); err != nil {
			return err
		}
		return a.addGate(t)
	})
}

// addGate returns the agent's STATUS error if it says that ADD is refused for now (waiting for
// the API server, or another agent holds the node's Lease).
func (a *agentProcess) addGate(t *testing.T) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cniproto.Call(ctx, a.socket, cniproto.Request{Op: cniproto.OpStatus})
	if err != nil {
		return err
	}
	if e := resp.AsError(); e != nil && (strings.Contains(e.Error(), "does not serve ADD") || strings.Contains(e.Error(), "Lease")) {
		return e
	}
	return nil
}

// pool returns the agent's view of one pool.
func (a *agentProcess) pool(t *testing.T, name string) cniproto.PoolStatus {
	t.Helper()
	resp, err := a.list(t)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range resp.Pools {
		if p.Pool == name {
			return p
		}
	}
	return cniproto.PoolStatus{}
}

// cniResult is the part of a CNI result the tests read.
type cniResult struct {
	CNIVersion string `json:"cniVersion"`
	IPs        []struct {
		Address string `json:"address"`
		Gateway string `json:"gateway"`
	} `json:"ips"`
	Routes []struct {
		Dst string `json:"dst"`
	} `json:"routes"`
}

func (r *cniResult) addrs() []string {
	var out []string
	for _, ip := range r.IPs {
		out = append(out, ip.Address)
	}
	return out
}

// pluginConf is a network configuration delegating IPAM to ipwarden with socket and pools.
func pluginConf(version, socket string, pools ...string) string {
	ipamConf := map[string]any{"type": "ipwarden", "socket": socket}
	if len(pools) > 0 {
		ipamConf["pools"] = pools
	}
	b, _ := json.Marshal(map[string]any{"cniVersion": version, "name": "podnet", "type": "bridge", "ipam": ipamConf})
	return string(b)
}

// cni runs the real plugin binary for one verb and returns its result or its CNI error. Its
// CNI_NETNS is a namespace path that does not exist.
func cni(t *testing.T, verb, conf, containerID string, podArgs string) (*cniResult, *cnitypes.Error) {
	t.Helper()
	return cniIn(t, verb, conf, containerID, podArgs, filepath.Join(netnsDir, "none"))
}

// cniIn is cni with the network namespace path netns as CNI_NETNS.
func cniIn(t *testing.T, verb, conf, containerID, podArgs, netns string) (*cniResult, *cnitypes.Error) {
	t.Helper()
	cmd := exec.Command(cniBinary(t))
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=" + netns,
		"CNI_NETNS_OVERRIDE=1", "CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin", "CNI_ARGS=" + podArgs, localcluster.RaceEnv}
	cmd.Stdin = strings.NewReader(conf)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		var e cnitypes.Error
		if jerr := json.Unmarshal(out.Bytes(), &e); jerr != nil {
			t.Fatalf("%s %s: %v without a CNI error: %s %s", verb, containerID, err, out.String(), errOut.String())
		}
		return nil, &e
	}
	if verb != "ADD" {
		return nil, nil
	}
	var r cniResult
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("%s %s: result %q: %v", verb, containerID, out.String(), err)
	}
	return &r, nil
}

func podArgs(ns, name, uid string) string {
	return fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_UID=%s", ns, name, uid)
}

func mustAdd(t *testing.T, conf, cid string) *cniResult {
	t.Helper()
	r, e := cni(t, "ADD", conf, cid, podArgs("default", "pod-"+cid, "uid-"+cid))
	if e != nil {
		t.Fatalf("ADD %s: %v", cid, e)
	}
	return r
}

func mustDel(t *testing.T, conf, cid string) {
	t.Helper()
	if _, e := cni(t, "DEL", conf, cid, podArgs("default", "pod-"+cid, "uid-"+cid)); e != nil {
		t.Fatalf("DEL %s: %v", cid, e)
	}
}
