package check

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
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
//
// One address in two nodes' statuses is legal only as a live migration's shared grant, which
// the pool's status.shared records for that pair of nodes ("VM addresses" in docs/design.md).
// The pools come on their own watch (WatchPools), in no order with the nodes' events, so such a
// moment is held as a candidate and reported by Violations unless a shared record of that
// address for that pair of nodes was seen at some time in the run.
type Tracker struct {
	mu         sync.Mutex
	latest     map[string]map[string]addr.Set // node -> network -> status addresses
	seen       map[string]string              // node -> where its latest status came from (for the report)
	networks   map[string]string              // pool -> spec.network ("" when not told)
	violations []string
	// candidates are addresses seen in two statuses (network/address/node pair -> the report);
	// sharedSeen the shared grants seen in pool statuses (same keys).
	candidates map[string]string
	sharedSeen map[string]bool
}

// NewTracker returns an empty tracker.
func NewTracker() *Tracker {
	return &Tracker{latest: map[string]map[string]addr.Set{}, seen: map[string]string{}, networks: map[string]string{},
		candidates: map[string]string{}, sharedSeen: map[string]bool{}}
}

// sharedKey names an address held by a pair of nodes on a network.
func sharedKey(net string, a netip.Addr, n1, n2 string) string {
	if n2 < n1 {
		n1, n2 = n2, n1
	}
	return net + "/" + a.String() + "/" + n1 + "," + n2
}

// ObservePool takes one IPPool's status: the shared grants it records.
func (t *Tracker) ObservePool(p *ipwardenv1.IPPool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	net := t.networks[p.Name]
	for _, s := range p.Status.Shared {
		a, err := netip.ParseAddr(string(s.Address))
		if err != nil || len(s.Nodes) != 2 {
			continue
		}
		t.sharedSeen[sharedKey(net, a, s.Nodes[0], s.Nodes[1])] = true
	}
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
					for _, ip := range both.Addrs(64) {
						k := sharedKey(net, ip, a, b)
						if _, ok := t.candidates[k]; !ok {
							t.candidates[k] = fmt.Sprintf("%s%s in the statuses of nodes %s and %s at once with no shared grant for them (invariant 1): %s: %s; %s: %s",
								ip, onNetwork(net), a, b, a, t.seen[a], b, t.seen[b])
						}
					}
				}
			}
		}
	}
}

// Violations returns what broke so far.
func (t *Tracker) Violations() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := append([]string(nil), t.violations...)
	for _, k := range slices.Sorted(maps.Keys(t.candidates)) {
		if !t.sharedSeen[k] {
			out = append(out, t.candidates[k])
		}
	}
	return out
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

// WatchPools feeds t the pools' statuses (their shared grants) until ctx ends, as Watch does the
// NodeIPAllocations.
func (t *Tracker) WatchPools(ctx context.Context, c client.WithWatch) {
	for ctx.Err() == nil {
		var list ipwardenv1.IPPoolList
		if err := c.List(ctx, &list); err != nil {
			sleep(ctx, 200*time.Millisecond)
			continue
		}
		for i := range list.Items {
			t.ObservePool(&list.Items[i])
		}
		w, err := c.Watch(ctx, &ipwardenv1.IPPoolList{}, &client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: list.ResourceVersion}})
		if err != nil {
			sleep(ctx, 200*time.Millisecond)
			continue
		}
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*ipwardenv1.IPPool)
			if !ok {
				break
			}
			t.ObservePool(p)
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
