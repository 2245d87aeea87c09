package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/dra"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// slotCore serves the DRA driver from an ipam.State that the test churns: other pods' attachments
// (which move the headroom) and claims' reservations (which do not).
type slotCore struct {
	mu  sync.Mutex
	st  *ipam.State
	now time.Time
}

func (c *slotCore) Prepare(context.Context, ipam.ReserveRequest) (ipam.Attachment, []netip.Prefix, error) {
	return ipam.Attachment{}, nil, fmt.Errorf("not served")
}
func (c *slotCore) Unprepare(context.Context, string, string, string) error { return nil }
func (c *slotCore) Reservations() []ipam.Attachment                         { return nil }
func (c *slotCore) Served() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.st.Served()
}
func (c *slotCore) Capacities() []ipam.ClaimCapacity {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.st.ClaimCapacities(c.now)
}
func (c *slotCore) Reconcile(context.Context, func(ipam.ClaimDevice) bool) error { return nil }

// add attaches pod i (another pod when claim is false; a claim's reservation when true).
func (c *slotCore) add(i int, claim bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(time.Second)
	if claim {
		a, ch, err := c.st.Reserve(ipam.ReserveRequest{Claim: ipam.ClaimDevice{Namespace: "ns", Name: fmt.Sprint("c", i), UID: fmt.Sprint("c", i),
			Request: "addr", Device: dra.SlotName("v4", i), Interface: "eth0"}, Pod: ipam.PodRef{Namespace: "ns", Name: fmt.Sprint("dra", i), UID: fmt.Sprint("dra", i)}, Pool: "v4"}, c.now)
		if err == nil {
			c.st.Apply(ipam.AddPlan{Key: a.Key, Change: ch})
		}
		return err
	}
	k := ipam.Key{ContainerID: fmt.Sprint("p", i), IfName: "eth0"}
	_, ch, err := c.st.Add(ipam.AddRequest{Key: k, Pod: ipam.PodRef{Namespace: "ns", Name: fmt.Sprint("p", i), UID: fmt.Sprint("p", i)}}, c.now)
	if err == nil {
		c.st.Apply(ipam.AddPlan{Key: k, Change: ch})
	}
	return err
}

func (c *slotCore) del(i int, claim bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(time.Second)
	k := ipam.Key{ContainerID: fmt.Sprint("p", i), IfName: "eth0"}
	if claim {
		k = ipam.ReservationKey(fmt.Sprint("c", i), "addr", dra.SlotName("v4", i))
	}
	if plan, err := c.st.PlanDel(k, c.now); err == nil {
		c.st.Apply(plan)
	}
}

// TestDRASlotWrites measures the API writes the DRA driver's ResourceSlice costs one node, on a
// real API server: none at rest after the first publish, and few under churn of other pods (which
// moves the headroom) and of pods with claims (which does not). The node's pool has maxPerNode
// 110 and holds them all; the churn is a random walk of 40 to 80 other pods and 0 to 30 pods with
// claims, one start or end every churnEvery. IPWARDEN_DRA_SLOT_BENCH=1 runs it for minutes
// (BENCHMARKS.md); by default it runs seconds.
func TestDRASlotWrites(t *testing.T) {
	rest, churn, churnEvery := 15*time.Second, 30*time.Second, 500*time.Millisecond
	if os.Getenv("IPWARDEN_DRA_SLOT_BENCH") != "" {
		rest, churn = 3*time.Minute, 5*time.Minute
	}
	ctx, cancel := context.WithTimeout(context.Background(), rest+churn+2*time.Minute)
	defer cancel()
	cs, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		t.Fatal(err)
	}
	const node = "dra-slot-node"
	if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.CoreV1().Nodes().Delete(context.Background(), node, metav1.DeleteOptions{}) })

	st := ipam.New(node)
	pool := ipam.Pool{Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.60.0.0/24")},
		Scaling: scaling.Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 110}}
	st.SetPools([]ipam.Pool{pool}, []string{"v4"})
	st.SetHolding("v4", addr.MustParseSetString("10.60.0.2-10.60.0.111"))
	core := &slotCore{st: st, now: time.Now()}
	others := 60
	for i := range others {
		if err := core.add(i, false); err != nil {
			t.Fatal(err)
		}
	}

	w, err := cs.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + node})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	var mu sync.Mutex
	writes, devices := 0, 0
	go func() {
		for ev := range w.ResultChan() {
			s, ok := ev.Object.(*resourceapi.ResourceSlice)
			if !ok || (ev.Type != watch.Added && ev.Type != watch.Modified && ev.Type != watch.Deleted) {
				continue
			}
			mu.Lock()
			writes++
			devices = len(s.Spec.Devices)
			mu.Unlock()
		}
	}()
	read := func() (int, int) { mu.Lock(); defer mu.Unlock(); return writes, devices }

	dir := t.TempDir()
	d := dra.New(core, cs, dra.Options{Node: node, RegistrarDir: dir + "/registry", PluginDir: dir + "/plugin", Log: testr.New(t)})
	dctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(dctx) }()
	defer func() { stop(); <-done }()

	deadline := time.Now().Add(time.Minute)
	for {
		if n, dev := read(); n > 0 && dev > 0 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the driver stopped: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ResourceSlice published")
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(2 * time.Second) // the controller's first round settles
	first, dev := read()
	t.Logf("first publish: %d writes, %d slot devices (headroom 50, band 6)", first, dev)

	time.Sleep(rest)
	atRest, _ := read()
	atRest -= first
	t.Logf("RESULT at rest: %d ResourceSlice writes in %s: %.4f writes/s per node", atRest, rest, float64(atRest)/rest.Seconds())
	if atRest != 0 {
		t.Errorf("%d slice writes at rest, want none", atRest)
	}

	rng := rand.New(rand.NewPCG(1, 2))
	claims, nextOther, nextClaim := 0, others, 0
	var otherIDs []int
	for i := range others {
		otherIDs = append(otherIDs, i)
	}
	var claimIDs []int
	before, _ := read()
	start := time.Now()
	steps := 0
	for time.Since(start) < churn {
		steps++
		switch rng.IntN(4) {
		case 0: // another pod starts
			if len(otherIDs) < 80 && core.add(nextOther, false) == nil {
				otherIDs = append(otherIDs, nextOther)
				nextOther++
			}
		case 1: // another pod ends
			if len(otherIDs) > 40 {
				j := rng.IntN(len(otherIDs))
				core.del(otherIDs[j], false)
				otherIDs = append(otherIDs[:j], otherIDs[j+1:]...)
			}
		case 2: // a pod with a claim starts
			if claims < 30 && core.add(nextClaim, true) == nil {
				claimIDs = append(claimIDs, nextClaim)
				nextClaim++
				claims++
			}
		case 3: // a pod with a claim ends
			if claims > 0 {
				j := rng.IntN(len(claimIDs))
				core.del(claimIDs[j], true)
				claimIDs = append(claimIDs[:j], claimIDs[j+1:]...)
				claims--
			}
		}
		time.Sleep(churnEvery)
	}
	after, dev := read()
	underChurn := after - before
	rate := float64(steps) / churn.Seconds()
	t.Logf("RESULT under churn: %d ResourceSlice writes in %s (%d pod starts and ends, %.1f/s; %d other pods and %d with claims at the end, %d slots): %.4f writes/s per node, %.3f writes per pod start or end",
		underChurn, churn, steps, rate, len(otherIDs), claims, dev, float64(underChurn)/churn.Seconds(), float64(underChurn)/float64(steps))
	published, changes := d.Published()
	t.Logf("the driver published %d times in all; now %v", changes, published)
	if float64(underChurn) > 0.25*float64(steps) {
		t.Errorf("%d slice writes for %d pod starts and ends: the hysteresis does not hold", underChurn, steps)
	}
}
