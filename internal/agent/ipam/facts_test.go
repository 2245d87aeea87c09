package ipam

import (
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// dump is everything of a State that a plan may change, for comparing before and after.
type dump struct {
	Attachments []Attachment
	Stats       []PoolStats
	Spec        []PoolRequest
	Served      []string
	Mark        RecordMark
	Observed    []ObservedPool
	Pools       map[string]Pool
	Pending     []Key
	Cooling     map[string][]Cooling
	Releasing   map[string]map[netip.Addr]time.Time
	Gone        map[string]bool
}

func dumpOf(s *State) dump {
	d := dump{Attachments: s.Attachments(), Stats: s.Stats(s.clock), Spec: s.Spec(), Served: s.Served(), Mark: s.Mark(),
		Observed: s.Observed(), Pools: map[string]Pool{}, Cooling: map[string][]Cooling{},
		Releasing: map[string]map[netip.Addr]time.Time{}, Gone: map[string]bool{}}
	for name, p := range s.pools {
		d.Pools[name] = p.cfg
		if len(p.coolq) > 0 {
			d.Cooling[name] = slices.Clone(p.coolq)
		}
		rel := map[netip.Addr]time.Time{}
		for a, t := range p.releasing {
			rel[a] = t
		}
		d.Releasing[name] = rel
		d.Gone[name] = p.gone
	}
	for k := range s.pending {
		d.Pending = append(d.Pending, k)
	}
	slices.SortFunc(d.Pending, func(a, b Key) int { return cmpKey(a, b) })
	return d
}

func cmpKey(a, b Key) int {
	switch {
	case a.String() < b.String():
		return -1
	case a.String() > b.String():
		return 1
	}
	return 0
}

// planned checks that planning left the state as it was.
func planned[P Plan](t *testing.T, s *State, plan func() P) P {
	t.Helper()
	before := dumpOf(s)
	p := plan()
	if after := dumpOf(s); !reflect.DeepEqual(before, after) {
		t.Fatalf("planning changed the state:\nbefore %+v\nafter  %+v", before, after)
	}
	return p
}

func TestPlanPools(t *testing.T) {
	edited := poolV4
	edited.Cooldown = time.Minute
	for _, tc := range []struct {
		name   string
		setup  func(h *harness)
		pools  []Pool
		served []string
		// want: the pools journaled and forgotten, the served order after Apply, and whether
		// each pool is gone.
		put, del []string
		order    []string
		gone     map[string]bool
	}{
		{"unchanged", func(h *harness) {}, []Pool{poolV4}, []string{"v4"}, nil, nil, []string{"v4"}, map[string]bool{"v4": false}},
		{"new pool, IPv4 first", func(h *harness) {}, []Pool{poolV4, poolV6}, []string{"v6", "v4"}, []string{"v6"}, nil,
			[]string{"v4", "v6"}, map[string]bool{"v4": false, "v6": false}},
		{"edited settings", func(h *harness) {}, []Pool{edited}, []string{"v4"}, []string{"v4"}, nil, []string{"v4"}, map[string]bool{"v4": false}},
		{"no longer served", func(h *harness) {}, []Pool{poolV4}, nil, []string{"v4"}, nil, nil, map[string]bool{"v4": false}},
		{"gone and empty: forgotten", func(h *harness) {}, nil, nil, nil, []string{"v4"}, nil, map[string]bool{}},
		{"gone with a holding: drains", func(h *harness) { h.hold("v4", "10.0.0.8/30") }, nil, nil, nil, nil, nil, map[string]bool{"v4": true}},
		{"gone with a pod: drains", func(h *harness) { h.hold("v4", "10.0.0.8/30"); h.mustAdd("a"); h.hold("v4") }, nil, nil, nil, nil, nil,
			map[string]bool{"v4": true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4)
			tc.setup(h)
			plan := planned(t, h.s, func() PoolsPlan { return h.s.PlanPools(tc.pools, tc.served) })
			var put []string
			for _, p := range plan.Change.PutPools {
				put = append(put, p.Name)
				if p.Served != slices.Contains(tc.served, p.Name) {
					t.Errorf("pool %s journaled with Served %v", p.Name, p.Served)
				}
			}
			if !slices.Equal(put, tc.put) || !slices.Equal(plan.Change.DeletePools, tc.del) {
				t.Fatalf("journals pools %v and forgets %v, want %v and %v", put, plan.Change.DeletePools, tc.put, tc.del)
			}
			h.commit(plan.Changes())
			h.s.Apply(plan)
			if got := h.s.Served(); !slices.Equal(got, tc.order) {
				t.Fatalf("served %v, want %v", got, tc.order)
			}
			gone := map[string]bool{}
			for name, p := range h.s.pools {
				if p.known {
					gone[name] = p.gone
				}
			}
			if !reflect.DeepEqual(gone, tc.gone) {
				t.Fatalf("pools (gone) %v, want %v", gone, tc.gone)
			}
			// The journal holds what the state does: a restart reads the same pools.
			h.restart()
			for name := range tc.gone {
				if _, ok := h.s.PoolConfig(name); !ok {
					t.Fatalf("pool %s lost across a restart", name)
				}
			}
		})
	}
}

func TestPlanHoldings(t *testing.T) {
	type want struct {
		held                    map[string]string // after Apply
		puts                    []string          // pools whose holding is journaled
		delRel, delCool, putRel []string          // addresses
		distrusted              map[string]string // plan.Distrusted
		releasing               map[string]string // after Apply
	}
	for _, tc := range []struct {
		name     string
		setup    func(h *harness)
		holdings map[string]string
		distrust bool
		want     want
	}{
		{"unchanged", func(h *harness) { h.hold("v4", "10.0.0.8/29") }, map[string]string{"v4": "10.0.0.8/29"}, false,
			want{held: map[string]string{"v4": "10.0.0.8/29"}}},
		{"first holding", func(h *harness) {}, map[string]string{"v4": "10.0.0.8/29"}, false,
			want{held: map[string]string{"v4": "10.0.0.8/29"}, puts: []string{"v4"}}},
		{"grown", func(h *harness) { h.hold("v4", "10.0.0.8/30") }, map[string]string{"v4": "10.0.0.8/29"}, false,
			want{held: map[string]string{"v4": "10.0.0.8/29"}, puts: []string{"v4"}}},
		{"taken back: releasing and cooling forgotten", func(h *harness) {
			h.hold("v4", "10.0.0.8/29")
			h.mustAdd("a") // .8
			h.del("a")     // .8 cools
			mark := h.s.Release(h.now)
			h.commit(mark.Changes())
		}, map[string]string{"v4": "10.0.0.9-10.0.0.11"}, false,
			want{held: map[string]string{"v4": "10.0.0.9-10.0.0.11"}, puts: []string{"v4"},
				delRel: []string{"10.0.0.12", "10.0.0.13", "10.0.0.14", "10.0.0.15"}, delCool: []string{"10.0.0.8"}, releasing: map[string]string{"v4": ""}}},
		{"a pool the status lacks holds nothing", func(h *harness) { h.hold("v4", "10.0.0.8/29") }, map[string]string{}, false,
			want{held: map[string]string{"v4": ""}, puts: []string{"v4"}}},
		{"rewound: the addresses beyond the trusted holding are distrusted", func(h *harness) {
			h.hold("v4", "10.0.0.8/30")
			h.mustAdd("a") // .8
		}, map[string]string{"v4": "10.0.0.8/29"}, true,
			want{held: map[string]string{"v4": "10.0.0.8/29"}, puts: []string{"v4"},
				putRel: []string{"10.0.0.12", "10.0.0.13", "10.0.0.14", "10.0.0.15"}, distrusted: map[string]string{"v4": "10.0.0.12/30"},
				releasing: map[string]string{"v4": "10.0.0.12/30"}}},
		{"rewound, nothing trusted: every free address shown is distrusted", func(h *harness) {}, map[string]string{"v4": "10.0.0.8/31"}, true,
			want{held: map[string]string{"v4": "10.0.0.8/31"}, puts: []string{"v4"}, putRel: []string{"10.0.0.8", "10.0.0.9"},
				distrusted: map[string]string{"v4": "10.0.0.8/31"}, releasing: map[string]string{"v4": "10.0.0.8/31"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4)
			tc.setup(h)
			holdings := map[string]addr.Set{}
			for p, s := range tc.holdings {
				holdings[p] = setOrNone(t, s)
			}
			plan := planned(t, h.s, func() HoldingsPlan { return h.s.PlanHoldings(holdings, tc.distrust, h.now) })
			var puts []string
			for _, hd := range plan.Change.PutHoldings {
				puts = append(puts, hd.Pool)
			}
			addrs := func(as []Address) []string {
				var out []string
				for _, a := range as {
					out = append(out, a.Addr.String())
				}
				return out
			}
			var putRel []string
			for _, r := range plan.Change.PutReleasing {
				putRel = append(putRel, r.Addr.String())
			}
			if !slices.Equal(puts, tc.want.puts) || !slices.Equal(addrs(plan.Change.DeleteReleasing), tc.want.delRel) ||
				!slices.Equal(addrs(plan.Change.DeleteCooling), tc.want.delCool) || !slices.Equal(putRel, tc.want.putRel) {
				t.Fatalf("change %+v, want holdings of %v, releasing %v forgotten, cooling %v forgotten, %v marked",
					plan.Change, tc.want.puts, tc.want.delRel, tc.want.delCool, tc.want.putRel)
			}
			if fmt.Sprint(plan.Distrusted) != fmt.Sprint(setsOf(t, tc.want.distrusted)) {
				t.Fatalf("distrusted %v, want %v", plan.Distrusted, tc.want.distrusted)
			}
			h.commit(plan.Changes())
			h.s.Apply(plan)
			for p, s := range tc.want.held {
				if got, known := h.s.Holding(p); !known || !got.Equal(setOrNone(t, s)) {
					t.Fatalf("holding of %s %v (known %v), want %s", p, got, known, s)
				}
			}
			for p, s := range tc.want.releasing {
				if got := h.s.pools[p].relSet; !got.Equal(setOrNone(t, s)) {
					t.Fatalf("releasing in %s %v, want %s", p, got, s)
				}
			}
			for _, p := range h.s.pools {
				for _, c := range p.coolq {
					if !p.held.Contains(c.Addr) {
						t.Fatalf("cooling %s is not held", c.Addr)
					}
				}
			}
			// The journal holds what the state does.
			after := dumpOf(h.s)
			h.restart()
			if got := dumpOf(h.s); !reflect.DeepEqual(got.Attachments, after.Attachments) || !reflect.DeepEqual(got.Releasing, after.Releasing) ||
				!reflect.DeepEqual(got.Cooling, after.Cooling) {
				t.Fatalf("after a restart %+v, want %+v", got, after)
			}
		})
	}
}

// A DEL planned before a holding is applied and applied after it queues, as cooling, an address
// the new holding lacks (the journal holds it too); the next holdings plan forgets it, whether or
// not the holding changed.
func TestPlanHoldingsForgetsWhatARaceLeftBehind(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a") // .8
	shrunk := map[string]addr.Set{"v4": set(t, "10.0.0.12/30")}
	plan := h.s.PlanHoldings(shrunk, false, h.now)
	del, err := h.s.PlanDel(key("a"), h.now)
	if err != nil {
		t.Fatal(err)
	}
	h.commit(del.Changes())
	h.s.Apply(del) // .8 cools: the holding the DEL saw held it
	h.commit(plan.Changes())
	h.s.Apply(plan)
	if st := h.s.Stats(h.now); st[0].Cooling != 1 {
		t.Fatalf("stats %+v: want .8 cooling, left behind", st)
	}
	again := planned(t, h.s, func() HoldingsPlan { return h.s.PlanHoldings(shrunk, false, h.now) })
	if len(again.Change.DeleteCooling) != 1 || again.Change.DeleteCooling[0].Addr != ip("10.0.0.8") {
		t.Fatalf("change %+v: want .8 forgotten", again.Change)
	}
	h.commit(again.Changes())
	h.s.Apply(again)
	if st := h.s.Stats(h.now); st[0].Cooling != 0 || st[0].Held != 4 {
		t.Fatalf("stats %+v", st)
	}
	h.restart()
	if st := h.s.Stats(h.now); st[0].Cooling != 0 {
		t.Fatalf("after a restart %+v", st)
	}
	if again := h.s.PlanHoldings(shrunk, false, h.now); !again.Change.IsEmpty() {
		t.Fatalf("nothing left to forget, yet %+v", again.Change)
	}
}

func setOrNone(t *testing.T, s string) addr.Set {
	if s == "" {
		return addr.Set{}
	}
	return set(t, s)
}

func setsOf(t *testing.T, m map[string]string) map[string]addr.Set {
	out := map[string]addr.Set{}
	for p, s := range m {
		out[p] = set(t, s)
	}
	return out
}

func TestNextMark(t *testing.T) {
	m := RecordMark{UID: "u1", Generation: 4}
	for _, tc := range []struct {
		name    string
		cur     RecordMark
		uid     string
		gen     int64
		rewound bool
		write   bool // NextMarkOnWrite rather than NextMarkOnRead
		want    RecordMark
		moves   bool
	}{
		{"read: first record", RecordMark{}, "u1", 2, false, false, RecordMark{"u1", 2}, true},
		{"read: later generation", m, "u1", 5, false, false, RecordMark{"u1", 5}, true},
		{"read: same generation", m, "u1", 4, false, false, m, false},
		{"read: older generation, not confirmed rewound", m, "u1", 3, false, false, m, false},
		{"read: another object, not confirmed rewound", m, "u2", 9, false, false, m, false},
		{"read: no object", m, "", 0, false, false, m, false},
		{"read: rewound", m, "u1", 3, true, false, RecordMark{"u1", 3}, true},
		{"read: re-created", m, "u2", 1, true, false, RecordMark{"u2", 1}, true},
		{"write: later generation", m, "u1", 5, false, true, RecordMark{"u1", 5}, true},
		{"write: same generation", m, "u1", 4, false, true, m, false},
		{"write: another object", m, "u2", 1, false, true, RecordMark{"u2", 1}, true},
		{"write: first", RecordMark{}, "u1", 1, false, true, RecordMark{"u1", 1}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got RecordMark
			var moves bool
			if tc.write {
				got, moves = NextMarkOnWrite(tc.cur, tc.uid, tc.gen)
			} else {
				got, moves = NextMarkOnRead(tc.cur, tc.uid, tc.gen, tc.rewound)
			}
			if got != tc.want || moves != tc.moves {
				t.Fatalf("= %+v, %v; want %+v, %v", got, moves, tc.want, tc.moves)
			}
		})
	}
}

func TestPlanMark(t *testing.T) {
	h := newHarness(t, poolV4)
	p := planned(t, h.s, func() MarkPlan { return h.s.PlanMark(RecordMark{UID: "u1", Generation: 2}) })
	if p.Change.PutMark == nil || *p.Change.PutMark != (RecordMark{UID: "u1", Generation: 2}) {
		t.Fatalf("change %+v", p.Change)
	}
	h.commit(p.Changes())
	h.s.Apply(p)
	if h.s.Mark() != (RecordMark{UID: "u1", Generation: 2}) {
		t.Fatalf("mark %+v", h.s.Mark())
	}
	if again := h.s.PlanMark(h.s.Mark()); !again.Change.IsEmpty() {
		t.Fatalf("the same mark again journals %+v", again.Change)
	}
}

// A rebuild reserves what it touches: pending until applied, and put back as it was when aborted.
func TestPlanRebuildReservesAndAborts(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(h *harness)
		pods  []Pod
		// keys the plan must hold pending
		pending []Key
	}{
		{"a pod the journal does not know", func(h *harness) {},
			[]Pod{{Ref: PodRef{"ns", "web", "uid-web"}, IPs: []netip.Addr{ip("10.0.0.10")}}}, []Key{RebuiltKey("uid-web")}},
		{"an address that was cooling", func(h *harness) { h.mustAdd("a"); h.del("a") },
			[]Pod{{Ref: PodRef{"ns", "web", "uid-web"}, IPs: []netip.Addr{ip("10.0.0.8")}}}, []Key{RebuiltKey("uid-web")}},
		{"an address moved from an ended pod's attachment", func(h *harness) {
			_, ch, err := h.s.Add(AddRequest{Key: key("old"), Network: "net", Netns: "/run/netns/old", Pod: PodRef{"ns", "old", "uid-old"}}, h.now)
			if err != nil {
				h.t.Fatal(err)
			}
			h.commit(ch)
			h.s.ConfirmAdd(key("old"))
		}, []Pod{{Ref: PodRef{"ns", "new", "uid-new"}, IPs: []netip.Addr{ip("10.0.0.8")}}}, []Key{key("old"), RebuiltKey("uid-new")}},
		{"during the unattributed hold", func(h *harness) { h.s.StartHold(h.now.Add(time.Hour)) },
			[]Pod{{Ref: PodRef{"ns", "web", "uid-web"}, IPs: []netip.Addr{ip("10.0.0.9")}}}, []Key{RebuiltKey("uid-web")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, apply := range []bool{false, true} {
				h := newHarness(t, poolV4)
				h.hold("v4", "10.0.0.8/29")
				tc.setup(h)
				before := dumpOf(h.s)
				gone := func(string) Sandbox { return SandboxGone }
				plan := h.s.PlanRebuild(tc.pods, h.now, gone)
				var pending []Key
				for _, k := range tc.pending {
					if h.s.Pending(k) {
						pending = append(pending, k)
					}
				}
				if !slices.Equal(pending, tc.pending) {
					t.Fatalf("pending %v, want %v", pending, tc.pending)
				}
				// Nothing else takes what it reserved meanwhile.
				for _, pod := range tc.pods {
					if _, _, err := h.s.Add(AddRequest{Key: key("other"), Network: "net", Pod: PodRef{"ns", "other", "uid-other"},
						Meta: PodMeta{IPAddresses: pod.IPs[0].String()}}, h.now); err == nil {
						t.Fatalf("an ADD took %s while the rebuild was in flight", pod.IPs[0])
					}
				}
				for _, k := range tc.pending {
					if _, err := h.s.PlanDel(k, h.now); err == nil {
						t.Fatalf("a DEL of %s was planned while the rebuild was in flight", k)
					}
				}
				if !apply {
					h.s.Abort(plan)
					if after := dumpOf(h.s); !reflect.DeepEqual(before, after) {
						t.Fatalf("aborted rebuild changed the state:\nbefore %+v\nafter  %+v", before, after)
					}
					continue
				}
				h.commit(plan.Changes())
				h.s.Apply(plan)
				for _, k := range tc.pending {
					if h.s.Pending(k) {
						t.Fatalf("%s still pending after Apply", k)
					}
				}
				if _, ok := h.s.Attachment(tc.pending[len(tc.pending)-1]); !ok {
					t.Fatal("the rebuilt attachment is missing after Apply")
				}
				after := dumpOf(h.s)
				h.restart()
				if got := h.s.Attachments(); !reflect.DeepEqual(got, after.Attachments) {
					t.Fatalf("after a restart %+v, want %+v", got, after.Attachments)
				}
			}
		})
	}
}
