package integration

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// ipwardenBinary builds cmd/ipwarden once per test binary into _bin/test/ (with -race when the
// tests run with it: localcluster.GoBuild), with the failpoints build tag: the failpoints
// (internal/agent/failpoints.go) are still off unless a test sets IPWARDEN_FAILPOINT.
func ipwardenBinary(t *testing.T) string {
	t.Helper()
	return testBinary(t, "ipwarden", "./cmd/ipwarden", "failpoints")
}

// testBinary builds the package pkg of this tree once per test binary into _bin/test/name,
// with the build tags tags.
func testBinary(t *testing.T, name, pkg string, tags ...string) string {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(controlplane.BinDir(root), "test", name)
	if err := (localcluster.GoBuild{Dir: root, Out: out, Pkgs: []string{pkg}, Tags: tags}).Once(); err != nil {
		t.Fatal(err)
	}
	return out
}

// plainIpwardenBinary is cmd/ipwarden built without -race even when the tests run with it, for
// a test that measures the program's own memory (the race runtime multiplies it).
func plainIpwardenBinary(t *testing.T) string {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(controlplane.BinDir(root), "test", "plain", "ipwarden")
	if err := (localcluster.GoBuild{Dir: root, Out: out, Pkgs: []string{"./cmd/ipwarden"}, NoRace: true}).Once(); err != nil {
		t.Fatal(err)
	}
	return out
}

// startProcess runs ipwarden with args (localcluster.Start), logging to logPath. At the end of
// the test it is killed, a data race it reported fails the test, and its log is printed if the
// test failed (or IPWARDEN_TEST_LOGS is set).
func startProcess(t *testing.T, name, logPath string, args ...string) *localcluster.Process {
	t.Helper()
	return startProgram(t, ipwardenBinary(t), name, logPath, args...)
}

// startProgram is startProcess with the ipwarden binary bin.
func startProgram(t *testing.T, bin, name, logPath string, args ...string) *localcluster.Process {
	t.Helper()
	p, err := localcluster.Start(name, bin, logPath, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Kill()
		if race := p.DataRace(); race != "" {
			t.Errorf("%s reported a data race:\n%s", name, race)
		}
		if t.Failed() || os.Getenv("IPWARDEN_TEST_LOGS") != "" {
			t.Logf("%s log (tail):\n%s", name, p.LogTail(12000))
		}
	})
	return p
}

// controllerProcess is a real `ipwarden controller` process.
type controllerProcess struct {
	*localcluster.Process
	cmd  *exec.Cmd
	log  string
	done <-chan struct{}
}

// startController runs `ipwarden controller` against the test API server; it is killed at the
// end of the test and its log is printed if the test failed.
func startController(t *testing.T, args ...string) *controllerProcess {
	t.Helper()
	base := []string{"controller", "--kubeconfig", kubeconfigPath, "--leader-elect=false",
		"--metrics-bind-address=0", "--health-probe-bind-address=0",
		"--min-sync-interval=20ms", "--pool-status-interval=200ms", "--backoff-base=50ms", "--backoff-max=2s", "--claim-settle=100ms",
		// Tests here write nodes' specs by hand or run Nodes without agents: no agent reports new pools
		// (spec.observedPools); the takeover tests turn the wait on.
		"--pool-settle=-1s"}
	p := startProcess(t, "controller", filepath.Join(t.TempDir(), "controller.log"), append(base, args...)...)
	return &controllerProcess{Process: p, cmd: p.Cmd(), log: p.Log, done: p.Done()}
}

// kill sends SIGKILL, as a crash would.
func (p *controllerProcess) kill() { p.Kill() }

// eventually polls cond until it returns nil or the deadline passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	if err := localcluster.WaitFor(context.Background(), timeout, 50*time.Millisecond, cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func createNode(t *testing.T, name string, labels map[string]string) *corev1.Node {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	if err := k8s.Create(context.Background(), n); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = k8s.Delete(context.Background(), n)
		_ = k8s.Delete(context.Background(), &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name}})
	})
	return n
}

func createPool(t *testing.T, name string, spec ipwardenv1.IPPoolSpec) *ipwardenv1.IPPool {
	t.Helper()
	if spec.Scaling == (ipwardenv1.Scaling{}) {
		spec.Scaling = ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}
	}
	p := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: spec}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p) })
	return p
}

// waitAllocation waits for the controller to create a node's NodeIPAllocation.
func waitAllocation(t *testing.T, name string) *ipwardenv1.NodeIPAllocation {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	eventually(t, 30*time.Second, "NodeIPAllocation "+name, func() error {
		return k8s.Get(context.Background(), client.ObjectKey{Name: name}, a)
	})
	return a
}

// request writes a node's spec for one pool, as its agent does.
func request(t *testing.T, node, pool string, requested int, releasing addr.Set) {
	t.Helper()
	writePoolRequest(t, node, ipwardenv1.NodePoolRequest{Pool: pool, Requested: int32(requested), Releasing: blocks(releasing.Strings())})
}

// writePoolRequest sets a node's spec entry for entry.Pool (the other pools' stay).
func writePoolRequest(t *testing.T, node string, entry ipwardenv1.NodePoolRequest) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		a := &ipwardenv1.NodeIPAllocation{}
		if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
			return err
		}
		found := false
		for i := range a.Spec.Pools {
			if a.Spec.Pools[i].Pool == entry.Pool {
				a.Spec.Pools[i], found = entry, true
			}
		}
		if !found {
			a.Spec.Pools = append(a.Spec.Pools, entry)
		}
		return k8s.Update(context.Background(), a)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// blocks converts address blocks' strings for a spec.
func blocks(ss []string) []ipwardenv1.AddressBlock {
	var out []ipwardenv1.AddressBlock
	for _, s := range ss {
		out = append(out, ipwardenv1.AddressBlock(s))
	}
	return out
}

// held returns what a node's status holds from a pool.
func held(t *testing.T, node, pool string) addr.Set {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
		if apierrors.IsNotFound(err) {
			return addr.Set{}
		}
		t.Fatal(err)
	}
	for _, p := range a.Status.Pools {
		if p.Pool == pool {
			s, err := addr.ParseSet(p.Addresses)
			if err != nil {
				t.Fatalf("node %s status for pool %s does not parse: %v", node, pool, err)
			}
			if int(p.Held) != size(s) {
				t.Fatalf("node %s pool %s: held %d but %d addresses listed", node, pool, p.Held, size(s))
			}
			return s
		}
	}
	return addr.Set{}
}

func size(s addr.Set) int {
	n, _ := s.Size().Uint64()
	return int(n)
}

// waitHeld waits until a node holds exactly n addresses of a pool.
func waitHeld(t *testing.T, node, pool string, n int) addr.Set {
	t.Helper()
	var s addr.Set
	eventually(t, 30*time.Second, fmt.Sprintf("node %s to hold %d addresses of %s", node, n, pool), func() error {
		s = held(t, node, pool)
		if size(s) != n {
			return fmt.Errorf("holds %d: %v", size(s), s)
		}
		return nil
	})
	return s
}

func getPool(t *testing.T, name string) *ipwardenv1.IPPool {
	t.Helper()
	p := &ipwardenv1.IPPool{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: name}, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// assertDisjoint checks invariant 1 across nodes: no address is held by two nodes.
func assertDisjoint(t *testing.T, holdings map[string]addr.Set) {
	t.Helper()
	var seen addr.Set
	for node, s := range holdings {
		if dup := seen.Intersect(s); !dup.IsEmpty() {
			t.Fatalf("addresses %v held twice (one holder is %s)", dup, node)
		}
		seen = seen.Union(s)
	}
}

func mustPrefix(s string) addr.Set {
	return addr.SetOfPrefixes(netip.MustParsePrefix(s))
}

func condition(conds []metav1.Condition, typ string) *metav1.Condition {
	for i := range conds {
		if conds[i].Type == typ {
			return &conds[i]
		}
	}
	return nil
}
