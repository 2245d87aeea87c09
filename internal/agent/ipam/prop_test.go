package ipam

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// fakeController plays the controller's side of the contract for one node: it grants addresses
// from its pool up to the node's request and removes only the addresses the node lists in
// releasing, which then rest for the cooldown before it grants them again.
type fakeController struct {
	pool    addr.Set
	held    map[string]addr.Set
	resting map[netip.Addr]time.Time
}

func (c *fakeController) sync(s *State, now time.Time, rng *rand.Rand) map[string]addr.Set {
	for _, req := range s.Spec() {
		held := c.held[req.Pool]
		// Take back releasing addresses (all, or some when the controller is slow).
		for _, a := range req.Releasing.Intersect(held).Addrs(1 << 20) {
			if rng.IntN(4) == 0 {
				continue
			}
			held = held.Subtract(addr.SetOfAddrs(a))
			c.resting[a] = now
		}
		// Fill the deficit (possibly partly).
		deficit := req.Requested - (count(held) - count(req.Releasing.Intersect(held)))
		if deficit > 0 {
			deficit = rng.IntN(deficit + 1)
		}
		for _, a := range c.pool.Addrs(1 << 20) {
			if deficit <= 0 {
				break
			}
			if t, ok := c.resting[a]; ok && now.Sub(t) < time.Minute {
				continue
			}
			if c.anyHolds(a) {
				continue
			}
			held = held.Union(addr.SetOfAddrs(a))
			delete(c.resting, a)
			deficit--
		}
		c.held[req.Pool] = held
	}
	return c.held
}

func (c *fakeController) anyHolds(a netip.Addr) bool {
	for _, h := range c.held {
		if h.Contains(a) {
			return true
		}
	}
	return false
}

// TestRandomOperationsKeepInvariants drives the state machine with random ADD, DEL, aborted ADD,
// scale-down, controller syncs, clock steps and restarts from the journal model, and checks after
// every step that no address is handed out twice, outside the holding, while releasing or
// before its cooldown, that DEL is idempotent and ADD repeatable, and that a restart from the
// journal yields the same state.
func TestRandomOperationsKeepInvariants(t *testing.T) {
	for seed := range 40 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { randomRun(t, uint64(seed), 99, 400) })
	}
}

// FuzzStateMachine runs the random-operations property test from fuzzed seeds.
func FuzzStateMachine(f *testing.F) {
	f.Add(uint64(1), uint64(2), uint16(300))
	f.Add(uint64(7), uint64(0), uint16(1000))
	f.Fuzz(func(t *testing.T, s1, s2 uint64, steps uint16) {
		randomRun(t, s1, s2, int(steps%2000))
	})
}

func randomRun(t testing.TB, seed, seed2 uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, seed2))
	v4, v6 := poolV4, poolV6
	v4.Scaling.BatchSize, v6.Scaling.BatchSize = 2+rng.IntN(4), 2+rng.IntN(4)
	h := newHarness(t, v4, v6)
	ctl := &fakeController{
		pool:    set(t, "10.0.0.0/27").Union(set(t, "fd00::/123")),
		held:    map[string]addr.Set{},
		resting: map[netip.Addr]time.Time{},
	}
	ctl.pool = ctl.pool.Subtract(set(t, "10.0.0.0/28")) // v4 pool is 10.0.0.16/28 ...
	ctl.held["v4"], ctl.held["v6"] = addr.Set{}, addr.Set{}
	poolOf := func(a netip.Addr) addr.Set {
		if a.Is4() {
			return set(t, "10.0.0.16/28")
		}
		return set(t, "fd00::/123")
	}
	_ = poolOf
	lastFreed := map[netip.Addr]time.Time{}
	live := map[string][]Address{} // container -> addresses, the test's own record
	// After a lost journal: sandboxes whose pods have not reported their addresses, and those
	// rebuilt from a report; both stay live, and DEL can no longer name them.
	unreported, rebuilt := map[string][]Address{}, map[string][]Address{}
	var pods []Pod // the pods bound to the node, as the agent last saw them
	holdUntil := time.Time{}
	n := 0
	for step := 0; step < steps; step++ {
		switch op := rng.IntN(10); {
		case op < 4: // ADD, new or repeated
			var cid string
			if len(live) > 0 && rng.IntN(4) == 0 {
				for c := range live {
					cid = c
					break
				}
			} else {
				n++
				cid = fmt.Sprintf("c%d", n)
			}
			pools := [][]string{nil, {"v4"}, {"v6"}}[rng.IntN(3)]
			a, ch, err := h.s.Add(AddRequest{Key: key(cid), Network: "net", Pod: PodRef{"ns", cid, "uid-" + cid}, Pools: pools}, h.now)
			if err != nil {
				if _, ok := err.(*ShortError); !ok {
					t.Fatalf("step %d: ADD %s: %v", step, cid, err)
				}
				continue
			}
			if prev, ok := live[cid]; ok {
				if !reflect.DeepEqual(prev, a.Addresses) || !ch.IsEmpty() {
					t.Fatalf("step %d: repeated ADD %s = %v, first gave %v", step, cid, a.Addresses, prev)
				}
				continue
			}
			for _, ad := range a.Addresses {
				held, _ := h.s.Holding(ad.Pool)
				if !held.Contains(ad.Addr) {
					t.Fatalf("step %d: handed out %s, not held (%v)", step, ad.Addr, held)
				}
				cfg, _ := h.s.PoolConfig(ad.Pool)
				if u, ok := cfg.Usable(); ok && !u.Contains(ad.Addr) {
					t.Fatalf("step %d: handed out %s, outside pool %s's current spec (exclude %v)", step, ad.Addr, ad.Pool, cfg.Exclude)
				}
				for _, req := range h.s.Spec() {
					if req.Releasing.Contains(ad.Addr) {
						t.Fatalf("step %d: handed out releasing %s", step, ad.Addr)
					}
				}
				if f, ok := lastFreed[ad.Addr]; ok && h.now.Sub(f) < 30*time.Second {
					t.Fatalf("step %d: handed out %s %v after its DEL", step, ad.Addr, h.now.Sub(f))
				}
				for _, m := range []map[string][]Address{live, unreported, rebuilt} {
					for c, others := range m {
						for _, o := range others {
							if o.Addr == ad.Addr {
								t.Fatalf("step %d: %s handed to %s and %s", step, ad.Addr, c, cid)
							}
						}
					}
				}
			}
			if rng.IntN(10) == 0 { // the journal refuses the write: nothing was answered
				h.s.AbortAdd(key(cid))
				continue
			}
			h.commit(ch)
			h.s.ConfirmAdd(key(cid))
			live[cid] = a.Addresses
		case op < 6: // DEL, known or not
			cid := fmt.Sprintf("c%d", rng.IntN(n+2))
			found := h.del(cid)
			if _, ok := live[cid]; ok != found {
				t.Fatalf("step %d: DEL %s found=%v, live=%v", step, cid, found, ok)
			}
			for _, ad := range live[cid] {
				lastFreed[ad.Addr] = h.now
			}
			delete(live, cid)
			delete(unreported, cid) // the runtime stopped the sandbox; the agent no longer knows it
			delete(rebuilt, cid)
		case op < 7: // scale-down
			plan := h.s.Release(h.now)
			if rng.IntN(8) == 0 {
				h.s.UnmarkReleasing(plan)
				continue
			}
			h.commit(plan.Change)
		case op < 8: // controller
			for pool, held := range ctl.sync(h.s, h.now, rng) {
				h.commit(h.s.SetHolding(pool, held))
			}
		case op < 9:
			if rng.IntN(4) == 0 { // the operator edits the v4 pool's exclusions
				v4.Exclude = nil
				for _, e := range []string{"10.0.0.16/30", "10.0.0.20/31", "10.0.0.25/32", "10.0.0.28/30"} {
					if rng.IntN(3) == 0 {
						v4.Exclude = append(v4.Exclude, netip.MustParsePrefix(e))
					}
				}
				h.commit(h.s.SetPools([]Pool{v4, v6}, []string{"v4", "v6"}))
				continue
			}
			h.now = h.now.Add(time.Duration(rng.IntN(20)) * time.Second)
			if len(unreported) > 0 && rng.IntN(3) == 0 { // a pod reports its status.podIPs
				for cid, as := range unreported {
					for i := range pods {
						if pods[i].Ref.Name == cid {
							for _, ad := range as {
								pods[i].IPs = append(pods[i].IPs, ad.Addr)
							}
						}
					}
					rebuilt[cid] = as
					delete(unreported, cid)
					break
				}
				h.s.SetPods(pods)
				ch, _ := h.s.Rebuild(pods, h.now)
				h.commit(ch)
				if h.s.EvaluateHold(h.now).Release {
					holdUntil = time.Time{}
				}
			}
		default:
			if rng.IntN(3) == 0 { // the journal is lost: rebuild from the pods, hold the rest
				pools, served := h.snap.Pools, h.s.Served()
				for cid, as := range live {
					p := Pod{Ref: PodRef{"ns", cid, "uid-" + cid}}
					if rng.IntN(2) == 0 {
						for _, ad := range as {
							p.IPs = append(p.IPs, ad.Addr)
						}
						rebuilt[cid] = as
					} else {
						unreported[cid] = as
					}
					pods = append(pods, p)
				}
				clear(live)
				clear(lastFreed) // cooldowns are lost with the journal
				h.s, h.snap = New("node-a"), Snapshot{}
				h.commit(h.s.SetPools(pools, served))
				for _, pool := range []string{"v4", "v6"} {
					h.commit(h.s.SetHolding(pool, ctl.held[pool]))
				}
				h.s.SetPods(pods)
				ch, _ := h.s.Rebuild(pods, h.now)
				h.commit(ch)
				holdUntil = h.now.Add(1000 * time.Hour) // never runs out here: the property is the hold's
				h.s.StartHold(holdUntil)
				if h.s.EvaluateHold(h.now).Release {
					holdUntil = time.Time{}
				}
				continue
			}
			before, stats := h.s.Attachments(), h.s.Stats(h.now)
			spec := h.s.Spec()
			h.crash()
			h.s.SetPods(pods)
			if !holdUntil.IsZero() { // the agent resumes an interrupted hold (its marker)
				h.s.StartHold(holdUntil)
				continue // a resumed hold may hold addresses granted since: stats and spec differ
			}
			if h.s.LostAhead() != 0 {
				t.Fatalf("step %d: a restart found %d addresses reserved ahead: this agent writes none", step, h.s.LostAhead())
			}
			if after := h.s.Attachments(); !reflect.DeepEqual(before, after) {
				t.Fatalf("step %d: restart changed attachments\n%+v\n%+v", step, before, after)
			}
			if after := h.s.Stats(h.now); !reflect.DeepEqual(stats, after) {
				t.Fatalf("step %d: restart changed stats\n%+v\n%+v", step, stats, after)
			}
			if after := h.s.Spec(); !specEqual(spec, after) {
				t.Fatalf("step %d: restart changed spec\n%+v\n%+v", step, spec, after)
			}
		}
		// The controller never removed a live address, so none is a conflict.
		for _, st := range h.s.Stats(h.now) {
			if st.Conflicts != 0 {
				t.Fatalf("step %d: conflicts %+v", step, st)
			}
		}
	}
}

func specEqual(a, b []PoolRequest) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Pool != b[i].Pool || a[i].Requested != b[i].Requested || !a[i].Releasing.Equal(b[i].Releasing) {
			return false
		}
	}
	return true
}
