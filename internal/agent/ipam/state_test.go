package ipam

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func set(t testing.TB, items ...string) addr.Set {
	t.Helper()
	s, err := addr.ParseSet(items)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func ip(s string) netip.Addr { return netip.MustParseAddr(s) }

var (
	poolV4 = Pool{
		Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")},
		Gateway: ip("10.0.0.1"), Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 16},
		Cooldown: 30 * time.Second,
	}
	poolV6 = Pool{
		Name: "v6", CIDRs: []netip.Prefix{netip.MustParsePrefix("fd00::/120")},
		Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 16}, Cooldown: 30 * time.Second,
	}
)

// harness drives a State the way the agent does and keeps a journal model (Snapshot.Apply of
// every Change), so tests can restart from it.
type harness struct {
	t    testing.TB
	s    *State
	snap Snapshot
	now  time.Time
}

func newHarness(t testing.TB, pools ...Pool) *harness {
	h := &harness{t: t, s: New("node-a"), now: t0}
	var names []string
	for _, p := range pools {
		names = append(names, p.Name)
	}
	h.commit(h.s.SetPools(pools, names))
	return h
}

func (h *harness) commit(ch Change) { h.snap = h.snap.Apply(ch) }

func (h *harness) hold(pool string, items ...string) {
	h.t.Helper()
	h.commit(h.s.SetHolding(pool, set(h.t, items...)))
}

func key(cid string) Key { return Key{ContainerID: cid, IfName: "eth0"} }

func (h *harness) add(cid string, pools ...string) (Attachment, error) {
	h.t.Helper()
	a, ch, err := h.s.Add(AddRequest{Key: key(cid), Network: "net", Pod: PodRef{"ns", cid, "uid-" + cid}, Pools: pools}, h.now)
	if err != nil {
		return a, err
	}
	h.commit(ch)
	h.s.Apply(AddPlan{Key: key(cid), Change: ch})
	return a, nil
}

func (h *harness) mustAdd(cid string, pools ...string) []string {
	h.t.Helper()
	a, err := h.add(cid, pools...)
	if err != nil {
		h.t.Fatalf("add %s: %v", cid, err)
	}
	var out []string
	for _, ad := range a.Addresses {
		out = append(out, ad.Addr.String())
	}
	return out
}

func (h *harness) del(cid string) bool {
	h.t.Helper()
	plan, err := h.s.PlanDel(key(cid), h.now)
	if err != nil {
		h.t.Fatalf("del %s: %v", cid, err)
	}
	h.commit(plan.Changes())
	h.s.Apply(plan)
	return plan.Found
}

// restart restarts the agent after a clean stop: it journals nothing at stop, so it is a crash.
func (h *harness) restart() {
	h.t.Helper()
	h.crash()
}

// crash restarts the agent from the journal as it is.
func (h *harness) crash() {
	h.t.Helper()
	old := h.s
	h.s = New(old.node)
	if problems := h.s.Restore(h.snap); len(problems) > 0 {
		h.t.Fatalf("restore: %v", problems)
	}
	h.s.SetPools(h.snap.Pools, old.served)
}

func TestAddTakesLowestFreeAndRepeatsSameResult(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2-10.0.0.5")
	if got := h.mustAdd("a"); !slices.Equal(got, []string{"10.0.0.2"}) {
		t.Fatalf("first ADD got %v", got)
	}
	if got := h.mustAdd("b"); !slices.Equal(got, []string{"10.0.0.3"}) {
		t.Fatalf("second ADD got %v", got)
	}
	a, ch, err := h.s.Add(AddRequest{Key: key("a"), Pools: nil}, h.now.Add(time.Hour))
	if err != nil || !ch.IsEmpty() || a.Addresses[0].Addr != ip("10.0.0.2") {
		t.Fatalf("repeated ADD = %v, %+v, %v; want same address, no journal change", a, ch, err)
	}
}

func TestDualStackAllOrNothing(t *testing.T) {
	h := newHarness(t, poolV4, poolV6)
	h.hold("v4", "10.0.0.2")
	_, err := h.add("a")
	var short *ShortError
	if !errors.As(err, &short) || !slices.Equal(short.Pools, []string{"v6"}) {
		t.Fatalf("ADD without v6 addresses: %v, want ShortError for v6", err)
	}
	if st := h.s.Stats(h.now); st[0].InUse != 0 || st[0].Free != 1 {
		t.Fatalf("failed ADD took a v4 address: %+v", st[0])
	}
	h.hold("v6", "fd00::10")
	if got := h.mustAdd("a"); !slices.Equal(got, []string{"10.0.0.2", "fd00::10"}) {
		t.Fatalf("dual-stack ADD got %v", got)
	}
}

func TestDefaultPoolsIPv4First(t *testing.T) {
	s := New("n")
	s.SetPools([]Pool{poolV6, poolV4}, []string{"v6", "v4"})
	if got := s.Served(); !slices.Equal(got, []string{"v4", "v6"}) {
		t.Fatalf("Served = %v", got)
	}
}

func TestDelIdempotentAndCooldownFIFO(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.10-10.0.0.13")
	h.mustAdd("a") // .10
	h.mustAdd("b") // .11
	if !h.del("b") {
		t.Fatal("DEL of b: not found")
	}
	if h.del("b") {
		t.Fatal("second DEL of b found something")
	}
	if h.del("never-seen") {
		t.Fatal("DEL of an unknown attachment found something")
	}
	h.now = h.now.Add(time.Second)
	h.del("a") // .10 freed after .11
	// Fresh addresses first, lowest first.
	if got := h.mustAdd("c"); got[0] != "10.0.0.12" {
		t.Fatalf("c got %v, want fresh 10.0.0.12", got)
	}
	if got := h.mustAdd("d"); got[0] != "10.0.0.13" {
		t.Fatalf("d got %v, want fresh 10.0.0.13", got)
	}
	// Only cooling addresses remain: none before the cooldown.
	h.now = t0.Add(29 * time.Second)
	if _, err := h.add("e"); err == nil {
		t.Fatal("ADD handed out a cooling address")
	} else if r := h.s.Reason("v4", h.now); !strings.Contains(r, "2 freed addresses are cooling down") {
		t.Fatalf("reason %q does not mention the cooling addresses", r)
	}
	if next := h.s.NextCooled(h.now); !next.Equal(t0.Add(30 * time.Second)) {
		t.Fatalf("NextCooled = %v", next)
	}
	// After the cooldown: oldest freed first (.11 was freed before .10).
	h.now = t0.Add(30 * time.Second)
	if got := h.mustAdd("e"); got[0] != "10.0.0.11" {
		t.Fatalf("e got %v, want the oldest freed 10.0.0.11", got)
	}
	if _, err := h.add("f"); err == nil {
		t.Fatal(".10 was freed a second later and must still cool")
	}
	h.now = t0.Add(31 * time.Second)
	if got := h.mustAdd("f"); got[0] != "10.0.0.10" {
		t.Fatalf("f got %v", got)
	}
}

func TestCooldownSurvivesRestart(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.10")
	h.mustAdd("a")
	h.del("a")
	h.restart()
	h.now = t0.Add(10 * time.Second)
	if _, err := h.add("b"); err == nil {
		t.Fatal("after restart a cooling address was handed out")
	}
	h.now = t0.Add(30 * time.Second)
	h.mustAdd("b")
}

func TestAbortAddRestores(t *testing.T) {
	h := newHarness(t, poolV4, poolV6)
	h.hold("v4", "10.0.0.10-10.0.0.11")
	h.hold("v6", "fd00::1")
	h.mustAdd("a")
	h.del("a")
	h.now = h.now.Add(time.Minute)
	h.mustAdd("b") // takes .11 fresh and fd00::1? no: v6 fd00::1 was freed by a -> cooled
	h.del("b")
	h.now = h.now.Add(time.Minute)
	before := h.s.Stats(h.now)
	_, _, err := h.s.Add(AddRequest{Key: key("c")}, h.now)
	if err != nil {
		t.Fatal(err)
	}
	h.s.AbortAdd(key("c"))
	if after := h.s.Stats(h.now); !reflect.DeepEqual(before, after) {
		t.Fatalf("AbortAdd did not restore:\nbefore %+v\nafter  %+v", before, after)
	}
	if _, ok := h.s.Attachment(key("c")); ok {
		t.Fatal("aborted attachment still recorded")
	}
}

func TestScaleUpAndDown(t *testing.T) {
	h := newHarness(t, poolV4)
	// Empty node: batch 4, buffer 50% -> 4.
	if spec := h.s.Spec(); len(spec) != 1 || spec[0].Requested != 4 {
		t.Fatalf("cold spec = %+v", spec)
	}
	h.hold("v4", "10.0.0.0/29") // 8 held, target 4
	plan := h.s.Release(h.now)
	h.commit(plan.Change)
	rel := plan.Marked["v4"]
	if n := count(rel); n != 4 {
		t.Fatalf("released %v, want 4 addresses", rel)
	}
	spec := h.s.Spec()
	if spec[0].Requested != 4 || !spec[0].Releasing.Equal(rel) {
		t.Fatalf("spec after release = %+v", spec)
	}
	// Releasing addresses are never handed out.
	var got []string
	for i := range 4 {
		got = append(got, h.mustAdd("p"+string(rune('a'+i)))...)
	}
	for _, g := range got {
		if rel.Contains(ip(g)) {
			t.Fatalf("handed out releasing address %s", g)
		}
	}
	if _, err := h.add("overflow"); err == nil {
		t.Fatal("ADD succeeded though every non-releasing address is in use")
	}
	// Demand 4 (+1 waiting) -> target 8; in use never released.
	h.s.AddWaiter(key("overflow"), "uid-overflow", nil)
	if tg := h.s.Target("v4"); tg != 8 {
		t.Fatalf("target with 4 in use and one waiting = %d, want 8", tg)
	}
	// The controller takes back exactly the releasing ones.
	h.hold("v4", set(t, "10.0.0.0/29").Subtract(rel).Strings()...)
	if spec := h.s.Spec(); !spec[0].Releasing.IsEmpty() {
		t.Fatalf("releasing not forgotten after the controller took them: %+v", spec)
	}
	// Restart keeps nothing releasing.
	h.restart()
	if st := h.s.Stats(h.now); st[0].Releasing != 0 || st[0].InUse != 4 {
		t.Fatalf("after restart %+v", st[0])
	}
}

func TestReleasingSurvivesRestartUntilTaken(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/29")
	plan := h.s.Release(h.now)
	h.commit(plan.Change)
	h.restart()
	// The controller has not acted yet: still held, still releasing, still published.
	h.hold("v4", "10.0.0.0/29")
	if spec := h.s.Spec(); !spec[0].Releasing.Equal(plan.Marked["v4"]) {
		t.Fatalf("after restart spec = %+v, want releasing %v", spec, plan.Marked["v4"])
	}
	for i := range 4 {
		a := h.mustAdd("p" + string(rune('a'+i)))
		if plan.Marked["v4"].Contains(ip(a[0])) {
			t.Fatalf("handed out releasing %s after restart", a[0])
		}
	}
}

func TestUnmarkReleasingKeepsCooldown(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	for _, c := range []string{"a", "b", "c", "d", "e", "f", "g", "h"} {
		h.mustAdd(c)
	}
	for _, c := range []string{"a", "b", "c", "d", "e", "f", "g", "h"} {
		h.del(c)
	}
	// Cooling addresses count as demand, so only a lower cap makes the node give them back:
	// the operator lowers maxPerNode.
	lowered := poolV4
	lowered.Scaling.MaxPerNode = 4
	h.commit(h.s.SetPools([]Pool{lowered}, []string{"v4"}))
	before := h.s.Stats(h.now)
	plan := h.s.Release(h.now)
	if len(plan.Marked) == 0 {
		t.Fatal("nothing released")
	}
	h.s.UnmarkReleasing(plan)
	if after := h.s.Stats(h.now); !reflect.DeepEqual(before, after) {
		t.Fatalf("UnmarkReleasing changed counts:\nbefore %+v\nafter  %+v", before, after)
	}
	if _, err := h.add("x"); err == nil {
		t.Fatal("a cooling address became usable after UnmarkReleasing")
	}
}

func TestConflictKeptAndReported(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.10-10.0.0.11")
	h.mustAdd("a")
	h.hold("v4", "10.0.0.11") // the controller no longer lists .10
	if c := h.s.Conflicts("v4"); len(c) != 1 || c[ip("10.0.0.10")] != key("a") {
		t.Fatalf("Conflicts = %v", c)
	}
	if st := h.s.Stats(h.now); st[0].Conflicts != 1 || st[0].InUse != 1 {
		t.Fatalf("stats %+v", st[0])
	}
	if _, ok := h.s.Attachment(key("a")); !ok {
		t.Fatal("a conflicting attachment was dropped")
	}
	h.del("a")
	h.now = h.now.Add(time.Hour)
	h.mustAdd("b")
	if _, err := h.add("c"); err == nil {
		t.Fatal("the conflicting address was handed out again after its DEL")
	}
}

func TestNeverHandsOutBeforeStatus(t *testing.T) {
	h := newHarness(t, poolV4)
	_, err := h.add("a")
	var short *ShortError
	if !errors.As(err, &short) {
		t.Fatalf("ADD before any status: %v", err)
	}
	if r := h.s.Reason("v4", h.now); !strings.Contains(r, "controller has not answered") {
		t.Fatalf("reason %q", r)
	}
}

func TestReasons(t *testing.T) {
	full := poolV4
	full.Scaling.MaxPerNode = 4
	exhausted := poolV4
	exhausted.Exhausted = true
	for _, tc := range []struct {
		name string
		pool Pool
		held []string
		want string
	}{
		{"at max per node", full, []string{"10.0.0.1-10.0.0.4"}, "maxPerNode (4 addresses held"},
		{"pool exhausted", exhausted, []string{"10.0.0.1-10.0.0.2"}, "pool v4 is exhausted"},
		{"controller slow", poolV4, []string{"10.0.0.1-10.0.0.2"}, "requested 4 addresses of pool v4 and holds 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.pool)
			h.hold("v4", tc.held...)
			for i := 0; ; i++ {
				if _, err := h.add(string(rune('a' + i))); err != nil {
					break
				}
			}
			if r := h.s.Reason("v4", h.now); !strings.Contains(r, tc.want) {
				t.Fatalf("Reason = %q, want it to contain %q", r, tc.want)
			}
		})
	}
	s := New("n")
	if r := s.Reason("nope", t0); !strings.Contains(r, "not seen IPPool nope") {
		t.Fatalf("unknown pool reason %q", r)
	}
}

func TestConfigErrors(t *testing.T) {
	h := newHarness(t, poolV4)
	other := poolV6
	other.Name = "other"
	h.s.SetPools([]Pool{poolV4, other}, []string{"v4"})
	for _, tc := range []struct {
		pools []string
		want  string
	}{
		{[]string{"v4", "v4"}, `pools: pool "v4" is listed twice`},
		{[]string{"nope"}, `pools: pool "nope" is not an IPPool the agent knows (pools serving this node: v4)`},
		{[]string{"other"}, `pools: pool "other" is not served on node node-a`},
	} {
		_, err := h.add("x", tc.pools...)
		var ce *ConfigError
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("pools %v: %v, want ConfigError containing %q", tc.pools, err, tc.want)
		}
	}
	s := New("lonely")
	_, _, err := s.Add(AddRequest{Key: key("a")}, t0)
	var np *NoPoolsError
	if !errors.As(err, &np) {
		t.Fatalf("ADD on a node no pool selects: %v", err)
	}
}

func TestDemandCountsPendingPodsAndWaitersOnce(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/28")
	h.mustAdd("a") // uid-a holds v4
	h.s.SetPods([]Pod{
		{Ref: PodRef{"ns", "a", "uid-a"}},
		{Ref: PodRef{"ns", "b", "uid-b"}},
		{Ref: PodRef{"ns", "c", "uid-c"}},
		{Ref: PodRef{"ns", "host", "uid-h"}, HostNetwork: true},
	})
	h.s.AddWaiter(key("b"), "uid-b", nil)       // also a pending pod: counted once
	h.s.AddWaiter(key("x"), "", []string{"v4"}) // no pod object: counted by key
	if d := h.s.Demand("v4"); d != 4 {
		t.Fatalf("Demand = %d, want 1 in use + b + c + x = 4", d)
	}
	h.s.RemoveWaiter(key("x"))
	if d := h.s.Demand("v4"); d != 3 {
		t.Fatalf("Demand = %d after the waiter left, want 3", d)
	}
}

func TestStaleForGC(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/28")
	h.mustAdd("old-valid")
	h.mustAdd("old-gone")
	_, ch, _ := h.s.Add(AddRequest{Key: key("other-net"), Network: "other"}, h.now)
	h.commit(ch)
	h.s.ConfirmAdd(key("other-net"))
	h.now = h.now.Add(time.Minute)
	h.mustAdd("young")
	got := h.s.Stale("net", []Key{key("old-valid")}, h.now.Add(-30*time.Second))
	if !slices.Equal(got, []Key{key("old-gone")}) {
		t.Fatalf("Stale = %v, want only old-gone", got)
	}
}

func TestRebuildFromPodsAndAdopt(t *testing.T) {
	h := newHarness(t, poolV4, poolV6)
	h.hold("v4", "10.0.0.0/28")
	h.hold("v6", "fd00::/124")
	pods := []Pod{
		{Ref: PodRef{"ns", "web", "uid-web"}, IPs: []netip.Addr{ip("10.0.0.5"), ip("fd00::5")}},
		{Ref: PodRef{"ns", "done", "uid-done"}, IPs: []netip.Addr{ip("10.0.0.6")}, Finished: true},
		{Ref: PodRef{"ns", "foreign", "uid-f"}, IPs: []netip.Addr{ip("192.168.1.1")}},
	}
	ch, problems := h.s.Rebuild(pods, h.now)
	h.commit(ch)
	if len(problems) > 0 || len(ch.PutAttachments) != 1 {
		t.Fatalf("Rebuild = %+v, %v", ch, problems)
	}
	// A second rebuild finds nothing new.
	if ch2, _ := h.s.Rebuild(pods, h.now); !ch2.IsEmpty() {
		t.Fatalf("second Rebuild changed %+v", ch2)
	}
	// No one else gets the pod's addresses (14 usable v4 addresses: not the network address
	// 10.0.0.0 nor the gateway 10.0.0.1).
	for i := range 13 {
		got := h.mustAdd("x" + string(rune('a'+i)))
		if got[0] == "10.0.0.5" || got[1] == "fd00::5" {
			t.Fatalf("handed out the running pod's address: %v", got)
		}
	}
	// CNI GC never frees a rebuilt attachment.
	if st := h.s.Stale("", nil, h.now.Add(time.Hour)); len(st) != 0 {
		t.Fatalf("Stale includes rebuilt attachments: %v", st)
	}
	// The pod's new sandbox adopts its addresses.
	a, ch, err := h.s.Add(AddRequest{Key: key("sandbox2"), Network: "net", Pod: PodRef{"ns", "web", "uid-web"}}, h.now)
	if err != nil {
		t.Fatal(err)
	}
	h.commit(ch)
	h.s.ConfirmAdd(key("sandbox2"))
	if a.Addresses[0].Addr != ip("10.0.0.5") || a.Addresses[1].Addr != ip("fd00::5") {
		t.Fatalf("adopting ADD got %+v", a.Addresses)
	}
	if _, ok := h.s.Attachment(RebuiltKey("uid-web")); ok {
		t.Fatal("rebuilt attachment still there after adoption")
	}
	h.restart()
	if got := h.s.Attachments(); len(got) != 14 { // 13 new ones and the adopting sandbox
		t.Fatalf("after restart %d attachments", len(got))
	}
}

func TestAbortAdoptionRestoresPlaceholder(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/28")
	ch, _ := h.s.Rebuild([]Pod{{Ref: PodRef{"ns", "web", "uid-web"}, IPs: []netip.Addr{ip("10.0.0.5")}}}, h.now)
	h.commit(ch)
	before := h.s.Attachments()
	if _, _, err := h.s.Add(AddRequest{Key: key("s2"), Pod: PodRef{"ns", "web", "uid-web"}}, h.now); err != nil {
		t.Fatal(err)
	}
	h.s.AbortAdd(key("s2"))
	if after := h.s.Attachments(); !reflect.DeepEqual(before, after) {
		t.Fatalf("abort: %+v, want %+v", after, before)
	}
}

func TestDrainingPool(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/29")
	h.mustAdd("a")
	h.s.SetPools([]Pool{poolV4}, nil) // the pool no longer selects the node
	plan := h.s.Release(h.now)
	if n := count(plan.Marked["v4"]); n != 7 {
		t.Fatalf("draining pool released %d, want every free address (7)", n)
	}
	spec := h.s.Spec()
	if len(spec) != 1 || spec[0].Requested != 0 {
		t.Fatalf("draining spec %+v", spec)
	}
	if _, err := h.add("b", "v4"); err == nil {
		t.Fatal("ADD drew from a pool that no longer selects the node")
	}
}

// Addresses in their reuse cooldown cannot serve a pod, so they count as demand: under churn the
// node asks for more instead of making new pods wait out the cooldown.
func TestCoolingCountsAsDemand(t *testing.T) {
	h := newHarness(t, poolV4) // batch 4, buffer 50 %, cooldown 30 s
	h.hold("v4", "10.0.0.8/29")
	for _, c := range []string{"a", "b", "c", "d"} {
		h.mustAdd(c)
	}
	if d, tg := h.s.Demand("v4"), h.s.Target("v4"); d != 4 || tg != 8 {
		t.Fatalf("4 in use: demand %d target %d, want 4 and 8", d, tg)
	}
	h.del("a")
	h.del("b")
	if d, tg := h.s.Demand("v4"), h.s.Target("v4"); d != 4 || tg != 8 {
		t.Fatalf("2 in use, 2 cooling: demand %d target %d, want 4 and 8", d, tg)
	}
	h.now = h.now.Add(31 * time.Second)
	h.s.Stats(h.now) // any call with the time moves the state's clock
	if d, tg := h.s.Demand("v4"), h.s.Target("v4"); d != 2 || tg != 4 {
		t.Fatalf("after the cooldown: demand %d target %d, want 2 and 4", d, tg)
	}
}

// An exclusion added under running pods: the excluded addresses are never handed out again, the
// free ones are released at once, the ones in use drain (released, not cooled) when freed, and the
// stats count what lies outside the pool's spec.
func TestPoolEditDrainsAddressesOutsideTheSpec(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29") // .8-.15
	for _, c := range []string{"a", "b", "c", "d"} {
		h.mustAdd(c) // .8-.11
	}
	edited := poolV4
	edited.Exclude = []netip.Prefix{netip.MustParsePrefix("10.0.0.10/31"), netip.MustParsePrefix("10.0.0.14/31")}
	h.commit(h.s.SetPools([]Pool{edited}, []string{"v4"}))
	if st := h.s.Stats(h.now)[0]; st.OutsidePool != 4 || st.Free != 2 {
		t.Fatalf("after the edit: %+v; want 4 outside the pool (.10 .11 in use, .14 .15 free), 2 free", st)
	}
	if got := h.mustAdd("e")[0]; got != "10.0.0.12" {
		t.Fatalf("ADD after the edit got %s", got)
	}
	plan := h.s.Release(h.now)
	h.commit(plan.Change)
	if !plan.Marked["v4"].ContainsSet(set(t, "10.0.0.14/31")) {
		t.Fatalf("released %v; want the excluded free addresses among them", plan.Marked["v4"])
	}
	// The pod on .10 goes: .10 is released, not cooled for reuse.
	h.del("c")
	if spec := h.s.Spec(); !spec[0].Releasing.Contains(ip("10.0.0.10")) {
		t.Fatalf("spec %+v: the freed excluded address is not released", spec)
	}
	h.restart()
	h.hold("v4", "10.0.0.8/29")
	h.now = h.now.Add(time.Hour)
	for i := range 3 {
		if a, _, err := h.s.Add(AddRequest{Key: key(fmt.Sprintf("x%d", i)), Network: "net"}, h.now); err == nil &&
			(a.Addresses[0].Addr == ip("10.0.0.10") || a.Addresses[0].Addr == ip("10.0.0.14") || a.Addresses[0].Addr == ip("10.0.0.15")) {
			t.Fatalf("handed out excluded %s after a restart", a.Addresses[0].Addr)
		}
	}
}

// A deleted pool: ADD naming it gets a clear configuration error; its running pods keep their
// addresses.
func TestDeletedPoolGivesAClearErrorAndKeepsPods(t *testing.T) {
	h := newHarness(t, poolV4, poolV6)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a", "v4")
	h.commit(h.s.SetPools([]Pool{poolV6}, []string{"v6"}))
	_, _, err := h.s.Add(AddRequest{Key: key("b"), Network: "net", Pools: []string{"v4"}}, h.now)
	var ce *ConfigError
	if !errors.As(err, &ce) || !strings.Contains(ce.Error(), "was deleted") {
		t.Fatalf("ADD naming a deleted pool: %v", err)
	}
	if _, ok := h.s.Attachment(key("a")); !ok {
		t.Fatal("the deleted pool's running pod lost its attachment")
	}
}
