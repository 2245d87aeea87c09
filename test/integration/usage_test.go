package integration

// The usage view (`ipwarden usage`, `ipwarden who`, and the same as `kubectl ipwarden`) against
// the real API server with a real controller, agent and plugin, read with only the
// ipwarden-viewer ClusterRole shipped in deploy/.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/usage"
)

// viewerKubeconfig applies deploy/kustomize/viewer-rbac.yaml, binds its ClusterRole to a user,
// and returns a kubeconfig that acts as that user (impersonation), so the commands run with
// exactly the shipped read-only permissions.
func viewerKubeconfig(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "deploy/kustomize/viewer-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var role rbacv1.ClusterRole
	if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096).Decode(&role); err != nil {
		t.Fatal(err)
	}
	if role.Name != "ipwarden-viewer" {
		t.Fatalf("viewer-rbac.yaml holds ClusterRole %q, want ipwarden-viewer", role.Name)
	}
	if err := k8s.Create(ctx, &role); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "usage-viewer"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "ipwarden-viewer"},
		Subjects: []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: "usage-viewer"}}}
	if err := k8s.Create(ctx, binding); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), binding) })
	cfg, err := clientcmd.LoadFromFile(kubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, ai := range cfg.AuthInfos {
		ai.Impersonate = "usage-viewer"
	}
	path := filepath.Join(t.TempDir(), "viewer.kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// runJSON runs a command and decodes its JSON output into out.
func runJSON(t *testing.T, out any, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	b, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
	}
	if err := json.Unmarshal(b, out); err != nil {
		t.Fatalf("%s %s: output is not JSON: %v\n%s", name, strings.Join(args, " "), err, b)
	}
}

func TestUsageView(t *testing.T) {
	const node = "usage-n1"
	// 10.141.0.0/27: 32 addresses; network, broadcast and gateway .1 reserved, .30 excluded: 28 usable.
	agentPool(t, "usage", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.141.0.0/27"},
		Exclude: []ipwardenv1.IPOrCIDR{"10.141.0.30"}, Gateway: "10.141.0.1",
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	web, db := createBoundPod(t, "usage-web", node), createBoundPod(t, "usage-db", node)
	webIP := strings.Split(addFor(t, conf, "usage-web-sandbox", web), "/")[0]
	addFor(t, conf, "usage-db-sandbox", db)
	// The kubelet reports the web pod's address; the db pod's status has none yet.
	setPodIP(t, web, webIP)

	// Settle: the node holds what it requests.
	var held addr.Set
	var requested int32
	eventually(t, 30*time.Second, "the node to hold what it requests", func() error {
		a := nipa(t, node)
		if len(a.Spec.Pools) != 1 || len(a.Status.Pools) != 1 {
			return errors.New("no request or status yet")
		}
		s, err := addr.ParseSet(a.Status.Pools[0].Addresses)
		if err != nil {
			return err
		}
		requested = a.Spec.Pools[0].Requested
		if n := size(s); n != int(requested) || n == 0 {
			return errors.New("held differs from requested")
		}
		held = s
		return nil
	})
	nHeld := int64(size(held))
	viewer := viewerKubeconfig(t)
	bin := ipwardenBinary(t)

	// Per pool, in-use from the pods' status: only web reported its address.
	var pools struct{ Pools []usage.Pool }
	runJSON(t, &pools, bin, "usage", "--kubeconfig", viewer, "-o", "json")
	var got *usage.Pool
	for i := range pools.Pools {
		if pools.Pools[i].Name == "usage" {
			got = &pools.Pools[i]
		}
	}
	want := usage.Pool{Name: "usage", Capacity: 28, Allocated: nHeld, Held: nHeld, InUse: 1, Free: 28 - nHeld, Reserved: 4, Nodes: 1}
	if got == nil || *got != want {
		t.Fatalf("usage of pool usage = %+v, want %+v", got, want)
	}
	// From the agent's journal: both sandboxes.
	runJSON(t, &pools, bin, "usage", "--kubeconfig", viewer, "-o", "json", "--agent", node+"="+ag.socket)
	for _, p := range pools.Pools {
		if p.Name == "usage" && p.InUse != 2 {
			t.Fatalf("usage with the agent asked: in use %d, want 2", p.InUse)
		}
	}

	// Per node.
	var nodes struct{ Nodes []usage.Node }
	runJSON(t, &nodes, bin, "usage", "--nodes", "--kubeconfig", viewer, "-o", "json", "--agent", node+"="+ag.socket)
	var row *usage.Node
	for i := range nodes.Nodes {
		if nodes.Nodes[i].Node == node {
			row = &nodes.Nodes[i]
		}
	}
	wantRow := usage.Node{Node: node, Pool: "usage", Held: nHeld, InUse: 2, Requested: requested, Runs: held.NumRanges(), Source: usage.FromAgent}
	if row == nil || *row != wantRow {
		t.Fatalf("node row %+v, want %+v", row, wantRow)
	}

	// Who: the web pod's address, an excluded one, a reserved one, a free one.
	var free string
	for i := 2; i < 30; i++ {
		a := netip.AddrFrom4([4]byte{10, 141, 0, byte(i)})
		if !held.Contains(a) {
			free = a.String()
			break
		}
	}
	for _, tc := range []struct {
		addr  string
		state string
		pod   string
	}{
		{webIP, usage.StateHeld, "default/usage-web"},
		{"10.141.0.30", usage.StateExcluded, ""},
		{"10.141.0.1", usage.StateReserved, ""},
		{free, usage.StateFree, ""},
		{"192.0.2.1", usage.StateNoPool, ""},
	} {
		var w usage.Who
		runJSON(t, &w, bin, "who", tc.addr, "--kubeconfig", viewer, "-o", "json")
		if w.State != tc.state || (tc.pod != "" && (len(w.Holders) != 1 || w.Holders[0].Pod != tc.pod || len(w.Nodes) != 1 || w.Nodes[0] != node)) {
			t.Errorf("who %s = %+v, want state %s, pod %q on %s", tc.addr, w, tc.state, tc.pod, node)
		}
	}

	// Text output, shaped like kubectl get.
	out, err := exec.Command(bin, "usage", "--kubeconfig", viewer).CombinedOutput()
	if err != nil {
		t.Fatalf("usage: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if !strings.HasPrefix(lines[0], "POOL") || !strings.Contains(lines[0], "IN USE") || !strings.Contains(string(out), "usage ") {
		t.Errorf("usage text output:\n%s", out)
	}

	// As a kubectl plugin: kubectl finds kubectl-ipwarden on the PATH and passes the arguments.
	dir := t.TempDir()
	if err := os.Symlink(bin, filepath.Join(dir, "kubectl-ipwarden")); err != nil {
		t.Fatal(err)
	}
	kc := exec.Command(kubectl(t), "ipwarden", "who", webIP, "--kubeconfig", viewer, "-o", "json")
	kc.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	var stderr bytes.Buffer
	kc.Stderr = &stderr
	b, err := kc.Output()
	if err != nil {
		t.Fatalf("kubectl ipwarden who: %v\n%s", err, stderr.String())
	}
	var w usage.Who
	if err := json.NewDecoder(io.LimitReader(bytes.NewReader(b), 1<<20)).Decode(&w); err != nil || w.State != usage.StateHeld {
		t.Fatalf("kubectl ipwarden who %s: %v %+v\n%s", webIP, err, w, b)
	}
	// Read-only: the viewer cannot write what it reads.
	vc, err := clientcmd.BuildConfigFromFlags("", viewer)
	if err != nil {
		t.Fatal(err)
	}
	vcl, err := client.New(vc, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	pool := getPool(t, "usage")
	pool.Spec.Exclude = nil
	if err := vcl.Update(context.Background(), pool); !apierrors.IsForbidden(err) {
		t.Errorf("the viewer updated a pool: %v", err)
	}
}
