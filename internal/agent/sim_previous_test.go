package agent

// The previous IPAM in the simulation (issue 35, path 2; docs/design.md, "What the previous IPAM
// reserved"). In one seed in two the node has just switched from host-local: the pod network's
// CNI configuration names host-local as "previous", so every ipwarden ADD on it carries that
// configuration, and host-local's store is a real directory (<dataDir>/podnet) that the sim's
// host-local and the driver's code (package previous) both use:
//
//   - host-local's own pods: a few started and running before the switch (their files are in
//     the store at the start), and a few whose ADDs the runtime started just before the switch
//     and that reach host-local's lock late (a loaded node), each at a step the seed decides.
//     Such an ADD takes, as host-local does, the lowest address of its range (10.9.0.0/28, inside
//     the pod pool's CIDR) without a file in the store, and its sandbox then runs with it; its
//     DEL, at a later step or never, removes its file. They are sandboxes on the node, not
//     ipwarden's: the agent learns of them only through the store;
//   - ipwarden's side as Service drives it: before an ADD reaches the machine its driver reads
//     the store (previous.ReadHostLocalKnown, the agent process's cache of ipwarden's own files)
//     and hands the reading to the state (State.SetPrevious); a write's Reserve is carried out
//     first when the write's goroutine runs (previous.ReserveHostLocal: a *previous.TakenError
//     is the write's outcome, and the machine picks again), its journal write after; a journal
//     write refused after the reservation removes it, and a write's Unreserve runs once its
//     journal write landed (previous.UnreserveHostLocal). A goroutine may also have made the
//     reservation and not yet the journal write when the agent is killed: the file stays, as on
//     disk.
//
// The oracle adds: no address is live for two sandboxes across both IPAMs (an ipwarden
// interface and a host-local pod), after every step; and at each quiet point every attachment
// whose ADD carried "previous" has ipwarden's file for each of its addresses in the store.
//
// This side of the world draws from its own generator (seeded from the run's seed), and nothing
// of it runs in a seed whose node did not switch from host-local: those seeds replay as they did
// before it was added.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/handback"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// simHLRange is host-local's range on the pod network: part of the pod pool's CIDR.
var simHLRange = netip.MustParsePrefix("10.9.0.0/28")

type hlState uint8

const (
	hlPending hlState = iota // its ADD has not reached host-local's lock yet
	hlLive                   // host-local gave it an address; its sandbox runs
	hlGone                   // its DEL removed its file, or its ADD found the range full
)

// simHL is one pod of the previous IPAM (host-local) on the node.
type simHL struct {
	cid  string
	addr netip.Addr
	due  int // the step its ADD reaches host-local's lock
	end  int // the step its DEL comes; -1: never (it runs to the end); at least its due step + 1
	st   hlState
}

type simPrev struct {
	rng  *rand.Rand
	on   bool   // the node switched from host-local: ADDs on the pod network carry "previous"
	dir  string // host-local's directory of the pod network (<dataDir>/podnet)
	conf []byte // the "previous" object the ADDs carry
	pods []*simHL
	// dropAt: from this step on, once every host-local pod is gone, the operator removes
	// "previous" from the CNI configuration (-1: never); dropped: it did.
	dropAt  int
	dropped bool
}

// newSimPrev decides, from its own generator, whether the node switched from host-local, and
// host-local's pods: those running at the start, and the slowed ADDs of those still starting.
func (s *sim) newSimPrev() {
	p := &s.prev
	p.rng = rand.New(rand.NewPCG(s.seed, 0x4c0ca1))
	if p.rng.IntN(2) != 0 {
		return
	}
	p.on = true
	data := s.t.TempDir()
	p.dir = filepath.Join(data, "podnet")
	p.conf = []byte(fmt.Sprintf(`{"type":"host-local","dataDir":%q}`, data))
	if err := os.MkdirAll(p.dir, 0o755); err != nil {
		s.fatalf("%v", err)
	}
	p.dropAt = -1
	if p.rng.IntN(2) == 0 {
		p.dropAt = 200 + p.rng.IntN(350)
	}
	running := p.rng.IntN(3)
	starting := 1 + p.rng.IntN(5)
	for i := range running + starting {
		h := &simHL{cid: fmt.Sprintf("hl%d", i), end: -1}
		if i >= running {
			h.due = 1 + p.rng.IntN(150)
		}
		if p.dropAt >= 0 || p.rng.IntN(2) == 0 {
			// Where the operator will drop "previous", every host-local pod ends first.
			h.end = h.due + 1 + p.rng.IntN(300)
		}
		p.pods = append(p.pods, h)
	}
	s.logf("the node switched from host-local: %d of its pods running, %d ADDs still to reach its lock", running, starting)
	for _, h := range p.pods[:running] {
		s.hlAdd(h)
	}
}

// prevStep is host-local's side of one step: the ADDs that reach its lock now, the DELs that
// come now, and sometimes a write's goroutine that made its reservation in the store and not
// yet its journal write.
func (s *sim) prevStep() {
	p := &s.prev
	if !p.on {
		return
	}
	if p.rng.IntN(3) == 0 && slices.ContainsFunc(s.a.writes, func(sw *simWrite) bool { return sw.w.Reserve != nil && !sw.reserved }) {
		// The race itself: a slowed ADD reaches host-local's lock while an ipwarden ADD's write,
		// planned from an older reading, is still to make its reservation.
		for _, h := range p.pods {
			if h.st == hlPending && h.due > s.step {
				s.logf("host-local ADD %s/eth0 reaches the lock early, with an ipwarden ADD's write in flight", h.cid)
				h.due = s.step
				break
			}
		}
	}
	for _, h := range p.pods {
		switch {
		case h.st == hlPending && h.due == s.step:
			s.hlAdd(h)
		case h.st == hlLive && h.end == s.step:
			s.hlDel(h)
		}
	}
	if p.rng.IntN(6) == 0 {
		var c []int
		for i, sw := range s.a.writes {
			if sw.w.Reserve != nil && !sw.reserved && !sw.onDisk {
				c = append(c, i)
			}
		}
		if len(c) > 0 {
			s.reserveOnly(c[p.rng.IntN(len(c))])
		}
	}
}

// hlFiles reads host-local's directory: address -> content.
func (s *sim) hlFiles() map[netip.Addr]string {
	ents, err := os.ReadDir(s.prev.dir)
	if err != nil {
		s.fatalf("read host-local's directory: %v", err)
	}
	out := map[netip.Addr]string{}
	for _, e := range ents {
		a, err := netip.ParseAddr(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.prev.dir, e.Name()))
		if err != nil {
			s.fatalf("read host-local's file %s: %v", e.Name(), err)
		}
		out[a] = string(b)
	}
	return out
}

// hlAdd is host-local's ADD of h, under its lock: the lowest address of its range without a
// file in the store (host-local skips the range's network address).
func (s *sim) hlAdd(h *simHL) {
	files := s.hlFiles()
	for a := simHLRange.Addr().Next(); simHLRange.Contains(a); a = a.Next() {
		if _, ok := files[a]; ok {
			continue
		}
		if err := os.WriteFile(filepath.Join(s.prev.dir, a.String()), []byte(handback.Content(h.cid, "eth0")), 0o644); err != nil {
			s.fatalf("host-local's file: %v", err)
		}
		h.addr, h.st = a, hlLive
		s.counts["host-local add"]++
		s.logf("host-local ADD %s/eth0 (a pod that started through host-local) = %s", h.cid, a)
		return
	}
	h.st = hlGone
	s.counts["host-local range full"]++
	s.logf("host-local ADD %s/eth0 failed: its range is full", h.cid)
}

// hlDel is host-local's DEL of h: its file goes.
func (s *sim) hlDel(h *simHL) {
	path := filepath.Join(s.prev.dir, h.addr.String())
	if b, err := os.ReadFile(path); err == nil && string(b) == handback.Content(h.cid, "eth0") {
		if err := os.Remove(path); err != nil {
			s.fatalf("host-local's DEL: %v", err)
		}
	}
	h.st = hlGone
	s.counts["host-local del"]++
	s.logf("host-local DEL %s/eth0 (%s)", h.cid, h.addr)
}

// readPrevious is Service.readPrevious for ADD req of interface f: on the pod network of a node
// that switched from host-local, the ADD carries "previous", and the driver reads the store and
// hands the reading to the state before the ADD reaches the machine.
func (s *sim) readPrevious(f *simIf, req *cniproto.Request) {
	p := &s.prev
	if !p.on || f.network != "podnet" {
		return
	}
	a := s.a
	if !p.dropped && p.dropAt >= 0 && s.step >= p.dropAt &&
		!slices.ContainsFunc(p.pods, func(h *simHL) bool { return h.st != hlGone }) {
		p.dropped = true
		s.counts["previous dropped"]++
		s.logf("the CNI configuration no longer names previous (host-local's pods are gone)")
	}
	if p.dropped {
		// An ADD without "previous" forgets the network's reading (forgetPrevious).
		if a.prevSet {
			a.m.st.ClearPrevious(f.network)
			a.m.changed()
			s.flush()
			a.prevSet, a.prevLast = false, ""
			s.logf("previous reading of %s forgotten", f.network)
		}
		return
	}
	req.Previous = p.conf
	if a.prevKnown == nil {
		a.prevKnown = map[string]bool{}
	}
	reserved, err := previous.ReadHostLocalKnown(context.Background(), s.prev.dir, a.prevKnown)
	if err != nil {
		s.fatalf("read host-local's reservations: %v", err)
	}
	a.m.st.SetPrevious(f.network, reserved, true)
	a.prevSet = true
	s.flush()
	if reserved.String() != a.prevLast {
		a.prevLast = reserved.String()
		s.logf("previous read: host-local reserves %s", a.prevLast)
	}
}

// prevReserve is the first step of a write's goroutine (Service.perform): its reservation in
// host-local's store. It returns the write's outcome when the store refuses it.
func (s *sim) prevReserve(sw *simWrite) error {
	if sw.w.Reserve == nil || sw.reserved {
		return nil
	}
	rv := *sw.w.Reserve
	err := previous.ReserveHostLocal(context.Background(), rv.Store.Dir, rv.Reservations)
	var taken *previous.TakenError
	switch {
	case err == nil:
		sw.reserved = true
		s.counts["previous reserved"]++
		s.logf("write %d: %s reserved in host-local's store", sw.w.ID, reservationAddrs(rv))
		return nil
	case errors.As(err, &taken):
		s.counts["previous taken"]++
		s.logf("write %d: host-local holds %s itself: refused, nothing journaled", sw.w.ID, taken.Addrs)
		return err
	}
	s.fatalf("reserve in host-local's store: %v", err)
	return &ReserveError{Kind: rv.Store.Kind, Err: err}
}

// prevUnreserve removes ipwarden's files of rv from host-local's store (releasePrevious).
func (s *sim) prevUnreserve(rv *Reserve, why string) {
	if rv == nil {
		return
	}
	removed, err := previous.UnreserveHostLocal(context.Background(), rv.Store.Dir, rv.Reservations)
	if err != nil {
		s.fatalf("unreserve in host-local's store: %v", err)
	}
	if len(removed) > 0 {
		s.counts["previous unreserved"]++
		s.logf("host-local's store: ipwarden's %v removed (%s)", removed, why)
	}
}

// refusedByStore feeds write i's refusal by host-local's store to the machine: the goroutine
// made no journal write.
func (s *sim) refusedByStore(i int, err error) {
	sw := s.a.writes[i]
	s.a.writes = append(s.a.writes[:i:i], s.a.writes[i+1:]...)
	s.a.m.Written(sw.w.ID, err, s.now)
	s.flush()
}

// reserveOnly runs write i's goroutine up to its reservation: the journal write is still to
// come (a kill now leaves the file in the store).
func (s *sim) reserveOnly(i int) {
	sw := s.a.writes[i]
	if err := s.prevReserve(sw); err != nil {
		s.refusedByStore(i, err)
		return
	}
	s.logf("write %d: reserved, its journal write not made yet", sw.w.ID)
}

// checkPrevious: no address is live for two sandboxes across both IPAMs.
func (s *sim) checkPrevious(seen map[netip.Addr]*simIf) {
	for _, h := range s.prev.pods {
		if h.st != hlLive {
			continue
		}
		if f := seen[h.addr]; f != nil {
			s.fatalf("address %s is live for two sandboxes across both IPAMs: ipwarden's %s (pod %s) and host-local's %s/eth0",
				h.addr, f.key, f.sb.pod.ref.Name, h.cid)
		}
	}
}

// checkPreviousStore, at a quiet point: every attachment whose ADD carried "previous" has
// ipwarden's file for each of its addresses in host-local's store.
func (s *sim) checkPreviousStore() {
	if !s.prev.on {
		return
	}
	files := s.hlFiles()
	for _, att := range s.a.m.st.Attachments() {
		if att.Previous == nil {
			continue
		}
		for _, ad := range att.Addresses {
			if got, want := files[ad.Addr], previous.OwnHostLocalContent(att.Key.ContainerID, att.Key.IfName); got != want && !s.claimFile(att, got) && !s.draFile(att, ad.Addr, got) {
				s.fatalf("at a quiet point attachment %s = %s carried \"previous\", and host-local's store has %q for it, not ipwarden's file",
					att.Key, ad.Addr, strings.ReplaceAll(got, "\r\n", "|"))
			}
		}
	}
}

// prevEnd: host-local's pods still running end with their DELs.
func (s *sim) prevEnd() {
	for _, h := range s.prev.pods {
		if h.st == hlLive {
			s.hlDel(h)
		}
	}
}
