package integration

// Static addresses (docs/design.md, "Static addresses"): real agents, controller and plugin
// processes on the real API server, with real pods.

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// A pod on a chosen node asks for 10.151.0.200: the controller moves it into that node's
// holding and the pod gets it. A pod on another node asking for it gets a clear error and takes
// nothing (invariant 1: the running pod keeps it); so does a second pod on the same node; a
// malformed, outside or excluded address is refused at once. The address the other node holds
// as a spare is never taken from it either.
func TestStaticAddress(t *testing.T) {
	const label = "static"
	agentPool(t, "st", label, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.151.0.0/24"}, ReuseCooldown: cooldown(0),
		Exclude: []ipwardenv1.IPOrCIDR{"10.151.0.250"}, Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}})
	agentNode(t, "static-a", label)
	agentNode(t, "static-b", label)
	startController(t)
	agA := startAgent(t, "static-a", "")
	agB := startAgent(t, "static-b", "")
	agA.waitServing(t)
	agB.waitServing(t)
	confA, confB := pluginConf("1.1.0", agA.socket), pluginConf("1.1.0", agB.socket)
	ann := func(ips string) map[string]string { return map[string]string{podinfo.AnnotationIPAddresses: ips} }

	p1 := createAnnotatedPod(t, "default", "static-1", "static-a", ann("10.151.0.200"))
	if a := addFor(t, confA, "st-1", p1); a != "10.151.0.200/24" {
		t.Fatalf("static pod got %s, want 10.151.0.200/24", a)
	}
	if h := held(t, "static-a", "st"); !h.Contains(netip.MustParseAddr("10.151.0.200")) {
		t.Fatalf("node static-a holds %v, not the static address", h)
	}
	// The wanted list empties once the pod has it: it costs writes for that pod only.
	eventually(t, 10*time.Second, "static-a to stop wanting the address", func() error {
		for _, p := range nipa(t, "static-a").Spec.Pools {
			if len(p.Wanted) > 0 {
				return fmt.Errorf("wanted %v", p.Wanted)
			}
		}
		return nil
	})

	// Another node's pod asking for it: refused with the reason, the running pod keeps it.
	p2 := createAnnotatedPod(t, "default", "static-2", "static-b", ann("10.151.0.200"))
	_, e := cni(t, "ADD", confB, "st-2", podArgs(p2.Namespace, p2.Name, string(p2.UID)))
	if e == nil || e.Code != 11 || !strings.Contains(e.Msg, "held by node static-a") {
		t.Fatalf("ADD of a static address another node's pod uses: %+v", e)
	}
	// A second pod on the same node: in use.
	p3 := createAnnotatedPod(t, "default", "static-3", "static-a", ann("10.151.0.200"))
	_, e = cni(t, "ADD", confA, "st-3", podArgs(p3.Namespace, p3.Name, string(p3.UID)))
	if e == nil || e.Code != 11 || !strings.Contains(e.Msg, "in use by pod default/static-1") {
		t.Fatalf("ADD of a static address in use on the node: %+v", e)
	}
	// A spare static-b holds (its lowest address, used by no pod) is not taken from it: static-b's
	// agent gives it back once static-a's agent asks for it (it does from the pod's binding on,
	// so the move may be done before the ADD), and an ADD before that is refused with the
	// reason; a retry gets it.
	spare := held(t, "static-b", "st").Ranges()[0].First
	p4 := createAnnotatedPod(t, "default", "static-4", "static-a", ann(spare.String()))
	eventually(t, 30*time.Second, "the spare to move to static-a for the pod that names it", func() error {
		r, e := cni(t, "ADD", confA, "st-4", podArgs(p4.Namespace, p4.Name, string(p4.UID)))
		if e != nil {
			if e.Code != 11 || !strings.Contains(e.Msg, "held by node static-b") && !strings.Contains(e.Msg, "has not moved it to this node yet") {
				t.Fatalf("ADD of an address another node holds, or one on its way: %+v", e)
			}
			return fmt.Errorf("%s", e.Msg)
		}
		if got := r.IPs[0].Address; got != spare.String()+"/24" {
			t.Fatalf("static pod got %s, want %s", got, spare)
		}
		return nil
	})
	if held(t, "static-b", "st").Contains(spare) {
		t.Fatalf("static-b still holds %s", spare)
	}
	// The address in use on static-a that static-2 (on static-b) asks for stays on static-a.
	if !held(t, "static-a", "st").Contains(netip.MustParseAddr("10.151.0.200")) {
		t.Fatalf("static-a gave away the address its pod uses")
	}
	for _, tc := range []struct{ ips, want string }{
		{"10.151.0", "is not an IP address"},
		{"10.99.0.1", "outside every pool the pod may use"},
		{"10.151.0.250", "excluded from pool st"},
	} {
		p := createAnnotatedPod(t, "default", "static-bad-"+strings.ReplaceAll(tc.ips, ".", "-"), "static-a", ann(tc.ips))
		_, e := cni(t, "ADD", confA, "st-bad", podArgs(p.Namespace, p.Name, string(p.UID)))
		if e == nil || e.Code != 7 || !strings.Contains(e.Msg, tc.want) {
			t.Errorf("ADD with ip-addresses %q: %+v, want code 7 with %q", tc.ips, e, tc.want)
		}
	}
	if got := agA.attachmentIDs(t); len(got) != 2 || got[0] != "st-1" || got[1] != "st-4" {
		t.Fatalf("static-a attachments %v, want st-1 and st-4", got)
	}
	if got := agB.attachmentIDs(t); len(got) != 0 {
		t.Fatalf("static-b attachments %v, want none", got)
	}

	// The pod goes (DEL, then deleted); a new pod on the same node asking for the address gets it
	// (static-2, which asked for it from static-b, is gone first).
	if err := k8s.Delete(context.Background(), p2, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	if _, e := cni(t, "DEL", confA, "st-1", podArgs(p1.Namespace, p1.Name, string(p1.UID))); e != nil {
		t.Fatal(e)
	}
	if err := k8s.Delete(context.Background(), p1, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	p5 := createAnnotatedPod(t, "default", "static-5", "static-a", ann("10.151.0.200"))
	if a := addFor(t, confA, "st-5", p5); a != "10.151.0.200/24" {
		t.Fatalf("re-created static pod got %s", a)
	}
}
