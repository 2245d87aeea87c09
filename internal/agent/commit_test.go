package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"testing"
	"testing/synctest"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// stateDump is what the service's state shows, for comparing before and after a refused change.
type stateDump struct {
	Attachments []ipam.Attachment
	Stats       []ipam.PoolStats
	Spec        []ipam.PoolRequest
	Served      []string
	Mark        ipam.RecordMark
	Observed    []ipam.ObservedPool
	Configs     map[string]ipam.Pool
	Holdings    map[string]string
}

func (s *Service) dump() stateDump {
	var d stateDump
	s.locked(func(st *ipam.State) {
		d = stateDump{Attachments: st.Attachments(), Stats: st.Stats(s.now()), Spec: st.Spec(), Served: st.Served(),
			Mark: st.Mark(), Observed: st.Observed(), Configs: map[string]ipam.Pool{}, Holdings: map[string]string{}}
		for _, ps := range d.Stats {
			d.Configs[ps.Pool], _ = st.PoolConfig(ps.Pool)
			held, known := st.Holding(ps.Pool)
			d.Holdings[ps.Pool] = fmt.Sprint(held, known)
		}
	})
	return d
}

// Every change of the node's state from a fact read from the API server, or from a rebuild, is
// journaled before it is applied: when the journal refuses it, the state is as it was, the
// refusal is counted, and the same change succeeds once the journal takes it.
func TestRefusedJournalLeavesTheStateUnchanged(t *testing.T) {
	edited := testV4
	edited.Cooldown = time.Minute
	for _, tc := range []struct {
		name   string
		change string // the journal_refused_total label
		setup  func(h *svcHarness)
		// do makes the change and returns its error (nil where the path returns none).
		do func(h *svcHarness) error
		// done reports whether the change was made.
		done func(h *svcHarness) bool
	}{
		{"pools: edited settings", "pools", func(h *svcHarness) {},
			func(h *svcHarness) error { return h.svc.SetPools([]ipam.Pool{edited, testV6}, []string{"v4", "v6"}) },
			func(h *svcHarness) bool { return h.svc.dump().Configs["v4"].Cooldown == time.Minute }},
		{"pools: a pool gone", "pools", func(h *svcHarness) {},
			func(h *svcHarness) error { return h.svc.SetPools(nil, nil) },
			func(h *svcHarness) bool { return len(h.svc.dump().Served) == 0 }},
		{"holdings", "holdings", func(h *svcHarness) {},
			func(h *svcHarness) error {
				return h.svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.0/28")}, RecordOf{UID: "u1", Generation: 3})
			},
			func(h *svcHarness) bool { return h.svc.dump().Mark == (ipam.RecordMark{UID: "u1", Generation: 3}) }},
		{"holdings taken back", "holdings", func(h *svcHarness) {
			h.do(addReq("c1", "v4"))
			h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "c1", IfName: "eth0"}) // cooling
		}, func(h *svcHarness) error {
			return h.svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.8")}, RecordOf{UID: "u1", Generation: 2})
		}, func(h *svcHarness) bool {
			return h.svc.dump().Holdings["v4"] == addr.MustParseSetString("10.1.0.8").String()+" true"
		}},
		{"holdings of a rewound record", "holdings", func(h *svcHarness) {
			h.svc.NoteSpecWritten("u1", 5)
		}, func(h *svcHarness) error {
			return h.svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.0/28")}, RecordOf{UID: "u1", Generation: 3, Rewound: true})
		}, func(h *svcHarness) bool {
			d := h.svc.dump()
			return d.Mark == (ipam.RecordMark{UID: "u1", Generation: 3}) && d.Stats[0].Releasing == 8
		}},
		{"record mark", "mark", func(h *svcHarness) {}, func(h *svcHarness) error {
			h.svc.NoteSpecWritten("u1", 7)
			return nil
		}, func(h *svcHarness) bool { return h.svc.dump().Mark == (ipam.RecordMark{UID: "u1", Generation: 7}) }},
		{"rebuild at start-up", "rebuild", func(h *svcHarness) {}, func(h *svcHarness) error {
			_, err := h.svc.Rebuild([]ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.12")}}})
			return err
		}, func(h *svcHarness) bool {
			d := h.svc.dump()
			return len(d.Attachments) == 2 && len(d.Observed) == 2
		}},
		{"rebuild on a pod event", "rebuild", func(h *svcHarness) {
			// The pod list itself is memory only (demand): the pod is known before it reports.
			h.svc.SetPods([]ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}}})
		}, func(h *svcHarness) error {
			h.svc.SetPods([]ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.12")}}})
			return nil
		}, func(h *svcHarness) bool { return len(h.svc.dump().Attachments) == 2 }},
		{"rebuild moving an address from an ended pod", "rebuild", func(h *svcHarness) {}, func(h *svcHarness) error {
			// c0's pod is not among the node's pods, and its sandbox path was never recorded:
			// its pod is unknown, so the report does not win (ReportWins) unless it finished.
			_, err := h.svc.Rebuild([]ipam.Pod{
				{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-c0", UID: "uid-c0"}, Finished: true},
				{Ref: ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.8")}},
			})
			return err
		}, func(h *svcHarness) bool {
			d := h.svc.dump()
			return len(d.Attachments) == 1 && d.Attachments[0].Pod.UID == "uid-web"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSvc(t, 50*time.Millisecond, testV4, testV6)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			if resp := h.do(addReq("c0", "v4")); resp.Error != nil { // 10.1.0.8
				t.Fatal(resp.Error)
			}
			tc.setup(h)
			before, journaled := h.svc.dump(), h.j.snapshot()
			refused := value(t, h.svc.metrics.JournalRefused.WithLabelValues(tc.change))
			refusal := errors.New("disk full")
			h.j.setFail(refusal)
			if err := tc.do(h); err != nil && !errors.Is(err, refusal) {
				t.Fatalf("error %v, want the journal's", err)
			}
			if after := h.svc.dump(); !reflect.DeepEqual(before, after) {
				t.Fatalf("the journal refused the change, yet the state changed:\nbefore %+v\nafter  %+v", before, after)
			}
			if got := value(t, h.svc.metrics.JournalRefused.WithLabelValues(tc.change)); got != refused+1 {
				t.Fatalf("journal_refused_total{change=%q} = %v, want %v", tc.change, got, refused+1)
			}
			if !reflect.DeepEqual(journaled, h.j.snapshot()) {
				t.Fatal("the journal changed though it refused")
			}
			if tc.done(h) {
				t.Fatal("the change was made though the journal refused it")
			}
			// The state still serves: DEL and ADD work once the journal does, and the same
			// change is made when retried.
			h.j.setFail(nil)
			if err := tc.do(h); err != nil {
				t.Fatalf("retried: %v", err)
			}
			if !tc.done(h) {
				t.Fatalf("the retried change was not made: %+v", h.svc.dump())
			}
			// What the state holds is what the journal holds.
			st := ipam.New("node-a")
			st.Restore(h.j.snapshot())
			if got, want := st.Attachments(), h.svc.dump().Attachments; !reflect.DeepEqual(got, want) {
				t.Fatalf("journal %+v, state %+v", got, want)
			}
		})
	}
}

// A refused SetPools fails the push that read the pools, which its caller retries.
func TestRefusedPoolsReturnTheError(t *testing.T) {
	h := newSvc(t, 50*time.Millisecond, testV4)
	refusal := errors.New("disk full")
	h.j.setFail(refusal)
	if err := h.svc.SetPools([]ipam.Pool{testV4, testV6}, []string{"v4", "v6"}); !errors.Is(err, refusal) {
		t.Fatalf("SetPools with a refusing journal = %v", err)
	}
	if err := h.svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.0/28")}, RecordOf{}); !errors.Is(err, refusal) {
		t.Fatalf("SetHoldings with a refusing journal = %v", err)
	}
}

// gatedJournal holds every commit until release is closed, once armed.
type gatedJournal struct {
	*memJournal
	armed   chan struct{} // closed: commits wait
	release chan struct{}
}

func (j *gatedJournal) Commit(ch ipam.Change) error {
	select {
	case <-j.armed:
		<-j.release
	default:
	}
	return j.memJournal.Commit(ch)
}

// While a rebuild's journal write is in flight, what it reserved is its own: an ADD of the pod
// it records waits and then adopts the rebuilt address, and a DEL of the attachment it takes an
// address from waits and then frees what is left.
func TestRequestsWaitForARebuildInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		j := &gatedJournal{memJournal: &memJournal{}, armed: make(chan struct{}), release: make(chan struct{})}
		svc := NewService(ipam.New("node-a"), j, ServiceOptions{Node: "node-a", AddressWait: time.Second, Log: logr.Discard()})
		if err := svc.SetPools([]ipam.Pool{testV4}, []string{"v4"}); err != nil {
			t.Fatal(err)
		}
		if err := svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.8/29")}, RecordOf{}); err != nil {
			t.Fatal(err)
		}
		svc.SetReady(true)
		do := func(req cniproto.Request) *cniproto.Response { return svc.Handle(context.Background(), req) }
		if resp := do(addReq("old")); resp.Error != nil { // 10.1.0.8
			t.Fatal(resp.Error)
		}
		close(j.armed)
		rebuilt := make(chan error, 1)
		go func() {
			// The pod of "old" finished; pod web reports its address, .8.
			_, err := svc.Rebuild([]ipam.Pod{
				{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-old", UID: "uid-old"}, Finished: true},
				{Ref: ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.8")}},
			})
			rebuilt <- err
		}()
		synctest.Wait() // the rebuild is planned and waits on the journal
		added := make(chan *cniproto.Response, 1)
		go func() {
			added <- do(cniproto.Request{Op: cniproto.OpAdd, ContainerID: "web2", IfName: "eth0", Network: "net",
				Pod: cniproto.Pod{Namespace: "ns", Name: "web", UID: "uid-web"}})
		}()
		deleted := make(chan *cniproto.Response, 1)
		go func() { deleted <- do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "old", IfName: "eth0"}) }()
		synctest.Wait()
		select {
		case r := <-added:
			t.Fatalf("the ADD did not wait for the rebuild: %+v", r)
		case r := <-deleted:
			t.Fatalf("the DEL did not wait for the rebuild: %+v", r)
		default:
		}
		close(j.release)
		if err := <-rebuilt; err != nil {
			t.Fatal(err)
		}
		if r := <-added; r.Error != nil || r.IPs[0].Address != "10.1.0.8/16" {
			t.Fatalf("the ADD of the rebuilt pod got %+v, want its reported 10.1.0.8", r)
		}
		if r := <-deleted; r.Error != nil {
			t.Fatalf("DEL: %+v", r.Error)
		}
		if d := svc.dump(); len(d.Attachments) != 1 || d.Attachments[0].Key.ContainerID != "web2" {
			t.Fatalf("attachments %+v, want web2's alone", d.Attachments)
		}
	})
}
