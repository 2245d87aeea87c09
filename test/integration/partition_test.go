package integration

import (
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// apiProxy puts a loopback proxy between a component and the test API server and returns it with
// a kubeconfig that goes through it (the component's --kubeconfig).
func apiProxy(t *testing.T) (*localcluster.Proxy, string) {
	t.Helper()
	u, err := url.Parse(controlPlane.URL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := localcluster.NewProxy(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	kc, err := clientcmd.LoadFromFile(kubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range kc.Clusters {
		c.Server = "https://" + p.Addr
	}
	path := filepath.Join(t.TempDir(), "kubeconfig-proxy")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return p, path
}

// One agent cut off from the API server while the rest of the cluster churns. Node a gives
// addresses back and is cut off right after its spec says so: the controller takes them back
// and hands them to node b's pods (cooldown 0) while node a cannot see it. Node a keeps serving
// DEL, and ADD for the pods its watch knows, from its journal meanwhile, and never hands out
// what it gave back; a pod bound meanwhile is refused until it can be read. Then it comes back
// and reconciles. At every step no address is on pods of both nodes, and at the end
// `ipwarden check` (with both agents) is clean and node a publishes its request again.
func TestAgentCutOffWhileTheClusterChurns(t *testing.T) {
	ctx := context.Background()
	w := watchStatuses(t)
	agentPool(t, "cutoff", "cutoff", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.129.0.0/26"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64, ReleaseDelay: &metav1.Duration{Duration: 0}},
		ReuseCooldown: cooldown(0),
	})
	agentNode(t, "cutoff-a", "cutoff")
	agentNode(t, "cutoff-b", "cutoff")
	startController(t)
	proxy, kc := apiProxy(t)
	a := startAgent(t, "cutoff-a", "", "--kubeconfig", kc, "--gc-grace=1h", "--address-wait=2s")
	b := startAgent(t, "cutoff-b", "", "--gc-grace=1h")
	a.waitServing(t)
	b.waitServing(t)
	confA, confB := pluginConf("1.1.0", a.socket, "cutoff"), pluginConf("1.1.0", b.socket, "cutoff")
	disjoint := func(when string) {
		t.Helper()
		if ua, ub := usedBy(t, a), usedBy(t, b); ua.Overlaps(ub) {
			t.Fatalf("%s: %v is on pods of both nodes", when, ua.Intersect(ub))
		}
	}
	podsA := map[string]*corev1.Pod{}
	addA := func(cid string) string {
		t.Helper()
		p := createBoundPod(t, "cutoff-"+cid, "cutoff-a")
		podsA[cid] = p
		r, e := cni(t, "ADD", confA, cid, podArgs("default", p.Name, string(p.UID)))
		if e != nil {
			t.Fatalf("ADD %s on node a: %v", cid, e)
		}
		return r.IPs[0].Address
	}
	for i := range 12 {
		addA(fmt.Sprintf("a%d", i))
	}
	// Two pods bound to node a that start while it is cut off: its watch knows them (the
	// request counts them: 12 in use + 2 = 14 -> 16).
	late := []*corev1.Pod{createBoundPod(t, "cutoff-cut0", "cutoff-a"), createBoundPod(t, "cutoff-cut1", "cutoff-a")}
	eventually(t, 30*time.Second, "node a's request to count the two bound pods", func() error {
		if n, _ := requested(t, "cutoff-a", "cutoff"); n != 16 {
			return fmt.Errorf("requested %d", n)
		}
		return nil
	})
	// Eight pods end: node a holds more than it needs and gives the spare back (release delay 0).
	for i := range 8 {
		cid := fmt.Sprintf("a%d", i)
		if _, e := cni(t, "DEL", confA, cid, podArgs("default", "cutoff-"+cid, "")); e != nil {
			t.Fatal(e)
		}
		if err := k8s.Delete(ctx, podsA[cid], client.GracePeriodSeconds(0)); err != nil {
			t.Fatal(err)
		}
	}
	var released addr.Set
	eventually(t, 30*time.Second, "node a's spec to give addresses back", func() error {
		_, rel := requested(t, "cutoff-a", "cutoff")
		if len(rel) == 0 {
			return fmt.Errorf("nothing releasing yet")
		}
		released, _ = addr.ParseSet(rel)
		return nil
	})
	cut := proxy.Block()
	t.Logf("node a cut off from the API server (%d connections cut); it releases %v", cut, released)

	// The controller takes them back and node b's pods get them.
	eventually(t, 30*time.Second, "the controller to take node a's released addresses back", func() error {
		if h := held(t, "cutoff-a", "cutoff"); h.Overlaps(released) {
			return fmt.Errorf("node a still holds %v", h.Intersect(released))
		}
		return nil
	})
	for i := range 40 {
		p := createBoundPod(t, fmt.Sprintf("cutoff-b%d", i), "cutoff-b")
		if _, e := cni(t, "ADD", confB, fmt.Sprintf("b%d", i), podArgs("default", p.Name, string(p.UID))); e != nil {
			t.Fatalf("ADD on node b: %v", e)
		}
	}
	disjoint("node b filled while node a is cut off")
	// Node a serves from its journal meanwhile: DELs and ADDs, never a released address.
	for i := 8; i < 10; i++ {
		cid := fmt.Sprintf("a%d", i)
		if _, e := cni(t, "DEL", confA, cid, podArgs("default", "cutoff-"+cid, "")); e != nil {
			t.Fatalf("DEL on node a while cut off: %v", e)
		}
	}
	for i, p := range late {
		got := addrOf(t, addFor(t, confA, fmt.Sprintf("cut%d", i), p))
		if released.Contains(got) {
			t.Fatalf("node a handed out %s, which it gave back, while cut off", got)
		}
	}
	// A pod bound while it is cut off cannot have been seen: its ADD is refused (CNI error 11,
	// the runtime retries), never given pools as if it had no annotations.
	p := createBoundPod(t, "cutoff-cut2", "cutoff-a")
	if _, e := cni(t, "ADD", confA, "cut2", podArgs("default", p.Name, string(p.UID))); e == nil || e.Code != 11 ||
		!strings.Contains(e.Msg, "cannot read pod default/cutoff-cut2's annotations") {
		t.Fatalf("ADD of a pod bound while node a is cut off: %+v", e)
	}
	disjoint("node a served while cut off")

	// Node a comes back: it sees the take-back, and publishes its request again (the pod whose
	// ADD failed is still bound to it: demand).
	proxy.Unblock()
	eventually(t, 60*time.Second, "node a to reconcile after the cut", func() error {
		// (Addresses the controller took may stay listed as releasing until the node's next
		// write: harmless, the controller never hands a node what it lists as releasing.)
		n, _ := requested(t, "cutoff-a", "cutoff")
		if ua := usedBy(t, a); n < size(ua)+1 {
			return fmt.Errorf("node a requests %d, its pods use %d and one more waits", n, size(ua))
		}
		if h := held(t, "cutoff-a", "cutoff"); !h.ContainsSet(usedBy(t, a)) {
			return fmt.Errorf("node a holds %v, its pods use %v", h, usedBy(t, a))
		}
		return nil
	})
	disjoint("after node a came back")
	eventually(t, 30*time.Second, "ipwarden check to be clean", func() error {
		r, code, stderr := runCheck(t, "--agent", "cutoff-a="+a.socket, "--agent", "cutoff-b="+b.socket, "--grace=1h")
		if code != 0 || len(r.Findings) > 0 {
			return fmt.Errorf("check exit %d: %+v %s", code, r.Findings, stderr)
		}
		return nil
	})
	w.check(t)
}
