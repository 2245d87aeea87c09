package check

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// Tracker follows every NodeIPAllocation change as it happens and reports the moments that
// break invariants 1 and 2, which a snapshot taken later may miss: an address in two nodes'
// statuses at once, and a status that drops an address its node's spec does not release.
// Reset starts over from a fresh list (after a watch ended, or etcd was restored: a rewound
// record drops addresses by design, the claims bring them back). Pools on different networks may
// overlap, so addresses are compared network by network (SetPoolNetworks).
type Tracker struct {
	mu         sync.Mutex
	latest     map[string]map[string]addr.Set // node -> network -> status addresses
	seen       map[string]string              // node -> where its latest status came from (for the report)
	networks   map[string]string              // pool -> spec.network ("" when not told)
	violations []string
}

// NewTracker returns an empty tracker.
func NewTracker() *Tracker {
	return &Tracker{latest: map[string]map[string]addr.Set{}, seen: map[string]string{}, networks: map[string]string{}}
}

// SetPoolNetworks tells the tracker each pool's spec.network (a pool it is not told is on the
// pod network ""), before it observes anything.
func (t *Tracker) SetPoolNetworks(m map[string]string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, v := range m {
		t.networks[k] = v
	}
}

// origin says which write a status came from, so a violation names both writes.
func origin(a *ipwardenv1.NodeIPAllocation, how string) string {
	f := "no fence"
	if a.Status.Fence != nil {
		f = fmt.Sprintf("fence %s epoch %d", a.Status.Fence.Holder, a.Status.Fence.Epoch)
	}
	return fmt.Sprintf("%s uid %s resourceVersion %s generation %d, %s", how, a.UID, a.ResourceVersion, a.Generation, f)
}

// Reset replaces what the tracker knows with a list of every NodeIPAllocation.
func (t *Tracker) Reset(items []ipwardenv1.NodeIPAllocation) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.latest = map[string]map[string]addr.Set{}
	t.seen = map[string]string{}
	for i := range items {
		t.latest[items[i].Name], _ = t.statusAddrs(&items[i])
		t.seen[items[i].Name] = origin(&items[i], "listed")
	}
	t.crossCheck("")
}

// Observe takes one change; deleted objects hold nothing.
func (t *Tracker) Observe(a *ipwardenv1.NodeIPAllocation, deleted bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if deleted {
		delete(t.latest, a.Name)
		delete(t.seen, a.Name)
		return
	}
	now, err := t.statusAddrs(a)
	if err != nil {
		t.violations = append(t.violations, fmt.Sprintf("node %s: unreadable status: %v", a.Name, err))
		return
	}
	releasing := map[string]addr.Set{}
	for _, p := range a.Spec.Pools {
		s, _ := addr.ParseSet(blockStrings(p.Releasing))
		releasing[t.networks[p.Pool]] = releasing[t.networks[p.Pool]].Union(s)
	}
	if prev, ok := t.latest[a.Name]; ok {
		for _, net := range slices.Sorted(maps.Keys(prev)) {
			if dropped := prev[net].Subtract(now[net]).Subtract(releasing[net]); !dropped.IsEmpty() {
				t.violations = append(t.violations, fmt.Sprintf("node %s: status dropped %v%s, which its spec does not release (invariant 2)", a.Name, dropped, onNetwork(net)))
			}
		}
	}
	t.latest[a.Name] = now
	t.seen[a.Name] = origin(a, "watched")
	t.crossCheck(a.Name)
}

// crossCheck reports addresses node (every node when "") shares with another node.
func (t *Tracker) crossCheck(node string) {
	names := make([]string, 0, len(t.latest))
	for n := range t.latest {
		names = append(names, n)
	}
	sort.Strings(names)
	for i, a := range names {
		for _, b := range names[i+1:] {
			if node != "" && a != node && b != node {
				continue
			}
			for _, net := range slices.Sorted(maps.Keys(t.latest[a])) {
				if both := t.latest[a][net].Intersect(t.latest[b][net]); !both.IsEmpty() {
					t.violations = append(t.violations, fmt.Sprintf("%v%s in the statuses of nodes %s and %s at once (invariant 1): %s: %s; %s: %s",
						both, onNetwork(net), a, b, a, t.seen[a], b, t.seen[b]))
				}
			}
		}
	}
}

// Violations returns what broke so far.
func (t *Tracker) Violations() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.violations...)
}

// statusAddrs is a status's addresses by network.
func (t *Tracker) statusAddrs(a *ipwardenv1.NodeIPAllocation) (map[string]addr.Set, error) {
	out := map[string]addr.Set{}
	for _, p := range a.Status.Pools {
		ps, err := addr.ParseSet(p.Addresses)
		if err != nil {
			return out, err
		}
		net := t.networks[p.Pool]
		out[net] = out[net].Union(ps)
	}
	return out, nil
}

func onNetwork(net string) string {
	if net == "" {
		return ""
	}
	return " on network " + net
}

// Watch feeds t from the API server until ctx ends: a list, then a watch, and a new list each
// time the watch ends (API server restarts, etcd restored). onEvent, when set, sees every event.
func (t *Tracker) Watch(ctx context.Context, c client.WithWatch, onEvent func(watch.EventType, *ipwardenv1.NodeIPAllocation)) {
	for ctx.Err() == nil {
		var list ipwardenv1.NodeIPAllocationList
		if err := c.List(ctx, &list); err != nil {
			sleep(ctx, 200*time.Millisecond)
			continue
		}
		t.Reset(list.Items)
		w, err := c.Watch(ctx, &ipwardenv1.NodeIPAllocationList{}, &client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: list.ResourceVersion}})
		if err != nil {
			sleep(ctx, 200*time.Millisecond)
			continue
		}
		for ev := range w.ResultChan() {
			a, ok := ev.Object.(*ipwardenv1.NodeIPAllocation)
			if !ok {
				break // an error event: relist
			}
			if onEvent != nil {
				onEvent(ev.Type, a)
			}
			t.Observe(a, ev.Type == watch.Deleted)
		}
		w.Stop()
	}
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
