package integration

import (
	"context"
	"fmt"
	"io"
	"net/http"
	stdnetip "net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

func cooldown(d time.Duration) metav1.Duration { return metav1.Duration{Duration: d} }

// A node requests 32 and holds 32 distinct pool addresses; it lowers to 16, releasing 16 named
// addresses, and exactly those go, into the pool's cooling record first.
func TestControllerFillAndTakeBack(t *testing.T) {
	startController(t)
	createPool(t, "fill", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.100.0.0/24"}, Exclude: []ipwardenv1.IPOrCIDR{"10.100.0.0"}, ReuseCooldown: cooldown(time.Hour)})
	createNode(t, "fill-node", nil)
	waitAllocation(t, "fill-node")

	request(t, "fill-node", "fill", 32, addr.Set{})
	got := waitHeld(t, "fill-node", "fill", 32)
	if !mustPrefix("10.100.0.0/24").ContainsSet(got) || got.Contains(stdnetip.MustParseAddr("10.100.0.0")) {
		t.Fatalf("held %v: outside the pool or excluded", got)
	}
	if got.NumRanges() > 2 {
		t.Errorf("held %v: %d runs, want the fill contiguous (at most 2 runs around the exclusion)", got, got.NumRanges())
	}

	release := scaling.ChooseRelease(got, got, 16)
	request(t, "fill-node", "fill", 16, release)
	after := waitHeld(t, "fill-node", "fill", 16)
	if want := got.Subtract(release); !after.Equal(want) {
		t.Fatalf("after releasing %v the node holds %v, want exactly %v", release, after, want)
	}
	eventually(t, 10*time.Second, "pool status to count the node and the cooling addresses", func() error {
		p := getPool(t, "fill")
		var cooling addr.Set
		for _, c := range p.Status.Cooling {
			s, _ := addr.ParseSet(c.Addresses)
			cooling = cooling.Union(s)
		}
		if p.Status.Capacity != 254 || p.Status.Allocated != 32 || p.Status.Free != 222 || p.Status.Nodes != 1 || !cooling.Equal(release) {
			return fmt.Errorf("status capacity %d allocated %d free %d nodes %d cooling %v", p.Status.Capacity, p.Status.Allocated, p.Status.Free, p.Status.Nodes, cooling)
		}
		return nil
	})
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: "fill-node"}, a); err != nil {
		t.Fatal(err)
	}
	if a.Status.Summary != "fill 16/16" {
		t.Errorf("summary %q, want %q", a.Status.Summary, "fill 16/16")
	}
	if c := condition(a.Status.Conditions, ipwardenv1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("Ready condition %+v, want True", c)
	}
	if len(a.OwnerReferences) != 1 || a.OwnerReferences[0].Kind != "Node" || a.OwnerReferences[0].Name != "fill-node" {
		t.Errorf("owner references %+v, want the Node", a.OwnerReferences)
	}

	// Lowering the request without naming addresses takes nothing away (invariant 2).
	request(t, "fill-node", "fill", 0, addr.Set{})
	eventually(t, 10*time.Second, "controller to see the lowered request", func() error {
		a := &ipwardenv1.NodeIPAllocation{}
		if err := k8s.Get(context.Background(), client.ObjectKey{Name: "fill-node"}, a); err != nil {
			return err
		}
		if a.Status.ObservedGeneration != a.Generation {
			return fmt.Errorf("observed generation %d of %d", a.Status.ObservedGeneration, a.Generation)
		}
		return nil
	})
	if h := held(t, "fill-node", "fill"); !h.Equal(after) {
		t.Fatalf("unreleased addresses were taken: node holds %v, had %v", h, after)
	}
}

// Two nodes race for the last addresses of a small pool: no address is held twice, the pool is
// marked exhausted, and the flag clears (with hysteresis) as addresses come back.
func TestControllerRaceAndExhaustion(t *testing.T) {
	startController(t)
	createPool(t, "small", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.101.0.0/27"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: cooldown(500 * time.Millisecond),
	})
	createNode(t, "race-a", nil)
	createNode(t, "race-b", nil)
	waitAllocation(t, "race-a")
	waitAllocation(t, "race-b")
	request(t, "race-a", "small", 24, addr.Set{})
	request(t, "race-b", "small", 24, addr.Set{})

	eventually(t, 30*time.Second, "the pool to be handed out in full", func() error {
		a, b := held(t, "race-a", "small"), held(t, "race-b", "small")
		if dup := a.Intersect(b); !dup.IsEmpty() {
			t.Fatalf("addresses %v held by both nodes", dup)
		}
		if size(a)+size(b) != 30 { // a /27 less its network and broadcast addresses
			return fmt.Errorf("a holds %d, b holds %d", size(a), size(b))
		}
		return nil
	})
	eventually(t, 10*time.Second, "pool exhausted", func() error {
		p := getPool(t, "small")
		if !p.Status.Exhausted || p.Status.Free != 0 {
			return fmt.Errorf("exhausted %v free %d", p.Status.Exhausted, p.Status.Free)
		}
		if c := condition(p.Status.Conditions, ipwardenv1.ConditionExhausted); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("Exhausted condition %+v", c)
		}
		return nil
	})
	short := "race-a"
	if size(held(t, "race-a", "small")) == 24 {
		short = "race-b"
	}
	eventually(t, 10*time.Second, "the short node's Ready condition to say why", func() error {
		a := &ipwardenv1.NodeIPAllocation{}
		if err := k8s.Get(context.Background(), client.ObjectKey{Name: short}, a); err != nil {
			return err
		}
		c := condition(a.Status.Conditions, ipwardenv1.ConditionReady)
		if c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "pool small is exhausted") {
			return fmt.Errorf("Ready condition %+v", c)
		}
		return nil
	})

	// The full node gives everything back and the short node fills up after the cooldown.
	full := "race-a"
	if short == "race-a" {
		full = "race-b"
	}
	request(t, full, "small", 0, held(t, full, "small"))
	waitHeld(t, full, "small", 0)
	waitHeld(t, short, "small", 24)

	// Hysteresis with batch 4 on 30 addresses: set below 4 free, cleared only above 8 free plus
	// the nodes' regrowth.
	poolState := func(free int64, exhausted bool) func() error {
		return func() error {
			p := getPool(t, "small")
			if p.Status.Free != free || p.Status.Exhausted != exhausted {
				return fmt.Errorf("free %d exhausted %v, want free %d exhausted %v", p.Status.Free, p.Status.Exhausted, free, exhausted)
			}
			return nil
		}
	}
	request(t, short, "small", 27, addr.Set{})
	waitHeld(t, short, "small", 27)
	eventually(t, 10*time.Second, "3 free: exhausted", poolState(3, true))
	s := held(t, short, "small")
	request(t, short, "small", 24, scaling.ChooseRelease(s, s, 3))
	waitHeld(t, short, "small", 24)
	eventually(t, 10*time.Second, "6 free, between the marks: still exhausted", poolState(6, true))
	s = held(t, short, "small")
	request(t, short, "small", 18, scaling.ChooseRelease(s, s, 6))
	waitHeld(t, short, "small", 18)
	// Above the high mark, but clearing the flag would let the nodes grow back by their
	// regrowth (scaling.Keep over their requests: 4 each with batch 4, buffer 0 and the default
	// slack of one batch), so it stays set until free > 8 + 8.
	eventually(t, 10*time.Second, "12 free, above the high mark but not the regrowth: still exhausted", poolState(12, true))
	s = held(t, short, "small")
	request(t, short, "small", 12, scaling.ChooseRelease(s, s, 6))
	waitHeld(t, short, "small", 12)
	eventually(t, 10*time.Second, "18 free, above the high mark plus the regrowth: cleared", poolState(18, false))
}

// A Node's deletion returns its addresses to the pool, after the cooldown, with no operator action.
func TestControllerNodeDeletion(t *testing.T) {
	startController(t)
	createPool(t, "gone", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.102.0.0/24"}, ReuseCooldown: cooldown(time.Second)})
	n := createNode(t, "gone-node", nil)
	waitAllocation(t, "gone-node")
	request(t, "gone-node", "gone", 16, addr.Set{})
	waitHeld(t, "gone-node", "gone", 16)
	eventually(t, 10*time.Second, "pool to count 16 allocated", func() error {
		if p := getPool(t, "gone"); p.Status.Allocated != 16 {
			return fmt.Errorf("allocated %d", p.Status.Allocated)
		}
		return nil
	})
	if err := k8s.Delete(context.Background(), n); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "NodeIPAllocation deleted and addresses back in the pool", func() error {
		err := k8s.Get(context.Background(), client.ObjectKey{Name: "gone-node"}, &ipwardenv1.NodeIPAllocation{})
		if err == nil {
			return fmt.Errorf("NodeIPAllocation still exists")
		}
		p := getPool(t, "gone")
		if p.Status.Allocated != 0 || p.Status.Free != 254 || p.Status.Nodes != 0 || len(p.Status.Cooling) != 0 {
			return fmt.Errorf("allocated %d free %d nodes %d cooling %v", p.Status.Allocated, p.Status.Free, p.Status.Nodes, p.Status.Cooling)
		}
		return nil
	})
}

// A controller killed mid-fill and restarted keeps every invariant: no address held twice, every
// node ends up with what it asked, nothing outside the pool.
func TestControllerKilledMidFill(t *testing.T) {
	ctrlProc := startController(t, "--workers=2")
	createPool(t, "crash", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.103.0.0/20"}, ReuseCooldown: cooldown(time.Minute)})
	const nodes = 30
	for i := range nodes {
		createNode(t, fmt.Sprintf("crash-%02d", i), nil)
	}
	for i := range nodes {
		waitAllocation(t, fmt.Sprintf("crash-%02d", i))
	}
	for i := range nodes {
		request(t, fmt.Sprintf("crash-%02d", i), "crash", 16+i, addr.Set{})
	}
	// Kill it once some, but not all, nodes are filled.
	eventually(t, 30*time.Second, "some nodes filled", func() error {
		filled := 0
		for i := range nodes {
			if size(held(t, fmt.Sprintf("crash-%02d", i), "crash")) > 0 {
				filled++
			}
		}
		if filled == 0 {
			return fmt.Errorf("none filled yet")
		}
		return nil
	})
	ctrlProc.kill()
	// Raise some requests while it is down (raise: a lowered request without releases keeps
	// what the node holds), then start a new one.
	for i := 0; i < nodes; i += 3 {
		request(t, fmt.Sprintf("crash-%02d", i), "crash", 60, addr.Set{})
	}
	startController(t, "--workers=4")
	eventually(t, 60*time.Second, "all nodes filled", func() error {
		holdings := map[string]addr.Set{}
		for i := range nodes {
			name := fmt.Sprintf("crash-%02d", i)
			want := 16 + i
			if i%3 == 0 {
				want = 60
			}
			h := held(t, name, "crash")
			holdings[name] = h
			if !mustPrefix("10.103.0.0/20").ContainsSet(h) {
				t.Fatalf("node %s holds %v outside the pool", name, h)
			}
			if size(h) != want {
				return fmt.Errorf("node %s holds %d, wants %d", name, size(h), want)
			}
		}
		assertDisjoint(t, holdings)
		return nil
	})
}

// The metrics endpoint serves pool and fleet metrics; health and readiness answer.
func TestControllerMetricsAndProbes(t *testing.T) {
	metricsAddr, probeAddr := freeAddr(t), freeAddr(t)
	startController(t, "--metrics-bind-address="+metricsAddr, "--health-probe-bind-address="+probeAddr)
	createPool(t, "metrics", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.104.0.0/24"}})
	createNode(t, "metrics-node", nil)
	waitAllocation(t, "metrics-node")
	request(t, "metrics-node", "metrics", 16, addr.Set{})
	waitHeld(t, "metrics-node", "metrics", 16)
	for _, path := range []string{"/healthz", "/readyz"} {
		eventually(t, 10*time.Second, path, func() error {
			_, err := httpGet("http://" + probeAddr + path)
			return err
		})
	}
	eventually(t, 10*time.Second, "metrics", func() error {
		body, err := httpGet("http://" + metricsAddr + "/metrics")
		if err != nil {
			return err
		}
		// The node x pool gauges are off by default (the agents export them).
		if strings.Contains(body, "ipwarden_controller_node_held_addresses{") {
			return fmt.Errorf("per-node gauges exported without --per-node-metrics")
		}
		for _, want := range []string{
			`ipwarden_controller_pool_capacity_addresses{pool="metrics"} 254`,
			`ipwarden_controller_pool_allocated_addresses{pool="metrics"} 16`,
			`ipwarden_controller_allocated_addresses_total{pool="metrics"} 16`,
			`ipwarden_controller_api_writes_total{resource="nodeipallocations/status",result="ok",verb="update"}`,
			`ipwarden_controller_nodes_in_deficit 0`,
			`ipwarden_controller_sync_duration_seconds_bucket{kind="node"`,
		} {
			if !strings.Contains(body, want) {
				return fmt.Errorf("metrics lack %q", want)
			}
		}
		return nil
	})
}

// With --per-node-metrics the controller exports the node x pool gauges.
func TestControllerPerNodeMetrics(t *testing.T) {
	metricsAddr := freeAddr(t)
	startController(t, "--metrics-bind-address="+metricsAddr, "--per-node-metrics")
	createPool(t, "metrics-pn", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.105.0.0/24"}})
	createNode(t, "metrics-pn-node", nil)
	waitAllocation(t, "metrics-pn-node")
	request(t, "metrics-pn-node", "metrics-pn", 16, addr.Set{})
	waitHeld(t, "metrics-pn-node", "metrics-pn", 16)
	eventually(t, 10*time.Second, "per-node metrics", func() error {
		body, err := httpGet("http://" + metricsAddr + "/metrics")
		if err != nil {
			return err
		}
		for _, want := range []string{
			`ipwarden_controller_node_held_addresses{node="metrics-pn-node",pool="metrics-pn"} 16`,
			`ipwarden_controller_node_requested_addresses{node="metrics-pn-node",pool="metrics-pn"} 16`,
			`ipwarden_controller_node_deficit_addresses{node="metrics-pn-node",pool="metrics-pn"} 0`,
		} {
			if !strings.Contains(body, want) {
				return fmt.Errorf("metrics lack %q", want)
			}
		}
		return nil
	})
}

// freeAddr is a free loopback host:port (localcluster.FreeAddr).
func freeAddr(t *testing.T) string {
	t.Helper()
	a, err := localcluster.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func httpGet(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", url, resp.Status)
	}
	return string(b), err
}

// Shrinking a pool never takes a live address away: the conflict shows in the Ready condition and
// drains as the node releases the addresses.
func TestControllerPoolShrinkDrains(t *testing.T) {
	startController(t)
	createPool(t, "shrink", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.108.0.0/24"}})
	createNode(t, "shrink-node", nil)
	waitAllocation(t, "shrink-node")
	request(t, "shrink-node", "shrink", 16, addr.Set{})
	first := waitHeld(t, "shrink-node", "shrink", 16)

	// Exclude exactly what the node holds.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		p := getPool(t, "shrink")
		for _, s := range first.Strings() {
			p.Spec.Exclude = append(p.Spec.Exclude, ipwardenv1.IPOrCIDR(s))
		}
		return k8s.Update(context.Background(), p)
	}); err != nil {
		t.Fatal(err)
	}
	readyReason := func(reason string) func() error {
		return func() error {
			p := getPool(t, "shrink")
			c := condition(p.Status.Conditions, ipwardenv1.ConditionReady)
			if c == nil || c.Reason != reason || p.Status.ObservedGeneration != p.Generation {
				return fmt.Errorf("Ready condition %+v at generation %d of %d", c, p.Status.ObservedGeneration, p.Generation)
			}
			return nil
		}
	}
	eventually(t, 10*time.Second, "Ready reason Draining", readyReason("Draining"))
	if c := condition(getPool(t, "shrink").Status.Conditions, ipwardenv1.ConditionReady); !strings.Contains(c.Message, "16 held addresses lie outside the pool") {
		t.Errorf("Draining message %q does not say how many", c.Message)
	}
	if h := held(t, "shrink-node", "shrink"); !h.Equal(first) {
		t.Fatalf("shrinking the pool took addresses: node holds %v, had %v", h, first)
	}

	// New addresses come from what is left of the pool; releasing the old ones drains the conflict.
	request(t, "shrink-node", "shrink", 32, addr.Set{})
	both := waitHeld(t, "shrink-node", "shrink", 32)
	if added := both.Subtract(first); added.Overlaps(first) || size(added) != 16 {
		t.Fatalf("added %v", added)
	}
	request(t, "shrink-node", "shrink", 16, first)
	waitHeld(t, "shrink-node", "shrink", 16)
	eventually(t, 10*time.Second, "Ready reason Serving", readyReason("Serving"))
	if got := getPool(t, "shrink").Status.Capacity; got != 238 {
		t.Errorf("capacity %d after excluding 16 of 254, want 238", got)
	}
}

// A fill the pool cannot serve in full leaves a PoolExhausted event on the NodeIPAllocation.
func TestControllerExhaustionEvent(t *testing.T) {
	startController(t)
	createPool(t, "tiny", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.109.0.0/29"}, Scaling: ipwardenv1.Scaling{BatchSize: 1, BufferPercent: 0, MaxPerNode: 16}})
	createNode(t, "tiny-node", nil)
	waitAllocation(t, "tiny-node")
	request(t, "tiny-node", "tiny", 12, addr.Set{})
	waitHeld(t, "tiny-node", "tiny", 6) // a /29 less its network and broadcast addresses
	eventually(t, 10*time.Second, "a PoolExhausted event", func() error {
		var events corev1.EventList
		if err := k8s.List(context.Background(), &events); err != nil {
			return err
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Kind == "NodeIPAllocation" && e.InvolvedObject.Name == "tiny-node" && e.Reason == "PoolExhausted" {
				if !strings.Contains(e.Message, "cannot fill this node's request: pool tiny is exhausted: 6 free addresses for a deficit of 12") {
					return fmt.Errorf("event message %q", e.Message)
				}
				return nil
			}
		}
		return fmt.Errorf("no PoolExhausted event among %d events", len(events.Items))
	})
}

// The slow audit repairs what no event reported: a status that lost addresses is rewritten, and
// an address written into a status behind the controller's back is adopted, never handed out
// to another node.
func TestControllerAudit(t *testing.T) {
	startController(t, "--audit-period=500ms")
	createPool(t, "audit", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.111.0.0/27"},
		Scaling: ipwardenv1.Scaling{BatchSize: 1, BufferPercent: 0, MaxPerNode: 64}})
	createNode(t, "audit-a", nil)
	createNode(t, "audit-b", nil)
	waitAllocation(t, "audit-a")
	waitAllocation(t, "audit-b")
	request(t, "audit-a", "audit", 8, addr.Set{})
	before := waitHeld(t, "audit-a", "audit", 8)

	// Someone edits a's status: drops two held addresses, adds a free one.
	extra := mustPrefix("10.111.0.30/32")
	if before.Overlaps(extra) {
		t.Fatalf("test assumption: %v already held", extra)
	}
	edited := before.Subtract(before.First(2)).Union(extra)
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		a := &ipwardenv1.NodeIPAllocation{}
		if err := k8s.Get(context.Background(), client.ObjectKey{Name: "audit-a"}, a); err != nil {
			return err
		}
		a.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "audit", Addresses: edited.Strings(), Held: int32(size(edited))}}
		return k8s.Status().Update(context.Background(), a)
	}); err != nil {
		t.Fatal(err)
	}
	// The audit restores the dropped addresses and keeps the adopted one with a.
	waitHeld(t, "audit-a", "audit", 9)
	if h := held(t, "audit-a", "audit"); !h.Equal(before.Union(extra)) {
		t.Fatalf("after the audit a holds %v, want %v", h, before.Union(extra))
	}
	// b takes everything else: never the adopted address.
	request(t, "audit-b", "audit", 21, addr.Set{})
	b := waitHeld(t, "audit-b", "audit", 21)
	assertDisjoint(t, map[string]addr.Set{"audit-a": held(t, "audit-a", "audit"), "audit-b": b})
}
