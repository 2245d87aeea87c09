package previous

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/handback"
)

func TestOwnHostLocalContent(t *testing.T) {
	own := OwnHostLocalContent(" c1 ", "eth0")
	if own != "c1\r\neth0\r\n" || !IsOwnHostLocal(own) {
		t.Fatalf("OwnHostLocalContent = %q", own)
	}
	// host-local's own content (backend/disk: Reserve) is never ipwarden's, and host-local's
	// matching (the content trimmed) sees ipwarden's file as the container's own.
	if hl := handback.Content("c1", "eth0"); IsOwnHostLocal(hl) || hl != "c1\r\neth0" {
		t.Fatalf("host-local's content %q taken for ipwarden's", hl)
	}
	for _, c := range []string{"", "\r\n", "c1"} {
		if IsOwnHostLocal(c) {
			t.Fatalf("%q taken for ipwarden's", c)
		}
	}
}

func ip(s string) netip.Addr { return netip.MustParseAddr(s) }

// One rule: what a reservation does with each address, given host-local's files.
func TestPlanHostLocal(t *testing.T) {
	mine := OwnHostLocalContent("c1", "eth0")
	r := func(a string) Reservation {
		return Reservation{Addr: ip(a), ContainerID: "c1", IfName: "eth0", Pod: "default/p"}
	}
	adopted := Reservation{Addr: ip("10.0.0.9"), ContainerID: "c1", IfName: "eth0", Adopted: true}
	for _, tc := range []struct {
		name     string
		rs       []Reservation
		existing map[netip.Addr]string
		write    []string
		replace  []string
		taken    string
	}{
		{name: "no file: written", rs: []Reservation{r("10.0.0.5")}, write: []string{"10.0.0.5"}},
		{name: "ipwarden's file of the same attachment: kept", rs: []Reservation{r("10.0.0.5")},
			existing: map[netip.Addr]string{ip("10.0.0.5"): mine}},
		{name: "ipwarden's file of another attachment: replaced", rs: []Reservation{r("10.0.0.5")},
			existing: map[netip.Addr]string{ip("10.0.0.5"): OwnHostLocalContent("gone", "eth0")}, write: []string{"10.0.0.5"}, replace: []string{"10.0.0.5"}},
		{name: "host-local's own file: taken, nothing written", rs: []Reservation{r("10.0.0.5"), r("10.0.0.6")},
			existing: map[netip.Addr]string{ip("10.0.0.6"): "other\r\neth0"}, taken: "10.0.0.6"},
		{name: "host-local's file with the same container (no mark) is still host-local's", rs: []Reservation{r("10.0.0.5")},
			existing: map[netip.Addr]string{ip("10.0.0.5"): "c1\r\neth0"}, taken: "10.0.0.5"},
		{name: "an adopted address keeps host-local's file of the pod", rs: []Reservation{adopted},
			existing: map[netip.Addr]string{ip("10.0.0.9"): "old-sandbox\r\neth0"}},
		{name: "an adopted address without a file gets ipwarden's", rs: []Reservation{adopted}, write: []string{"10.0.0.9"}},
		{name: "other files are not looked at", rs: []Reservation{r("10.0.0.5")},
			existing: map[netip.Addr]string{ip("10.0.0.4"): "x\r\neth0"}, write: []string{"10.0.0.5"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := PlanHostLocal(tc.rs, tc.existing)
			var write, replace []string
			for _, f := range p.Write {
				write = append(write, f.Addr.String())
				if f.Content != mine {
					t.Fatalf("writes %q", f.Content)
				}
			}
			for _, a := range p.Replace {
				replace = append(replace, a.String())
			}
			if !slices.Equal(write, tc.write) || !slices.Equal(replace, tc.replace) || p.Taken.String() != mustSet(t, tc.taken).String() {
				t.Fatalf("PlanHostLocal = write %v replace %v taken %v; want %v %v %v", write, replace, p.Taken, tc.write, tc.replace, tc.taken)
			}
		})
	}
}

func TestHostLocalStale(t *testing.T) {
	freed := []Reservation{{Addr: ip("10.0.0.5"), ContainerID: "c1", IfName: "eth0"}, {Addr: ip("10.0.0.6"), ContainerID: "c1", IfName: "eth0"},
		{Addr: ip("10.0.0.7"), ContainerID: "c1", IfName: "eth0"}}
	existing := map[netip.Addr]string{
		ip("10.0.0.5"): OwnHostLocalContent("c1", "eth0"), // ipwarden's of the freed attachment: removed
		ip("10.0.0.6"): "other\r\neth0",                   // host-local gave it to another container since
		ip("10.0.0.7"): OwnHostLocalContent("c2", "eth0"), // ipwarden's of another attachment
	}
	if got := HostLocalStale(freed, existing); !slices.Equal(got, []netip.Addr{ip("10.0.0.5")}) {
		t.Fatalf("HostLocalStale = %v", got)
	}
}

// ReserveHostLocal and UnreserveHostLocal on a real directory, against host-local's own files and
// its lock.
func TestReserveHostLocal(t *testing.T) {
	ctx := context.Background()
	data := t.TempDir()
	dir := filepath.Join(data, "podnet")
	if err := ReserveHostLocal(ctx, filepath.Join(data, "nodata", "podnet"), []Reservation{{Addr: ip("10.0.0.5"), ContainerID: "c", IfName: "eth0"}}); err == nil {
		t.Fatal("a reservation under a dataDir the agent cannot see succeeded")
	}
	rs := []Reservation{{Addr: ip("10.0.0.5"), ContainerID: "c1", IfName: "eth0", Pod: "default/p"}}
	if err := ReserveHostLocal(ctx, dir, rs); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "10.0.0.5"))
	if err != nil || string(b) != "c1\r\neth0\r\n" {
		t.Fatalf("reservation file %q, %v", b, err)
	}
	// ipwarden's reading does not count its own file as host-local's.
	if got, err := ReadHostLocal(ctx, dir); err != nil || !got.IsEmpty() {
		t.Fatalf("ReadHostLocal = %v, %v; want none of host-local's", got, err)
	}
	// Again: kept.
	if err := ReserveHostLocal(ctx, dir, rs); err != nil {
		t.Fatal(err)
	}
	// host-local's own file: taken, nothing written.
	if err := os.WriteFile(filepath.Join(dir, "10.0.0.6"), []byte("hl\r\neth0"), 0o600); err != nil {
		t.Fatal(err)
	}
	err = ReserveHostLocal(ctx, dir, []Reservation{{Addr: ip("10.0.0.7"), ContainerID: "c2", IfName: "eth0"}, {Addr: ip("10.0.0.6"), ContainerID: "c2", IfName: "eth0"}})
	var taken *TakenError
	if !errors.As(err, &taken) || taken.Addrs.String() != "10.0.0.6" {
		t.Fatalf("reserving host-local's address: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "10.0.0.7")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused reservation wrote 10.0.0.7: %v", err)
	}
	// The lock: a reservation waits for host-local's, and gives up when its context ends.
	lf, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := ReserveHostLocal(tctx, dir, []Reservation{{Addr: ip("10.0.0.8"), ContainerID: "c3", IfName: "eth0"}}); err == nil {
		t.Fatal("a reservation ran while host-local held its lock")
	}
	if _, err := UnreserveHostLocal(tctx, dir, rs); err == nil {
		t.Fatal("a removal ran while host-local held its lock")
	}
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	// Freed: ipwarden's file goes, host-local's stays.
	removed, err := UnreserveHostLocal(ctx, dir, append(rs, Reservation{Addr: ip("10.0.0.6"), ContainerID: "c1", IfName: "eth0"}))
	if err != nil || !slices.Equal(removed, []netip.Addr{ip("10.0.0.5")}) {
		t.Fatalf("UnreserveHostLocal = %v, %v", removed, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "10.0.0.6")); err != nil {
		t.Fatalf("host-local's file went: %v", err)
	}
	if removed, err := UnreserveHostLocal(ctx, filepath.Join(data, "absent"), rs); err != nil || removed != nil {
		t.Fatalf("UnreserveHostLocal of a missing directory = %v, %v", removed, err)
	}
}

// One rule: what a reservation does in Whereabouts' IPPools, and what its release removes.
func TestPlanWhereabouts(t *testing.T) {
	pools := []WhereaboutsPool{
		{Name: "kube-system/10.0.0.0-24", Range: "10.0.0.0/24", Allocations: map[string]WhereaboutsAllocation{
			"5": {ID: "ipwarden:c1", PodRef: "default/p", IfName: "eth0"},
			"6": {ID: "wb-container", PodRef: "default/old", IfName: "eth0"},
			"7": {ID: "ipwarden:gone", PodRef: "default/gone", IfName: "eth0"},
		}},
		{Name: "kube-system/10.1.0.8-29", Range: "10.1.0.8/29"},
	}
	r := func(a string) Reservation {
		return Reservation{Addr: ip(a), ContainerID: "c1", IfName: "eth0", Pod: "default/p"}
	}
	mine := WhereaboutsAllocation{ID: "ipwarden:c1", PodRef: "default/p", IfName: "eth0"}
	for _, tc := range []struct {
		name  string
		rs    []Reservation
		edits []WhereaboutsEdit
		taken string
	}{
		{name: "a free offset: added", rs: []Reservation{r("10.0.0.9")},
			edits: []WhereaboutsEdit{{Pool: "kube-system/10.0.0.0-24", Add: map[string]WhereaboutsAllocation{"9": mine}}}},
		{name: "the offset counts from the range's address", rs: []Reservation{r("10.1.0.10")},
			edits: []WhereaboutsEdit{{Pool: "kube-system/10.1.0.8-29", Add: map[string]WhereaboutsAllocation{"2": mine}}}},
		{name: "ipwarden's allocation of the same container: kept", rs: []Reservation{r("10.0.0.5")}},
		{name: "ipwarden's allocation of another container: replaced", rs: []Reservation{r("10.0.0.7")},
			edits: []WhereaboutsEdit{{Pool: "kube-system/10.0.0.0-24", Add: map[string]WhereaboutsAllocation{"7": mine}}}},
		{name: "Whereabouts' own allocation: taken, no edit", rs: []Reservation{r("10.0.0.9"), r("10.0.0.6")}, taken: "10.0.0.6"},
		{name: "an adopted address keeps Whereabouts' allocation of the pod", rs: []Reservation{{Addr: ip("10.0.0.6"), ContainerID: "c1", IfName: "eth0", Adopted: true}}},
		{name: "outside every range: nothing", rs: []Reservation{r("10.2.0.1"), r("10.1.0.7")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			edits, taken, err := PlanWhereabouts(tc.rs, pools)
			if err != nil || !reflect.DeepEqual(edits, tc.edits) || taken.String() != mustSet(t, tc.taken).String() {
				t.Fatalf("PlanWhereabouts = %+v, %v, %v; want %+v, %v", edits, taken, err, tc.edits, tc.taken)
			}
		})
	}
	if _, _, err := PlanWhereabouts([]Reservation{r("10.0.0.1")}, []WhereaboutsPool{{Name: "x", Range: "bad"}}); err == nil {
		t.Fatal("a pool with a bad range was planned over")
	}
	edits, err := PlanWhereaboutsRelease([]Reservation{r("10.0.0.5"), r("10.0.0.6"), r("10.0.0.7"), r("10.1.0.10")}, pools)
	if want := []WhereaboutsEdit{{Pool: "kube-system/10.0.0.0-24", Remove: []string{"5"}}}; err != nil || !reflect.DeepEqual(edits, want) {
		t.Fatalf("PlanWhereaboutsRelease = %+v, %v; want %+v", edits, err, want)
	}
}

// A reading with what earlier readings found opens only new files, and forgets names gone.
func TestReadHostLocalKnown(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "podnet")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("10.0.0.5", "hl\r\neth0")
	write("10.0.0.6", OwnHostLocalContent("c1", "eth0"))
	known := map[string]bool{}
	got, err := ReadHostLocalKnown(ctx, dir, known)
	if err != nil || got.String() != "10.0.0.5" || !reflect.DeepEqual(known, map[string]bool{"10.0.0.5": false, "10.0.0.6": true}) {
		t.Fatalf("ReadHostLocalKnown = %v, %v, known %v", got, err, known)
	}
	// A known name is not read again (its content here changed behind the reading's back: the
	// reservation, not the reading, is the word on a picked address).
	write("10.0.0.6", "hl2\r\neth0")
	if err := os.Remove(filepath.Join(dir, "10.0.0.5")); err != nil {
		t.Fatal(err)
	}
	write("10.0.0.7", "hl3\r\neth0")
	got, err = ReadHostLocalKnown(ctx, dir, known)
	if err != nil || got.String() != "10.0.0.7" || !reflect.DeepEqual(known, map[string]bool{"10.0.0.6": true, "10.0.0.7": false}) {
		t.Fatalf("ReadHostLocalKnown = %v, %v, known %v", got, err, known)
	}
}
