// Package gc holds the pure decisions of the node agent's leak collector: which of the node's
// attachments may belong to a pod that is gone, and whether the API server's fresh answer lets
// the agent free one. It does no IO and reads no clock; the agent's Collector (the imperative
// shell) feeds it the journal's attachments, the informer cache's pods, the pod deletions it saw
// and one API read per pod name, and frees what Judge says through the same path as CNI DEL.
//
// # Three ways in
//
//   - Event path: a pod bound to the node is deleted (a delete event or a tombstone). Select for
//     that pod's name makes every attachment recorded for the deleted pod UID a candidate, at any
//     age: a UID is never reused, so the deletion is final.
//   - Full check (every --gc-full-check-interval): Sweep names the pods whose attachments are
//     older than the grace period and whose pod the informer cache does not show; Select then
//     picks those attachments again when the name's turn comes.
//   - CNI GC: the runtime lists the attachments that still exist (ipam.State.Stale); the pod
//     objects play no part there, since a live pod's old sandbox is exactly what it collects.
//
// # Matching
//
// An attachment belongs to a pod by UID (CNI_ARGS K8S_POD_UID). A StatefulSet reuses names, so a
// name never proves that an attachment's pod still exists, and a new pod under an old name never
// keeps the old pod's attachment. When the runtime did not pass a UID the attachment is matched by
// namespace and name only, and is never freed while any pod of that name exists. An attachment
// with no namespace and name cannot be looked up; only its pod's delete event (by UID) or CNI GC
// frees it.
//
// # Why nothing live is freed
//
// The informer cache only decides what is worth a look; it may lag, lose events or show a pod
// that is gone, and none of that can free an address. A candidate is freed only on a fresh read
// of the API server (a quorum read of the pod by name, taken after the attachment was selected):
//
//  1. Judge frees an attachment with a UID only if that read shows no pod of its name, or a pod
//     with another UID. The attachment's pod existed by then: either the agent saw its deletion,
//     or the attachment is older than the grace period, within which a pod exists in the API
//     server once the runtime has asked for its address. A pod that existed and no longer does is
//     gone for good (UIDs are never reused), so the free stays right after the read.
//  2. Judge frees an attachment without a UID only if the read shows no pod of its name at all,
//     and Select only picks it once it is older than the grace period, so its pod has existed and
//     is now gone. A later pod of the same name makes its own attachment.
//  3. An API error, or an answer about another name, keeps the attachment (retried later).
//  4. The shell frees by key and only if the attachment is still the one selected (same pod,
//     same creation time) and not in flight, so an ADD racing the collector is never undone.
//
// # When a pod is gone but its sandbox may not be
//
// A deleted Pod object is not a stopped sandbox: after a force delete the kubelet may take
// seconds, or minutes if it is down, to stop the sandbox and call DEL. So once Judge says the
// pod is gone, Decide frees the attachment only when its sandbox is provably gone too, or after a
// grace period counted from when the API server first showed the pod gone:
//
//   - the network namespace path recorded at ADD no longer exists (SandboxGone): free now;
//   - it still exists (SandboxExists): never freed by the collector; the runtime's DEL (or its CNI
//     GC, or the namespace's removal) frees it. A namespace that outlives its pod by
//     --gc-sandbox-grace is itself a leak, and is reported (Outlived), not freed: freeing it
//     would hand its address to a second pod while the first sandbox still uses it;
//   - the agent cannot tell (SandboxUnknown: a path outside the namespace directories it sees,
//     such as /proc/<pid>/ns/net, a directory not mounted into the agent's container, a
//     permission error): treated as "may still exist" for --gc-sandbox-grace (default 10m), then
//     freed, so a node whose agent lacks the mount still gets its addresses back;
//   - no path was recorded (SandboxUnrecorded: a journal written before the agent kept it, or a
//     rebuilt attachment): freed --gc-grace after the pod was gone, as before.
//
// The property test in this package drives these functions through random interleavings of pod
// creation and deletion, name reuse, early ADDs, lagging and lossy caches, missed, late and
// duplicated events and API errors, with a truthful API server, and checks that no attachment is
// ever freed while its pod exists or is yet to be created.
package gc

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// Name is a pod's namespace and name: what the collector reads from the API server.
type Name struct {
	Namespace string
	Name      string
}

// String returns "namespace/name".
func (n Name) String() string { return n.Namespace + "/" + n.Name }

// NameOf returns the name of the pod p refers to, and false when its namespace or name is
// unknown (such a pod cannot be looked up).
func NameOf(p ipam.PodRef) (Name, bool) {
	if p.Namespace == "" || p.Name == "" {
		return Name{}, false
	}
	return Name{Namespace: p.Namespace, Name: p.Name}, true
}

// Attachment is what the collector needs of one attachment of the node's journal.
type Attachment struct {
	Key ipam.Key
	// Pod is the pod the runtime named in the ADD; any field may be empty.
	Pod ipam.PodRef
	// Created is when the ADD was recorded.
	Created time.Time
	// Pending is set while the attachment's ADD is still being journaled: never a candidate.
	Pending bool
	// Netns is the network namespace path the runtime passed in CNI_NETNS at ADD; empty for
	// attachments recorded before the agent kept it, and for rebuilt ones.
	Netns string
}

// Same reports whether a and b are the same recorded attachment (not just the same key).
func (a Attachment) Same(b Attachment) bool {
	return a.Key == b.Key && a.Pod == b.Pod && a.Created.Equal(b.Created)
}

// Deletion is a pod deletion the agent saw in its pod informer (a delete event or a tombstone).
type Deletion struct {
	// Pod is the deleted pod: namespace, name and UID.
	Pod ipam.PodRef
	// At is the pod's deletionTimestamp, or when the agent saw the deletion if it had none.
	At time.Time
}

// Cache is what the agent's informer cache shows of the pods bound to the node. It may lag the
// API server and miss or keep pods; it only narrows what is worth a read of the API server.
type Cache struct {
	uids  map[string]bool
	names map[Name]bool
}

// NewCache indexes pods by UID and by name.
func NewCache(pods []ipam.PodRef) Cache {
	c := Cache{uids: make(map[string]bool, len(pods)), names: make(map[Name]bool, len(pods))}
	for _, p := range pods {
		if p.UID != "" {
			c.uids[p.UID] = true
		}
		if n, ok := NameOf(p); ok {
			c.names[n] = true
		}
	}
	return c
}

// shows reports whether the cache shows the pod an attachment names: by UID when it has one,
// else by name.
func (c Cache) shows(p ipam.PodRef) bool {
	if p.UID != "" {
		return c.uids[p.UID]
	}
	n, ok := NameOf(p)
	return ok && c.names[n]
}

// old reports whether a is at least grace old at now.
func old(a Attachment, now time.Time, grace time.Duration) bool { return now.Sub(a.Created) >= grace }

// orphan reports whether a is a full-check candidate: not in flight, at least grace old, and its
// pod is not in the cache.
func orphan(a Attachment, c Cache, now time.Time, grace time.Duration) bool {
	return !a.Pending && old(a, now, grace) && !c.shows(a.Pod)
}

// Sweep is the periodic full check: the names of the pods whose attachments are at least grace
// old and whose pod the cache does not show, sorted. Attachments without a pod name are left to
// their pod's delete event and to CNI GC.
func Sweep(atts []Attachment, cache Cache, now time.Time, grace time.Duration) []Name {
	seen := map[Name]bool{}
	var out []Name
	for _, a := range atts {
		n, ok := NameOf(a.Pod)
		if !ok || seen[n] || !orphan(a, cache, now, grace) {
			continue
		}
		seen[n] = true
		out = append(out, n)
	}
	slices.SortFunc(out, func(a, b Name) int { return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name)) })
	return out
}

// Candidate is an attachment to check against the API server.
type Candidate struct {
	Attachment
	// Deletion is the deletion the agent saw for the attachment's pod (by UID; for an attachment
	// without a UID, the latest deletion of its name), or nil when it came from the full check.
	Deletion *Deletion
}

// Selection is what Select decided for one pod name.
type Selection struct {
	// Candidates are the attachments to check against the API server now, sorted by key.
	Candidates []Candidate
	// RecheckAt, when not zero, is when an attachment without a UID of a deleted pod's name
	// leaves the grace period and should be looked at again.
	RecheckAt time.Time
}

// PendingRecheck is how soon Select looks again at a deleted pod's attachment that was in flight
// (its journal write takes about a millisecond).
const PendingRecheck = 200 * time.Millisecond

// Select picks the attachments to check for pod name n at now:
//
//   - every attachment whose pod UID is among the deletions of pods named n, at any age;
//   - every attachment of pod name n that is at least grace old and whose pod the cache does not
//     show (by UID, or by name when it has no UID).
//
// In-flight attachments are never picked; one of a deleted pod sets RecheckAt to PendingRecheck
// from now. An attachment of name n without a UID that is still in its grace period while a
// deletion of that name is known sets RecheckAt to the end of it.
func Select(n Name, atts []Attachment, cache Cache, deletions []Deletion, now time.Time, grace time.Duration) Selection {
	byUID := map[string]*Deletion{}
	var latest *Deletion
	for i := range deletions {
		d := &deletions[i]
		if dn, ok := NameOf(d.Pod); !ok || dn != n || d.Pod.UID == "" {
			continue
		}
		byUID[d.Pod.UID] = d
		if latest == nil || d.At.After(latest.At) {
			latest = d
		}
	}
	var sel Selection
	for _, a := range atts {
		if a.Pending {
			// In flight (an ADD, or an adoption from the pod's status, being journaled): never a
			// candidate now. But a deletion of its pod must not be forgotten: an adopted
			// attachment gets no DEL, so it would stay until the full check. Look again once
			// the write has landed.
			an, named := NameOf(a.Pod)
			if (a.Pod.UID != "" && byUID[a.Pod.UID] != nil) || (a.Pod.UID == "" && named && an == n && latest != nil) {
				if t := now.Add(PendingRecheck); sel.RecheckAt.IsZero() || t.Before(sel.RecheckAt) {
					sel.RecheckAt = t
				}
			}
			continue
		}
		if d := byUID[a.Pod.UID]; a.Pod.UID != "" && d != nil {
			sel.Candidates = append(sel.Candidates, Candidate{Attachment: a, Deletion: clone(d)})
			continue
		}
		if an, ok := NameOf(a.Pod); !ok || an != n {
			continue
		}
		if orphan(a, cache, now, grace) {
			c := Candidate{Attachment: a}
			if a.Pod.UID == "" {
				c.Deletion = clone(latest)
			}
			sel.Candidates = append(sel.Candidates, c)
			continue
		}
		if a.Pod.UID == "" && latest != nil && !old(a, now, grace) {
			if t := a.Created.Add(grace); sel.RecheckAt.IsZero() || t.Before(sel.RecheckAt) {
				sel.RecheckAt = t
			}
		}
	}
	slices.SortFunc(sel.Candidates, func(a, b Candidate) int {
		return cmp.Or(cmp.Compare(a.Key.ContainerID, b.Key.ContainerID), cmp.Compare(a.Key.IfName, b.Key.IfName))
	})
	return sel
}

func clone(d *Deletion) *Deletion {
	if d == nil {
		return nil
	}
	c := *d
	return &c
}

// Lookup is the API server's fresh answer for one pod name (a read of the API server, never of
// a cache).
type Lookup struct {
	Name Name
	// Found is set when a pod of that name exists; UID is its UID.
	Found bool
	UID   string
	// Err is set when the API server gave no definite answer; Found and UID mean nothing then.
	Err error
}

// Reasons of a Verdict.
const (
	// ReasonPodGone: no pod of the attachment's name exists.
	ReasonPodGone = "pod-gone"
	// ReasonNameReused: a pod of the attachment's name exists with another UID (a StatefulSet's
	// next pod); the attachment's own pod is gone.
	ReasonNameReused = "name-reused"
	// ReasonPodExists: the attachment's pod exists (same UID, or any pod of its name when the
	// attachment has no UID).
	ReasonPodExists = "pod-exists"
	// ReasonAPIError: the API server gave no definite answer; retried later.
	ReasonAPIError = "api-error"
	// ReasonOtherName: the answer is about another pod name than the attachment's; kept.
	ReasonOtherName = "other-name"
)

// Verdict says whether to free a candidate, and why.
type Verdict struct {
	Free   bool
	Reason string
}

// Judge decides, from the API server's fresh answer l, whether the attachment of pod owner may be
// freed: only when the answer is definite, about the owner's name (if it has one), and shows that
// the owner is gone (see the package documentation).
func Judge(owner ipam.PodRef, l Lookup) Verdict {
	if l.Err != nil {
		return Verdict{Reason: ReasonAPIError}
	}
	n, named := NameOf(owner)
	if named && n != l.Name {
		return Verdict{Reason: ReasonOtherName}
	}
	if owner.UID == "" {
		if !named {
			return Verdict{Reason: ReasonOtherName}
		}
		if l.Found {
			return Verdict{Reason: ReasonPodExists}
		}
		return Verdict{Free: true, Reason: ReasonPodGone}
	}
	switch {
	case !l.Found:
		return Verdict{Free: true, Reason: ReasonPodGone}
	case l.UID == owner.UID:
		return Verdict{Reason: ReasonPodExists}
	case l.UID == "":
		// A pod without a UID is not a real answer: never free on it.
		return Verdict{Reason: ReasonAPIError}
	default:
		return Verdict{Free: true, Reason: ReasonNameReused}
	}
}

// Sandbox is what the agent can tell about an attachment's sandbox from the network namespace
// path the runtime passed in CNI_NETNS at ADD.
type Sandbox int

// Sandbox states.
const (
	// SandboxUnrecorded: no path was recorded.
	SandboxUnrecorded Sandbox = iota
	// SandboxGone: the path does not exist in a namespace directory the agent sees.
	SandboxGone
	// SandboxExists: the path exists.
	SandboxExists
	// SandboxUnknown: the agent cannot tell; treated as "may still exist".
	SandboxUnknown
)

func (s Sandbox) String() string {
	switch s {
	case SandboxUnrecorded:
		return "unrecorded"
	case SandboxGone:
		return "gone"
	case SandboxExists:
		return "exists"
	case SandboxUnknown:
		return "unknown"
	}
	return fmt.Sprintf("Sandbox(%d)", int(s))
}

// NetnsDir returns the directory among dirs that directly contains the network namespace path
// netns, and false when there is none: the agent can check only a path it sees, and runtimes put
// a pod's namespace directly under /var/run/netns (containerd: cni-<uuid>; CRI-O: <uuid>). A
// relative path, one with "..", or one below a subdirectory is not checkable.
func NetnsDir(netns string, dirs []string) (string, bool) {
	if netns == "" || !filepath.IsAbs(netns) || filepath.Clean(netns) != netns {
		return "", false
	}
	parent := filepath.Dir(netns)
	for _, d := range dirs {
		if d != "" && filepath.Clean(d) == parent {
			return parent, true
		}
	}
	return "", false
}

// ClassifySandbox turns what the agent saw into a Sandbox: netns is the recorded path, checkable
// whether NetnsDir found its directory, dirErr the result of reading that directory (an error
// means it is not there, e.g. not mounted into the agent's container) and pathErr the result of
// reading the path itself. Only a definite "does not exist" inside a directory that exists is
// SandboxGone; every other failure is SandboxUnknown.
func ClassifySandbox(netns string, checkable bool, dirErr, pathErr error) Sandbox {
	switch {
	case netns == "":
		return SandboxUnrecorded
	case !checkable || dirErr != nil:
		return SandboxUnknown
	case pathErr == nil:
		return SandboxExists
	case errors.Is(pathErr, fs.ErrNotExist):
		return SandboxGone
	}
	return SandboxUnknown
}

// Timing holds the collector's waits for pods that are gone.
type Timing struct {
	// Grace: how long after its pod is gone an attachment without a recorded namespace is
	// freed (--gc-grace).
	Grace time.Duration
	// SandboxGrace: how long after its pod is gone an attachment whose namespace the agent
	// cannot check is freed, and after which a namespace that still exists is reported
	// (--gc-sandbox-grace).
	SandboxGrace time.Duration
	// Poll: how often a namespace that still exists is looked at again; after SandboxGrace,
	// every SlowPoll.
	Poll, SlowPoll time.Duration
}

// Reasons of a Release.
const (
	// ReasonSandboxGone: the pod and its network namespace are gone.
	ReasonSandboxGone = "sandbox-gone"
	// ReasonSandboxExists: the pod is gone but its network namespace still exists; kept.
	ReasonSandboxExists = "sandbox-exists"
	// ReasonSandboxUnknownGrace: the agent cannot check the namespace, and SandboxGrace has
	// passed since the pod was gone.
	ReasonSandboxUnknownGrace = "sandbox-unknown-grace-elapsed"
	// ReasonUnrecordedGrace: no namespace was recorded, and Grace has passed since the pod was
	// gone.
	ReasonUnrecordedGrace = "no-netns-grace-elapsed"
	// ReasonWaiting: within the wait; look again at RecheckAt.
	ReasonWaiting = "waiting"
)

// Release is Decide's answer for a candidate whose pod the API server shows gone.
type Release struct {
	Free   bool
	Reason string
	// RecheckAt, when not zero, is when to look again (the candidate was kept).
	RecheckAt time.Time
	// Outlived is set when the namespace still exists SandboxGrace after the pod was gone: a
	// sandbox the runtime did not stop, to report.
	Outlived bool
}

// Decide says whether to free, at now, an attachment whose pod Judge showed gone since goneSince
// (when the API server first showed it gone, which is never before the true deletion), given
// what the agent can tell of its sandbox (see the package documentation).
func Decide(sb Sandbox, goneSince, now time.Time, t Timing) Release {
	gone := now.Sub(goneSince)
	switch sb {
	case SandboxGone:
		return Release{Free: true, Reason: ReasonSandboxGone}
	case SandboxExists:
		r := Release{Reason: ReasonSandboxExists, RecheckAt: now.Add(t.Poll)}
		if gone >= t.SandboxGrace {
			r.Outlived = true
			r.RecheckAt = now.Add(max(t.Poll, t.SlowPoll))
		}
		return r
	case SandboxUnknown:
		if gone >= t.SandboxGrace {
			return Release{Free: true, Reason: ReasonSandboxUnknownGrace}
		}
		return Release{Reason: ReasonWaiting, RecheckAt: goneSince.Add(t.SandboxGrace)}
	default:
		if gone >= t.Grace {
			return Release{Free: true, Reason: ReasonUnrecordedGrace}
		}
		return Release{Reason: ReasonWaiting, RecheckAt: goneSince.Add(t.Grace)}
	}
}

// Deletions remembers the pod deletions the agent saw and has not finished collecting, by pod
// name. The zero value is ready to use; it is not safe for concurrent use.
type Deletions struct {
	m map[Name][]Deletion
}

// Add records d and reports whether it did: a deletion without a namespace, name or UID is
// useless to the collector and dropped. A repeated deletion of one UID keeps the earliest time.
func (ds *Deletions) Add(d Deletion) bool {
	n, ok := NameOf(d.Pod)
	if !ok || d.Pod.UID == "" {
		return false
	}
	if ds.m == nil {
		ds.m = map[Name][]Deletion{}
	}
	for i, e := range ds.m[n] {
		if e.Pod.UID == d.Pod.UID {
			if d.At.Before(e.At) {
				ds.m[n][i].At = d.At
			}
			return true
		}
	}
	ds.m[n] = append(ds.m[n], d)
	return true
}

// Of returns a copy of the deletions of pods named n.
func (ds *Deletions) Of(n Name) []Deletion { return slices.Clone(ds.m[n]) }

// Forget drops the deletions of pods named n whose UIDs are in done (those a finished pass
// handled); deletions added since stay.
func (ds *Deletions) Forget(n Name, done []Deletion) {
	left := slices.DeleteFunc(ds.m[n], func(e Deletion) bool {
		return slices.ContainsFunc(done, func(d Deletion) bool { return d.Pod.UID == e.Pod.UID })
	})
	if len(left) == 0 {
		delete(ds.m, n)
		return
	}
	ds.m[n] = left
}

// Len returns the number of deletions remembered.
func (ds *Deletions) Len() int {
	n := 0
	for _, v := range ds.m {
		n += len(v)
	}
	return n
}
