package integration

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// statusWatcher follows every NodeIPAllocation and IPPool change: a check.Tracker reports what
// breaks "never two holders" as it happens, and it counts status writes per fence holder, so a
// write of a stale leader that landed is seen.
type statusWatcher struct {
	tracker   *check.Tracker
	mu        sync.Mutex
	fences    map[string]int // status writes seen per fence holder
	statuses  map[string]any // object -> last status seen, to tell status writes from spec writes
	stale     string         // holder whose writes must never land once set
	staleSeen []string
}

func watchStatuses(t *testing.T) *statusWatcher {
	t.Helper()
	w := &statusWatcher{tracker: check.NewTracker(), fences: map[string]int{}, statuses: map[string]any{}}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	wc, err := client.NewWithWatch(restConfig, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	go w.tracker.Watch(ctx, wc, func(typ watch.EventType, a *ipwardenv1.NodeIPAllocation) {
		if a.Status.Fence != nil && typ != watch.Deleted && w.statusChanged("NodeIPAllocation "+a.Name, a.Status) {
			w.fence(a.Status.Fence.Holder, "NodeIPAllocation "+a.Name)
		}
	})
	pw, err := wc.Watch(ctx, &ipwardenv1.IPPoolList{})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer pw.Stop()
		for ev := range pw.ResultChan() {
			if p, ok := ev.Object.(*ipwardenv1.IPPool); ok && p.Status.Fence != nil && w.statusChanged("IPPool "+p.Name, p.Status) {
				w.fence(p.Status.Fence.Holder, "IPPool "+p.Name)
			}
		}
	}()
	return w
}

func (w *statusWatcher) fence(holder, what string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.fences[holder]++
	if w.stale != "" && holder == w.stale {
		w.staleSeen = append(w.staleSeen, fmt.Sprintf("%s: a write of the stale leader %s landed", what, holder))
	}
}

// statusChanged says whether obj's status differs from the last one seen (a status write, not
// a spec write or a deletion).
func (w *statusWatcher) statusChanged(obj string, status any) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	prev, ok := w.statuses[obj]
	w.statuses[obj] = status
	return !ok || !equality.Semantic.DeepEqual(prev, status)
}

func (w *statusWatcher) check(t *testing.T) {
	t.Helper()
	for _, v := range w.tracker.Violations() {
		t.Error(v)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, v := range w.staleSeen {
		t.Error(v)
	}
}

func blockStrings(bs []ipwardenv1.AddressBlock) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = string(b)
	}
	return out
}

// leaseHolder reads the controllers' Lease.
func leaseHolder(t *testing.T) (string, int32) {
	t.Helper()
	var l coordinationv1.Lease
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: "ipwarden-controller"}, &l); err != nil {
		return "", 0
	}
	h, tr := "", int32(0)
	if l.Spec.HolderIdentity != nil {
		h = *l.Spec.HolderIdentity
	}
	if l.Spec.LeaseTransitions != nil {
		tr = *l.Spec.LeaseTransitions
	}
	return h, tr
}

var refusedRE = regexp.MustCompile(`write refused: this controller no longer holds its lease`)

// A leader paused (SIGSTOP) past its lease, while the other replica takes over and moves
// addresses between nodes, then resumed (SIGCONT): none of its writes lands. The fence policy
// on the real API server refuses what it attempts; it stops at once. A watcher over every status
// change sees no address in two nodes' statuses and no status dropping an address its node did
// not release. Run with a short lease (with the controller's own lease check off, so the API
// server's fence alone must hold) and with the default lease settings.
func TestStaleLeaderIsFenced(t *testing.T) {
	cases := []struct {
		name      string
		lease     []string
		skipLocal bool
	}{
		{"short lease, API server fence alone", []string{"--leader-election-lease-duration=2s", "--leader-election-renew-deadline=1500ms", "--leader-election-retry-period=200ms"}, true},
		{"default lease", nil, false},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			staleLeaderScenario(t, i, tc.lease, tc.skipLocal)
		})
	}
}

func staleLeaderScenario(t *testing.T, n int, lease []string, skipLocal bool) {
	applyYAML(t, "deploy/kustomize/namespace.yaml")
	applyYAML(t, "deploy/kustomize/controller-rbac.yaml")
	kc, _ := impersonating(t, "ipwarden-system", "ipwarden-controller")
	// Each case starts from a free Lease (a previous case's dead holder would hold it).
	freeLease(t)

	w := watchStatuses(t)
	args := append([]string{"--kubeconfig", kc, "--leader-elect=true", "--leader-election-namespace=ipwarden-system",
		"--leader-election-id=ipwarden-controller", "--claim-settle=100ms"}, lease...)
	if skipLocal {
		args = append(args, "--unsafe-skip-local-lease-check")
	}
	a := startController(t, args...)
	b := startController(t, args...)

	pool := fmt.Sprintf("fence-%d", n)
	createPool(t, pool, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(fmt.Sprintf("10.120.%d.0/26", n))},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: metav1.Duration{Duration: 0}})
	n1, n2 := fmt.Sprintf("fence-%d-a", n), fmt.Sprintf("fence-%d-b", n)
	createNode(t, n1, nil)
	createNode(t, n2, nil)
	waitAllocation(t, n1)
	waitAllocation(t, n2)
	request(t, n1, pool, 30, addr.Set{})
	request(t, n2, pool, 8, addr.Set{})
	h1 := waitHeld(t, n1, pool, 30)
	waitHeld(t, n2, pool, 8)

	holder, epoch := leaseHolder(t)
	const serving = `"msg":"controller serving"`
	leader, standby := a, b
	if b.logContains(serving) {
		leader, standby = b, a
	}
	if !leader.logContains(serving) || standby.logContains(serving) {
		t.Fatalf("want exactly one serving replica: a=%v b=%v", a.logContains(serving), b.logContains(serving))
	}
	if !leader.logContains(holder) {
		t.Fatalf("the Lease holder %q is not the serving replica", holder)
	}

	// Pause the leader past its lease; the standby takes over.
	leader.Pause()
	paused := true
	defer func() {
		if paused {
			leader.Resume()
		}
	}()
	eventually(t, 60*time.Second, "the standby to take over the Lease", func() error {
		if h, e := leaseHolder(t); h == holder || e <= epoch {
			return fmt.Errorf("lease still held by %s (epoch %d)", h, e)
		}
		if !standby.logContains(serving) {
			return fmt.Errorf("standby not serving yet")
		}
		return nil
	})
	w.mu.Lock()
	w.stale = holder
	w.mu.Unlock()

	// The new leader moves addresses: n1 gives back 22 addresses, n2 grows into them.
	rel := addr.Set{}
	for _, a := range h1.Addrs(22) {
		rel = rel.Union(addr.SetOfAddrs(a))
	}
	request(t, n1, pool, 8, rel)
	waitHeld(t, n1, pool, 8)
	request(t, n2, pool, 40, addr.Set{})
	waitHeld(t, n2, pool, 40)

	// Resume the stale leader: its informers deliver what changed, its workers sync from its
	// stale record, and every write it attempts is refused; it exits.
	leader.Resume()
	paused = false
	select {
	case <-leader.done:
	case <-time.After(60 * time.Second):
		t.Fatal("the resumed stale leader did not stop within 60s")
	}
	log, _ := os.ReadFile(leader.log)
	refused := len(refusedRE.FindAll(log, -1))
	byServer := strings.Count(string(log), `"refusedBy":"apiserver"`)
	t.Logf("resumed stale leader: %d writes refused (%d by the API server's fence policy, %d by its own lease check); it exited",
		refused, byServer, refused-byServer)
	if skipLocal && byServer == 0 {
		t.Errorf("with its own lease check off, the resumed leader's writes were not refused by the API server (it attempted none?)")
	}

	// The new leader keeps working after the stale one is gone.
	request(t, n2, pool, 44, addr.Set{})
	waitHeld(t, n2, pool, 44)
	w.check(t)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fences[holder] == 0 {
		t.Errorf("no status carried the first leader's fence %q: the watcher saw %v", holder, w.fences)
	}
}

// freeLease clears the controllers' Lease holder, as after a clean shutdown, so a new controller
// leads at once instead of waiting out a previous test's dead holder.
func freeLease(t *testing.T) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var l coordinationv1.Lease
		if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: controlplane.ControllerLease}, &l); err != nil {
			return err
		}
		l.Spec.HolderIdentity = nil
		return k8s.Update(context.Background(), &l)
	})
	if err != nil {
		t.Fatal(err)
	}
}
