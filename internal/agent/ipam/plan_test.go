package ipam

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// Every kind of plan, aborted, leaves the state as it was; applied, makes its change.
func TestPlanAbortAndApply(t *testing.T) {
	for _, tc := range []struct {
		name    string
		setup   func(h *harness)
		plan    func(h *harness) Plan
		applied func(h *harness) bool
	}{
		{"add", func(h *harness) {}, func(h *harness) Plan {
			_, ch, err := h.s.Add(AddRequest{Key: key("p"), Network: "net", Pod: PodRef{"ns", "p", "uid-p"}}, h.now)
			if err != nil {
				t.Fatal(err)
			}
			return AddPlan{Key: key("p"), Change: ch}
		}, func(h *harness) bool { _, ok := h.s.Attachment(key("p")); return ok && !h.s.Pending(key("p")) }},
		{"del", func(h *harness) { h.mustAdd("p") }, func(h *harness) Plan {
			plan, err := h.s.PlanDel(key("p"), h.now)
			if err != nil {
				t.Fatal(err)
			}
			return plan
		}, func(h *harness) bool { _, ok := h.s.Attachment(key("p")); return !ok }},
		{"release", func(h *harness) {
			lowered := poolV4
			lowered.Scaling.MaxPerNode = 4
			h.commit(h.s.SetPools([]Pool{lowered}, []string{"v4"}))
		}, func(h *harness) Plan {
			plan := h.s.Release(h.now)
			if len(plan.Marked) == 0 {
				t.Fatal("nothing to release")
			}
			return plan
		}, func(h *harness) bool { return len(h.s.Spec()) == 1 && !h.s.Spec()[0].Releasing.IsEmpty() }},
		{"pools", func(h *harness) {}, func(h *harness) Plan {
			return h.s.PlanPools([]Pool{poolV4, poolV6}, []string{"v4", "v6"})
		}, func(h *harness) bool { return len(h.s.Served()) == 2 }},
		{"holdings", func(h *harness) {}, func(h *harness) Plan {
			return h.s.PlanHoldings(map[string]addr.Set{"v4": set(t, "10.0.0.8/30")}, true, h.now)
		}, func(h *harness) bool { held, _ := h.s.Holding("v4"); return held.Equal(set(t, "10.0.0.8/30")) }},
		{"mark", func(h *harness) {}, func(h *harness) Plan {
			return h.s.PlanMark(RecordMark{UID: "u", Generation: 1})
		}, func(h *harness) bool { return h.s.Mark().UID == "u" }},
		{"rebuild", func(h *harness) {}, func(h *harness) Plan {
			return h.s.PlanRebuild([]Pod{{Ref: PodRef{"ns", "w", "uid-w"}, IPs: []netip.Addr{ip("10.0.0.9")}}}, h.now, nil)
		}, func(h *harness) bool {
			_, ok := h.s.Attachment(RebuiltKey("uid-w"))
			return ok && !h.s.Pending(RebuiltKey("uid-w"))
		}},
		{"batch", func(h *harness) {}, func(h *harness) Plan {
			return Batch{h.s.PlanHoldings(map[string]addr.Set{"v4": set(t, "10.0.0.8/30")}, false, h.now),
				h.s.PlanMark(RecordMark{UID: "u", Generation: 1})}
		}, func(h *harness) bool { return h.s.Mark().UID == "u" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, apply := range []bool{false, true} {
				h := newHarness(t, poolV4)
				h.hold("v4", "10.0.0.8/29")
				tc.setup(h)
				before, full := h.s.Stats(h.now), dumpOf(h.s)
				p := tc.plan(h)
				if apply {
					h.commit(p.Changes())
					h.s.Apply(p)
					if !tc.applied(h) {
						t.Fatalf("applied %s plan did not make its change", tc.name)
					}
					continue
				}
				h.s.Abort(p)
				if after := h.s.Stats(h.now); !reflect.DeepEqual(before, after) {
					t.Fatalf("aborted %s plan changed the state:\nbefore %+v\nafter  %+v", tc.name, before, after)
				}
				if after := dumpOf(h.s); !reflect.DeepEqual(full, after) {
					t.Fatalf("aborted %s plan changed the state:\nbefore %+v\nafter  %+v", tc.name, full, after)
				}
			}
		})
	}
}
