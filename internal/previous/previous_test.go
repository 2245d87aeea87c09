package previous

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name, raw, network string
		want               Source
		err                string
	}{
		{name: "host-local default dataDir", raw: `{"type": "host-local", "ranges": [[{"subnet": "10.0.0.0/24"}]]}`, network: "podnet",
			want: Source{Kind: HostLocal, Type: "host-local", DataDir: DefaultHostLocalDataDir, Dir: "/var/lib/cni/networks/podnet"}},
		{name: "host-local dataDir", raw: `{"type": "host-local", "dataDir": "/data/hl/"}`, network: "containerd-net",
			want: Source{Kind: HostLocal, Type: "host-local", DataDir: "/data/hl/", Dir: "/data/hl/containerd-net"}},
		{name: "host-local relative dataDir", raw: `{"type": "host-local", "dataDir": "data"}`, network: "n", err: "not an absolute path"},
		{name: "host-local network with a slash", raw: `{"type": "host-local"}`, network: "../etc", err: "not a directory name"},
		{name: "host-local dot-dot network", raw: `{"type": "host-local"}`, network: "..", err: "not a directory name"},
		{name: "host-local no network", raw: `{"type": "host-local"}`, network: "", err: "not a directory name"},
		{name: "whereabouts", raw: `{"type": "whereabouts", "range": "10.0.0.0/24"}`, network: "n", want: Source{Kind: Whereabouts, Type: "whereabouts"}},
		{name: "another IPAM", raw: `{"type": "calico-ipam"}`, network: "n", want: Source{Kind: Unreadable, Type: "calico-ipam"}},
		{name: "no type", raw: `{"dataDir": "/x"}`, network: "n", err: `no "type"`},
		{name: "not an object", raw: `[1]`, network: "n", err: "not a JSON object"},
		{name: "too large", raw: `{"type": "host-local", "x": "` + strings.Repeat("a", MaxConfig) + `"}`, network: "n", err: "at most"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse([]byte(tc.raw), tc.network)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Parse: %v, want an error with %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("Parse = %+v, %v; want %+v", got, err, tc.want)
			}
			if got.NodeLocal() != (tc.want.Kind == HostLocal) {
				t.Fatalf("NodeLocal %v for %v", got.NodeLocal(), got.Kind)
			}
		})
	}
}

func TestHostLocalReserved(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []Entry
		want    string
	}{
		{name: "none", want: ""},
		{name: "reservations, lock and last reserved", entries: []Entry{{"lock", true, false}, {"last_reserved_ip.0", true, false},
			{"10.0.0.12", true, false}, {"10.0.0.10", true, false}, {"10.0.0.11", true, false}}, want: "10.0.0.10-10.0.0.12"},
		{name: "IPv6 and a temporary file", entries: []Entry{{"fd00::5", true, false}, {".ipwarden-handback-123", true, false}, {"fd00::5.tmp", true, false}},
			want: "fd00::5"},
		{name: "a directory named like an address is not a reservation", entries: []Entry{{"10.0.0.9", false, false}, {"10.0.0.8", true, false}},
			want: "10.0.0.8"},
		{name: "a zone is not host-local's", entries: []Entry{{"fe80::1%eth0", true, false}}, want: ""},
		{name: "ipwarden's own files are not host-local's reservations", entries: []Entry{{"10.0.0.3", true, true}, {"10.0.0.4", true, false}},
			want: "10.0.0.4"},
		{name: "IPv4-mapped is the IPv4 address", entries: []Entry{{"::ffff:10.0.0.7", true, false}}, want: "10.0.0.7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := HostLocalReserved(tc.entries)
			if want := mustSet(t, tc.want); !got.Equal(want) {
				t.Fatalf("HostLocalReserved = %v, want %v", got, want)
			}
		})
	}
}

func TestWhereaboutsReserved(t *testing.T) {
	for _, tc := range []struct {
		name  string
		pools []WhereaboutsPool
		want  string
		err   string
	}{
		{name: "offsets from the range's address", pools: []WhereaboutsPool{{Name: "10.244.0.0-24", Range: "10.244.0.0/24", Offsets: []string{"10", "11", "12"}}},
			want: "10.244.0.10-10.244.0.12"},
		{name: "a range written with host bits counts from its address", pools: []WhereaboutsPool{{Range: "10.244.0.8/24", Offsets: []string{"2"}}},
			want: "10.244.0.10"},
		{name: "two pools, IPv6", pools: []WhereaboutsPool{{Range: "10.1.0.0/28", Offsets: []string{"1"}}, {Range: "fd00::/120", Offsets: []string{"255"}}},
			want: "10.1.0.1, fd00::ff"},
		{name: "no allocations", pools: []WhereaboutsPool{{Range: "10.1.0.0/28"}}, want: ""},
		{name: "bad range", pools: []WhereaboutsPool{{Name: "x", Range: "10.1.0.0"}}, err: "spec.range"},
		{name: "bad offset", pools: []WhereaboutsPool{{Name: "x", Range: "10.1.0.0/24", Offsets: []string{"-1"}}}, err: "not a number"},
		{name: "offset beyond the address space", pools: []WhereaboutsPool{{Name: "x", Range: "255.255.255.0/24", Offsets: []string{"256"}}}, err: "beyond"},
		{name: "ipwarden's own allocations are not Whereabouts' reservations", pools: []WhereaboutsPool{{Range: "10.1.0.0/28", Offsets: []string{"1", "2"},
			Allocations: map[string]WhereaboutsAllocation{"1": {ID: "ipwarden:c1", PodRef: "default/a"}, "2": {ID: "c2", PodRef: "default/b"}}}},
			want: "10.1.0.2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := WhereaboutsReserved(tc.pools)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("WhereaboutsReserved: %v, want an error with %q", err, tc.err)
				}
				return
			}
			if want := mustSet(t, tc.want); err != nil || !got.Equal(want) {
				t.Fatalf("WhereaboutsReserved = %v, %v; want %v", got, err, want)
			}
		})
	}
}

func TestWhereaboutsPoolOf(t *testing.T) {
	obj := map[string]any{"metadata": map[string]any{"name": "10.244.0.0-24"},
		"spec": map[string]any{"range": "10.244.0.0/24", "allocations": map[string]any{"10": map[string]any{"id": "c1", "podref": "default/a"}}}}
	p := WhereaboutsPoolOf(obj)
	if p.Name != "10.244.0.0-24" || p.Range != "10.244.0.0/24" || len(p.Offsets) != 1 || p.Offsets[0] != "10" ||
		p.Allocations["10"] != (WhereaboutsAllocation{ID: "c1", PodRef: "default/a"}) {
		t.Fatalf("WhereaboutsPoolOf = %+v", p)
	}
}

// ReadHostLocal on a real directory: the reservation files are read, a missing network directory
// holds none, a missing dataDir is an error, and the read waits for host-local's lock.
func TestReadHostLocal(t *testing.T) {
	data := t.TempDir()
	dir := filepath.Join(data, "podnet")
	got, err := ReadHostLocal(context.Background(), dir)
	if err != nil || !got.IsEmpty() {
		t.Fatalf("missing network directory: %v, %v; want none", got, err)
	}
	if _, err := ReadHostLocal(context.Background(), filepath.Join(data, "nodata", "podnet")); err == nil || !strings.Contains(err.Error(), "not visible") {
		t.Fatalf("missing dataDir: %v, want an error", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"10.0.0.5", "10.0.0.6", "last_reserved_ip.0"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("c\r\neth0"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Hold host-local's lock as host-local does; the read must wait for it.
	lf, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	type res struct {
		s   addr.Set
		err error
	}
	done := make(chan res, 1)
	go func() {
		s, err := ReadHostLocal(context.Background(), dir)
		done <- res{s, err}
	}()
	select {
	case r := <-done:
		t.Fatalf("the read finished (%v, %v) while host-local held its lock", r.s, r.err)
	case <-time.After(200 * time.Millisecond):
		// Not a synchronization: the read must not finish at all while the lock is held; the
		// wait only bounds how long the test looks for a violation.
	}
	// host-local reserves one more address while it holds the lock, then releases it.
	if err := os.WriteFile(filepath.Join(dir, "10.0.0.7"), []byte("d\r\neth0"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if want := mustSet(t, "10.0.0.5-10.0.0.7"); r.err != nil || !r.s.Equal(want) {
		t.Fatalf("ReadHostLocal = %v, %v; want %v (including the reservation made under the lock)", r.s, r.err, want)
	}

	// A host-local that never releases its lock: the read gives up when its context ends.
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := ReadHostLocal(ctx, dir); err == nil || !strings.Contains(err.Error(), "not released in time") {
		t.Fatalf("ReadHostLocal with the lock held past its context: %v, want an error", err)
	}
}

func mustSet(t *testing.T, s string) addr.Set {
	t.Helper()
	if s == "" {
		return addr.Set{}
	}
	set, err := addr.ParseSetString(s)
	if err != nil {
		t.Fatal(err)
	}
	return set
}
