package gc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The model: a truthful API server (pods are unborn, alive or gone; at most one alive pod per
// name; UIDs never reused), the runtime's ADDs and DELs, a pod informer whose cache is any subset
// of the pods ever created (lagging, lossy, showing gone pods) and whose delete events may be
// lost, late (after the name was reused), duplicated or replayed for a pod that still exists, an
// API server that fails reads at random, and the collector's shell played step by step with the
// package's decisions, the API read and the free being separate steps so that the world moves
// in between. Every attachment has a sandbox that runs from its ADD until the runtime stops it (a
// DEL, or a kubelet that stops a gone pod's sandbox late, or not before the run settles); its
// network namespace path was recorded and is visible to the agent, or recorded where the agent
// cannot see it, or not recorded. The assumptions, the grace periods' contracts: a pod the
// runtime asked an address for exists in the API server before the attachment is grace old; the
// sandbox of a gone pod whose namespace the agent cannot check stops within the sandbox grace
// (unrecorded: within grace) of the pod's deletion. A visible namespace needs no contract.

type podState int

const (
	unborn podState = iota
	alive
	gone
)

type mPod struct {
	ref    ipam.PodRef
	state  podState
	goneAt time.Time
}

type mAtt struct {
	a     Attachment
	owner *mPod
	// sb is how the agent sees the sandbox's namespace while it runs; live is set while it runs.
	sb   Sandbox
	live bool
}

// seen is what the agent's shell reads of the sandbox now.
func (a *mAtt) seen() Sandbox {
	if a.sb == SandboxExists && !a.live {
		return SandboxGone
	}
	return a.sb
}

type inFlight struct {
	name   Name
	sel    Selection
	dels   []Deletion
	lookup Lookup
	sbs    []Sandbox
	readAt time.Time
}

type model struct {
	t      *testing.T
	rng    *rand.Rand
	now    time.Time
	grace  time.Duration
	pods   []*mPod
	atts   map[ipam.Key]*mAtt
	cache  []ipam.PodRef
	events []Deletion // deletions the informer has yet to deliver (any order)

	// The collector's state.
	deletions Deletions
	queue     []Name
	flights   []inFlight
	rechecks  map[Name]time.Time

	goneSince map[ipam.Key]time.Time
	timing    Timing

	nextID        int
	apiErrorRate  float64
	freed, kept   int
	freedByReason map[string]int
	keptByReason  map[string]int
}

var names = []Name{{"ns", "a"}, {"ns", "b"}, {"ns", "c"}, {"other", "a"}}

func newModel(t *testing.T, seed uint64) *model {
	return &model{t: t, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), now: t0, grace: grace,
		atts: map[ipam.Key]*mAtt{}, rechecks: map[Name]time.Time{}, apiErrorRate: 0.2, freedByReason: map[string]int{},
		keptByReason: map[string]int{}, goneSince: map[ipam.Key]time.Time{},
		timing: Timing{Grace: grace, SandboxGrace: 5 * grace, Poll: grace / 10, SlowPoll: grace}}
}

func (m *model) id(prefix string) string {
	m.nextID++
	return fmt.Sprintf("%s%d", prefix, m.nextID)
}

func (m *model) aliveNamed(n Name) *mPod {
	for _, p := range m.pods {
		if p.state == alive && p.ref.Namespace == n.Namespace && p.ref.Name == n.Name {
			return p
		}
	}
	return nil
}

// create makes p alive, deleting the pod that holds its name first (a StatefulSet waits for it).
func (m *model) create(p *mPod) {
	if old := m.aliveNamed(Name{p.ref.Namespace, p.ref.Name}); old != nil {
		m.delete(old)
	}
	p.state = alive
}

func (m *model) delete(p *mPod) {
	p.state = gone
	p.goneAt = m.now
	switch r := m.rng.Float64(); {
	case r < 0.3: // the watch missed it
	case r < 0.45: // delivered twice
		m.events = append(m.events, Deletion{Pod: p.ref, At: m.now}, Deletion{Pod: p.ref, At: m.now})
	default:
		m.events = append(m.events, Deletion{Pod: p.ref, At: m.now})
	}
}

func (m *model) snapshot() []Attachment {
	out := make([]Attachment, 0, len(m.atts))
	for _, a := range m.atts {
		out = append(out, a.a)
	}
	slices.SortFunc(out, func(a, b Attachment) int {
		if a.Key.ContainerID < b.Key.ContainerID {
			return -1
		}
		if a.Key.ContainerID > b.Key.ContainerID {
			return 1
		}
		return 0
	})
	return out
}

// get is the API server: truthful, or an error.
func (m *model) get(n Name) Lookup {
	if m.rng.Float64() < m.apiErrorRate {
		return Lookup{Name: n, Err: errors.New("api server unavailable")}
	}
	if p := m.aliveNamed(n); p != nil {
		return Lookup{Name: n, Found: true, UID: p.ref.UID}
	}
	return Lookup{Name: n}
}

func (m *model) step() {
	switch r := m.rng.IntN(100); {
	case r < 12: // a pod is created
		n := names[m.rng.IntN(len(names))]
		if m.aliveNamed(n) == nil {
			p := &mPod{ref: ipam.PodRef{Namespace: n.Namespace, Name: n.Name, UID: m.id("uid-")}}
			m.pods = append(m.pods, p)
			m.create(p)
		}
	case r < 22: // a pod is deleted (or a StatefulSet replaces it)
		if p := m.pick(alive); p != nil {
			m.delete(p)
		}
	case r < 40: // ADD
		m.add()
	case r < 45: // CNI DEL
		for k := range m.atts {
			delete(m.atts, k)
			break
		}
	case r < 50: // an ADD's journal write finishes
		for _, a := range m.atts {
			a.a.Pending = false
		}
	case r < 58: // the cache changes: the truth, or any subset of the pods ever created
		m.cache = m.cache[:0]
		truth := m.rng.IntN(2) == 0
		for _, p := range m.pods {
			if p.state == unborn {
				continue
			}
			if (truth && p.state == alive) || (!truth && m.rng.IntN(2) == 0) {
				m.cache = append(m.cache, p.ref)
			}
		}
	case r < 68: // the informer delivers a delete event, in any order
		if len(m.events) > 0 {
			i := m.rng.IntN(len(m.events))
			d := m.events[i]
			m.events = slices.Delete(m.events, i, i+1)
			m.deliver(d)
		}
	case r < 70: // a delete event replayed for a pod that still exists (a stale watch)
		if p := m.pick(alive); p != nil {
			m.deliver(Deletion{Pod: p.ref, At: m.now})
		}
	case r < 75: // the full check
		m.queue = append(m.queue, Sweep(m.snapshot(), NewCache(m.cache), m.now, m.grace)...)
	case r < 85: // a worker selects and reads the API server
		if len(m.queue) > 0 {
			i := m.rng.IntN(len(m.queue))
			n := m.queue[i]
			m.queue = slices.Delete(m.queue, i, i+1)
			m.selectAndRead(n)
		}
	case r < 95: // a worker applies what it read, possibly long after
		if len(m.flights) > 0 {
			i := m.rng.IntN(len(m.flights))
			f := m.flights[i]
			m.flights = slices.Delete(m.flights, i, i+1)
			m.apply(f)
		}
	default:
		if m.rng.IntN(2) == 0 {
			m.stopSandbox()
			return
		}
		m.advance(time.Duration(m.rng.Int64N(int64(m.grace / 2))))
	}
}

// stopSandbox is the kubelet stopping a gone pod's sandbox without a DEL (its namespace is
// removed; the DEL may never come).
func (m *model) stopSandbox() {
	var c []*mAtt
	for _, a := range m.atts {
		if a.live && a.owner.state == gone {
			c = append(c, a)
		}
	}
	if len(c) > 0 {
		slices.SortFunc(c, func(a, b *mAtt) int { return strings.Compare(a.a.Key.ContainerID, b.a.Key.ContainerID) })
		c[m.rng.IntN(len(c))].live = false
	}
}

func (m *model) pick(s podState) *mPod {
	var c []*mPod
	for _, p := range m.pods {
		if p.state == s {
			c = append(c, p)
		}
	}
	if len(c) == 0 {
		return nil
	}
	return c[m.rng.IntN(len(c))]
}

// add records an ADD: for a live pod, for a pod the API server has yet to create (the runtime ran
// ahead of the API server, within the grace contract), or for a pod already gone (the runtime
// racing a force delete). The runtime may omit the UID, or the name too.
func (m *model) add() {
	var p *mPod
	switch r := m.rng.IntN(100); {
	case r < 65:
		p = m.pick(alive)
	case r < 85:
		n := names[m.rng.IntN(len(names))]
		p = &mPod{ref: ipam.PodRef{Namespace: n.Namespace, Name: n.Name, UID: m.id("uid-")}, state: unborn}
		m.pods = append(m.pods, p)
	default:
		p = m.pick(gone)
	}
	if p == nil {
		return
	}
	ref := p.ref
	switch r := m.rng.IntN(100); {
	case r < 15:
		ref.UID = ""
	case r < 20:
		ref.Namespace, ref.Name = "", ""
	case r < 22:
		ref = ipam.PodRef{}
	}
	k := ipam.Key{ContainerID: m.id("c"), IfName: "eth0"}
	ma := &mAtt{a: Attachment{Key: k, Pod: ref, Created: m.now, Pending: m.rng.IntN(4) == 0}, owner: p, live: true}
	switch r := m.rng.IntN(100); {
	case r < 60:
		ma.sb, ma.a.Netns = SandboxExists, "/var/run/netns/cni-"+k.ContainerID
	case r < 80:
		ma.sb, ma.a.Netns = SandboxUnknown, "/proc/1/ns/net"
	default:
		ma.sb = SandboxUnrecorded
	}
	m.atts[k] = ma
}

func (m *model) deliver(d Deletion) {
	if m.deletions.Add(d) {
		n, _ := NameOf(d.Pod)
		m.queue = append(m.queue, n)
	}
}

func (m *model) selectAndRead(n Name) {
	dels := m.deletions.Of(n)
	sel := Select(n, m.snapshot(), NewCache(m.cache), dels, m.now, m.grace)
	f := inFlight{name: n, sel: sel, dels: dels, readAt: m.now}
	for _, c := range sel.Candidates {
		sb := SandboxGone // DEL'd meanwhile: its sandbox is gone
		if a, ok := m.atts[c.Key]; ok {
			sb = a.seen()
		}
		f.sbs = append(f.sbs, sb)
	}
	if len(sel.Candidates) > 0 {
		f.lookup = m.get(n)
	}
	m.flights = append(m.flights, f)
}

func (m *model) apply(f inFlight) {
	retry := false
	recheck := f.sel.RecheckAt
	for i, c := range f.sel.Candidates {
		v := Judge(c.Pod, f.lookup)
		if !v.Free {
			if v.Reason == ReasonAPIError {
				retry = true
			} else {
				delete(m.goneSince, c.Key)
			}
			m.kept++
			m.keptByReason[v.Reason]++
			continue
		}
		since, ok := m.goneSince[c.Key]
		if !ok {
			since = f.readAt
			m.goneSince[c.Key] = since
		}
		rel := Decide(f.sbs[i], since, f.readAt, m.timing)
		if !rel.Free {
			m.kept++
			m.keptByReason[rel.Reason]++
			if recheck.IsZero() || rel.RecheckAt.Before(recheck) {
				recheck = rel.RecheckAt
			}
			continue
		}
		cur, ok := m.atts[c.Key]
		if !ok || !cur.a.Same(c.Attachment) || cur.a.Pending {
			continue // DEL'd or re-added meanwhile: the shell frees only the attachment it selected
		}
		if cur.owner.state != gone {
			m.t.Fatalf("freed attachment %s of pod %+v, which is %v (reason %s, lookup %+v, selected with deletion %+v)",
				c.Key, cur.owner.ref, map[podState]string{unborn: "not created yet", alive: "alive"}[cur.owner.state], v.Reason, f.lookup, c.Deletion)
		}
		if cur.live {
			m.t.Fatalf("freed attachment %s of gone pod %+v while its sandbox runs (namespace %s, reason %s, pod gone at %v, read at %v)",
				c.Key, cur.owner.ref, cur.sb, rel.Reason, cur.owner.goneAt.Sub(t0), f.readAt.Sub(t0))
		}
		delete(m.atts, c.Key)
		delete(m.goneSince, c.Key)
		m.freed++
		m.freedByReason[v.Reason]++
		m.freedByReason[rel.Reason]++
	}
	switch {
	case retry:
		m.queue = append(m.queue, f.name)
	case !recheck.IsZero():
		if t, ok := m.rechecks[f.name]; !ok || recheck.Before(t) {
			m.rechecks[f.name] = recheck
		}
	default:
		m.deletions.Forget(f.name, f.dels)
	}
}

// advance moves the clock; the API server creates every pod the runtime ran ahead of before its
// attachment is grace old, the runtime stops the sandboxes the agent cannot check within their
// grace of their pod's deletion (the contracts), and due rechecks enter the queue.
func (m *model) advance(d time.Duration) {
	to := m.now.Add(d)
	for _, a := range m.atts {
		if a.owner.state == unborn && !a.a.Created.Add(m.grace).After(to) {
			m.create(a.owner)
		}
	}
	for _, a := range m.atts {
		if !a.live || a.owner.state != gone {
			continue
		}
		if (a.sb == SandboxUnrecorded && !a.owner.goneAt.Add(m.timing.Grace).After(to)) ||
			(a.sb == SandboxUnknown && !a.owner.goneAt.Add(m.timing.SandboxGrace).After(to)) {
			a.live = false
		}
	}
	m.now = to
	for n, at := range m.rechecks {
		if !at.After(m.now) {
			m.queue = append(m.queue, n)
			delete(m.rechecks, n)
		}
	}
}

// settle ends the run: events are delivered, the API server answers, the cache tells the truth,
// the runtime stops every gone pod's sandbox, time passes the grace period, and the collector
// drains. Then every attachment whose pod is gone must be freed, except those it cannot or must
// not judge.
func (m *model) settle() {
	m.apiErrorRate = 0
	for _, a := range m.atts {
		a.a.Pending = false
		if a.owner.state == gone {
			a.live = false
		}
	}
	for _, d := range m.events {
		m.deliver(d)
	}
	m.events = nil
	m.advance(m.grace)
	m.cache = m.cache[:0]
	for _, p := range m.pods {
		if p.state == alive {
			m.cache = append(m.cache, p.ref)
		}
	}
	m.queue = append(m.queue, Sweep(m.snapshot(), NewCache(m.cache), m.now, m.grace)...)
	for len(m.queue) > 0 || len(m.flights) > 0 || len(m.rechecks) > 0 {
		for len(m.queue) > 0 {
			n := m.queue[0]
			m.queue = m.queue[1:]
			m.selectAndRead(n)
		}
		for len(m.flights) > 0 {
			f := m.flights[0]
			m.flights = m.flights[1:]
			m.apply(f)
		}
		if len(m.rechecks) > 0 {
			m.advance(m.grace)
			for _, a := range m.atts {
				if a.owner.state == gone {
					a.live = false // a pod the advance replaced (a StatefulSet's next pod)
				}
			}
		}
	}
	for _, a := range m.atts {
		if a.owner.state != gone {
			continue
		}
		n, named := NameOf(a.a.Pod)
		switch {
		case !named:
			// Only its pod's delete event (by UID) or CNI GC can free it.
		case a.a.Pod.UID == "" && m.aliveNamed(n) != nil:
			// No UID: never freed while a pod of its name exists.
		default:
			m.t.Fatalf("attachment %s of gone pod %+v was never freed", a.a.Key, a.owner.ref)
		}
	}
	if m.deletions.Len() != 0 {
		m.t.Fatalf("%d deletions still remembered after the collector drained", m.deletions.Len())
	}
}

func runModel(t *testing.T, seed uint64, steps int) *model {
	m := newModel(t, seed)
	for range steps {
		m.step()
	}
	m.settle()
	return m
}

// TestNeverFreesALivePod: across random interleavings, no attachment is freed while its pod exists
// or is yet to be created, and once the world settles every gone pod's attachment is freed.
func TestNeverFreesALivePod(t *testing.T) {
	freed, kept := 0, 0
	reasons, keptReasons := map[string]int{}, map[string]int{}
	for seed := range uint64(400) {
		m := runModel(t, seed, 600)
		freed += m.freed
		kept += m.kept
		for r, n := range m.freedByReason {
			reasons[r] += n
		}
		for r, n := range m.keptByReason {
			keptReasons[r] += n
		}
	}
	// The model must exercise both outcomes, both ways of being gone, every way a sandbox is
	// seen, and keep attachments whose pod is gone because their sandbox still runs.
	if freed < 1000 || kept < 1000 || reasons[ReasonNameReused] == 0 || reasons[ReasonPodGone] == 0 ||
		reasons[ReasonSandboxGone] == 0 || reasons[ReasonSandboxUnknownGrace] == 0 || reasons[ReasonUnrecordedGrace] == 0 ||
		keptReasons[ReasonSandboxExists] == 0 || keptReasons[ReasonWaiting] == 0 {
		t.Fatalf("weak model: freed %d (%v), kept %d (%v)", freed, reasons, kept, keptReasons)
	}
	t.Logf("freed %d (%v), kept %d (%v)", freed, reasons, kept, keptReasons)
}

func FuzzNeverFreesALivePod(f *testing.F) {
	f.Add(uint64(1), uint16(300))
	f.Add(uint64(42), uint16(2000))
	f.Fuzz(func(t *testing.T, seed uint64, steps uint16) {
		runModel(t, seed, int(steps))
	})
}
