package gc

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

var t0 = time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)

const grace = time.Minute

func att(cid, ns, name, uid string, age time.Duration) Attachment {
	return Attachment{Key: ipam.Key{ContainerID: cid, IfName: "eth0"}, Pod: ipam.PodRef{Namespace: ns, Name: name, UID: uid},
		Created: t0.Add(-age)}
}

func ref(ns, name, uid string) ipam.PodRef { return ipam.PodRef{Namespace: ns, Name: name, UID: uid} }

func keys(cs []Candidate) string {
	var out []string
	for _, c := range cs {
		out = append(out, c.Key.ContainerID)
	}
	return strings.Join(out, ",")
}

func TestSweep(t *testing.T) {
	pending := att("pending", "ns", "gone", "u-gone", time.Hour)
	pending.Pending = true
	atts := []Attachment{
		att("live", "ns", "web", "u-web", time.Hour),            // pod cached by UID
		att("gone", "ns", "db", "u-db-old", time.Hour),          // UID not cached, though the name is (reused)
		att("young", "ns", "new", "u-new", 10*time.Second),      // within the grace period
		att("edge", "ns", "edge", "u-edge", grace),              // exactly grace old: a candidate
		att("noid-live", "ns", "cache", "", time.Hour),          // no UID, name cached
		att("noid-gone", "ns", "x", "", time.Hour),              // no UID, name not cached
		att("noname", "", "", "u-noname", time.Hour),            // cannot be looked up
		att("nons", "", "lonely", "u-nons", time.Hour),          // no namespace: cannot be looked up
		att("gone2", "ns", "db", "u-db-older", 2*time.Hour),     // second attachment of a name: one entry
		att("other-ns", "kube-system", "db", "u-ks", time.Hour), // same name, other namespace
		pending,
	}
	cache := NewCache([]ipam.PodRef{ref("ns", "web", "u-web"), ref("ns", "db", "u-db-new"), ref("ns", "cache", "u-c")})
	got := Sweep(atts, cache, t0, grace)
	var names []string
	for _, n := range got {
		names = append(names, n.String())
	}
	if want := "kube-system/db,ns/db,ns/edge,ns/x"; strings.Join(names, ",") != want {
		t.Fatalf("Sweep = %v, want %s", names, want)
	}
	if got := Sweep(atts, cache, t0, 3*time.Hour); len(got) != 0 {
		t.Fatalf("with a grace longer than every attachment's age: %v", got)
	}
}

func TestSelect(t *testing.T) {
	web := Name{"ns", "web"}
	del := func(uid string, at time.Time) Deletion { return Deletion{Pod: ref("ns", "web", uid), At: at} }
	pendingDel := att("pending", "ns", "web", "u1", time.Hour)
	pendingDel.Pending = true
	tests := []struct {
		name      string
		atts      []Attachment
		cache     []ipam.PodRef
		dels      []Deletion
		want      string
		recheckAt time.Time
	}{
		{name: "deleted UID, young: freed at once (the event path needs no grace)",
			atts: []Attachment{att("a", "ns", "web", "u1", time.Second)}, dels: []Deletion{del("u1", t0)}, want: "a"},
		{name: "deleted UID although the stale cache still shows it",
			atts: []Attachment{att("a", "ns", "web", "u1", time.Second)}, cache: []ipam.PodRef{ref("ns", "web", "u1")},
			dels: []Deletion{del("u1", t0)}, want: "a"},
		{name: "StatefulSet: the new pod's young attachment is not a candidate",
			atts: []Attachment{att("old", "ns", "web", "u1", time.Hour), att("new", "ns", "web", "u2", time.Second)},
			dels: []Deletion{del("u1", t0)}, want: "old"},
		{name: "StatefulSet: the new pod's old attachment is a candidate only if the cache lacks it",
			atts:  []Attachment{att("old", "ns", "web", "u1", time.Hour), att("new", "ns", "web", "u2", time.Hour)},
			cache: []ipam.PodRef{ref("ns", "web", "u2")}, dels: []Deletion{del("u1", t0)}, want: "old"},
		{name: "deleted UID recorded without a name",
			atts: []Attachment{att("a", "", "", "u1", time.Second)}, dels: []Deletion{del("u1", t0)}, want: "a"},
		{name: "in flight: never, but looked at again soon (an adoption journaled after the deletion gets no DEL)",
			atts: []Attachment{pendingDel}, dels: []Deletion{del("u1", t0)}, want: "", recheckAt: t0.Add(PendingRecheck)},
		{name: "in flight without a deletion of its pod: not looked at again",
			atts: []Attachment{pendingDel}, dels: []Deletion{del("u9", t0)}, want: ""},
		{name: "no deletion, old, not cached: full-check candidate",
			atts: []Attachment{att("a", "ns", "web", "u1", time.Hour)}, want: "a"},
		{name: "no deletion, old, cached: kept without asking the API",
			atts: []Attachment{att("a", "ns", "web", "u1", time.Hour)}, cache: []ipam.PodRef{ref("ns", "web", "u1")}, want: ""},
		{name: "no deletion, young, not cached: the pod may not be in the cache yet",
			atts: []Attachment{att("a", "ns", "web", "u1", grace-time.Nanosecond)}, want: ""},
		{name: "other names are not this pass's business",
			atts: []Attachment{att("a", "ns", "db", "u9", time.Hour), att("b", "other", "web", "u8", time.Hour)}, want: ""},
		{name: "no UID, old, name not cached",
			atts: []Attachment{att("a", "ns", "web", "", time.Hour)}, dels: []Deletion{del("u1", t0)}, want: "a"},
		{name: "no UID, old, a pod of that name is cached",
			atts: []Attachment{att("a", "ns", "web", "", time.Hour)}, cache: []ipam.PodRef{ref("ns", "web", "u2")},
			dels: []Deletion{del("u1", t0)}, want: ""},
		{name: "no UID, young, a deletion of its name: look again when the grace ends",
			atts: []Attachment{att("a", "ns", "web", "", 10*time.Second), att("b", "ns", "web", "", 20*time.Second)},
			dels: []Deletion{del("u1", t0)}, want: "", recheckAt: t0.Add(grace - 20*time.Second)},
		{name: "no UID, young, no deletion: the full check looks later",
			atts: []Attachment{att("a", "ns", "web", "", 10*time.Second)}, want: ""},
		{name: "a deletion of another name does not match by UID",
			atts: []Attachment{att("a", "ns", "web", "u1", time.Second)}, dels: []Deletion{{Pod: ref("ns", "db", "u1"), At: t0}}, want: ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sel := Select(web, tc.atts, NewCache(tc.cache), tc.dels, t0, grace)
			if got := keys(sel.Candidates); got != tc.want {
				t.Errorf("candidates %q, want %q", got, tc.want)
			}
			if !sel.RecheckAt.Equal(tc.recheckAt) {
				t.Errorf("RecheckAt %v, want %v", sel.RecheckAt, tc.recheckAt)
			}
		})
	}
}

func TestSelectCarriesTheDeletion(t *testing.T) {
	web := Name{"ns", "web"}
	dels := []Deletion{{Pod: ref("ns", "web", "u1"), At: t0.Add(-time.Minute)}, {Pod: ref("ns", "web", "u2"), At: t0}}
	atts := []Attachment{att("a", "ns", "web", "u1", time.Hour), att("b", "ns", "web", "", time.Hour), att("c", "ns", "web", "u3", time.Hour)}
	sel := Select(web, atts, NewCache(nil), dels, t0, grace)
	if len(sel.Candidates) != 3 {
		t.Fatalf("candidates %s", keys(sel.Candidates))
	}
	if d := sel.Candidates[0].Deletion; d == nil || d.Pod.UID != "u1" {
		t.Errorf("a: deletion %+v, want u1's", d)
	}
	if d := sel.Candidates[1].Deletion; d == nil || d.Pod.UID != "u2" {
		t.Errorf("b (no UID): deletion %+v, want the latest of its name (u2)", d)
	}
	if d := sel.Candidates[2].Deletion; d != nil {
		t.Errorf("c (full-check candidate): deletion %+v, want none", d)
	}
}

func TestJudge(t *testing.T) {
	web := Name{"ns", "web"}
	apiDown := errors.New("connection refused")
	tests := []struct {
		owner ipam.PodRef
		l     Lookup
		want  Verdict
	}{
		{ref("ns", "web", "u1"), Lookup{Name: web}, Verdict{true, ReasonPodGone}},
		{ref("ns", "web", "u1"), Lookup{Name: web, Found: true, UID: "u1"}, Verdict{false, ReasonPodExists}},
		{ref("ns", "web", "u1"), Lookup{Name: web, Found: true, UID: "u2"}, Verdict{true, ReasonNameReused}},
		{ref("ns", "web", "u1"), Lookup{Name: web, Err: apiDown}, Verdict{false, ReasonAPIError}},
		{ref("ns", "web", "u1"), Lookup{Name: web, Found: true, Err: apiDown}, Verdict{false, ReasonAPIError}},
		{ref("ns", "web", "u1"), Lookup{Name: web, Found: true}, Verdict{false, ReasonAPIError}},
		{ref("ns", "web", "u1"), Lookup{Name: Name{"ns", "db"}}, Verdict{false, ReasonOtherName}},
		{ref("ns", "web", ""), Lookup{Name: web}, Verdict{true, ReasonPodGone}},
		{ref("ns", "web", ""), Lookup{Name: web, Found: true, UID: "u7"}, Verdict{false, ReasonPodExists}},
		{ref("ns", "web", ""), Lookup{Name: web, Err: apiDown}, Verdict{false, ReasonAPIError}},
		{ref("ns", "web", ""), Lookup{Name: Name{"ns", "db"}}, Verdict{false, ReasonOtherName}},
		{ref("", "", "u1"), Lookup{Name: web}, Verdict{true, ReasonPodGone}},
		{ref("", "", "u1"), Lookup{Name: web, Found: true, UID: "u1"}, Verdict{false, ReasonPodExists}},
		{ref("", "", ""), Lookup{Name: web}, Verdict{false, ReasonOtherName}},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%+v/%+v", tc.owner, tc.l), func(t *testing.T) {
			if got := Judge(tc.owner, tc.l); got != tc.want {
				t.Errorf("Judge = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestDeletions(t *testing.T) {
	var ds Deletions
	if ds.Add(Deletion{Pod: ref("ns", "web", "")}) || ds.Add(Deletion{Pod: ref("", "web", "u")}) {
		t.Fatal("added a deletion without a UID or namespace")
	}
	web := Name{"ns", "web"}
	ds.Add(Deletion{Pod: ref("ns", "web", "u1"), At: t0})
	ds.Add(Deletion{Pod: ref("ns", "web", "u1"), At: t0.Add(-time.Second)}) // duplicate, earlier
	ds.Add(Deletion{Pod: ref("ns", "web", "u1"), At: t0.Add(time.Second)})  // duplicate, later
	ds.Add(Deletion{Pod: ref("ns", "web", "u2"), At: t0})
	ds.Add(Deletion{Pod: ref("ns", "db", "u3"), At: t0})
	got := ds.Of(web)
	if len(got) != 2 || !got[0].At.Equal(t0.Add(-time.Second)) || ds.Len() != 3 {
		t.Fatalf("Of = %+v, Len %d", got, ds.Len())
	}
	ds.Add(Deletion{Pod: ref("ns", "web", "u4"), At: t0}) // arrives while a pass runs
	ds.Forget(web, got)
	if left := ds.Of(web); len(left) != 1 || left[0].Pod.UID != "u4" {
		t.Fatalf("after Forget: %+v", left)
	}
	ds.Forget(web, ds.Of(web))
	ds.Forget(Name{"ns", "db"}, ds.Of(Name{"ns", "db"}))
	if ds.Len() != 0 || len(ds.m) != 0 {
		t.Fatalf("left %+v", ds.m)
	}
}
