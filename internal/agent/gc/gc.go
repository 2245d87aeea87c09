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
// The property test in this package drives these functions through random interleavings of pod
// creation and deletion, name reuse, early ADDs, lagging and lossy caches, missed, late and
// duplicated events and API errors, with a truthful API server, and checks that no attachment is
// ever freed while its pod exists or is yet to be created.
package gc

import (
	"cmp"
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

// Select picks the attachments to check for pod name n at now:
//
//   - every attachment whose pod UID is among the deletions of pods named n, at any age;
//   - every attachment of pod name n that is at least grace old and whose pod the cache does not
//     show (by UID, or by name when it has no UID).
//
// In-flight attachments are never picked. An attachment of name n without a UID that is still
// in its grace period while a deletion of that name is known sets RecheckAt to the end of it.
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
