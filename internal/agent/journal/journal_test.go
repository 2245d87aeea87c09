package journal

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/scaling"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// canon renders a snapshot as JSON so snapshots compare by value (times by instant, sets by
// their text form).
func canon(t testing.TB, s ipam.Snapshot) string {
	t.Helper()
	s.Sort()
	type holding struct {
		Pool string
		Addr []string
	}
	var hs []holding
	for _, h := range s.Holdings {
		hs = append(hs, holding{h.Pool, h.Addresses.Strings()})
	}
	for i := range s.Attachments {
		s.Attachments[i].Created = s.Attachments[i].Created.UTC()
	}
	for i := range s.Cooling {
		s.Cooling[i].FreedAt = s.Cooling[i].FreedAt.UTC()
	}
	for i := range s.Releasing {
		s.Releasing[i].Since = s.Releasing[i].Since.UTC()
	}
	b, err := json.Marshal(struct {
		A []ipam.Attachment
		C []ipam.Cooling
		R []ipam.Releasing
		H []holding
		P []ipam.Pool
		M ipam.RecordMark
		F []string
		B *ipam.HandbackMark
		D []ipam.Address
	}{s.Attachments, s.Cooling, s.Releasing, hs, s.Pools, s.Mark, s.ConfigPools, s.Handback, s.Ahead})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func open(t testing.TB, dir, node string) *Journal {
	t.Helper()
	j, err := Open(dir, Options{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	return j
}

func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, "node-a")
	pool := ipam.Pool{
		Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, Gateway: netip.MustParseAddr("10.0.0.1"),
		Routes:  []ipam.Route{{Dst: netip.MustParsePrefix("0.0.0.0/0")}},
		Scaling: scaling.DefaultParams, Cooldown: 30 * time.Second, Sticky: true,
		Reserved: []ipam.StickyUse{{Identity: sticky.Identity{Namespace: "ns", StatefulSet: "db", Ordinal: 2}, Addr: netip.MustParseAddr("10.0.0.9")}},
		Claims:   []ipam.ClaimBinding{{Namespace: "ns", Name: "vm-a", UID: "c1", Addr: netip.MustParseAddr("10.0.0.10")}},
	}
	configPools := []string{"v4"}
	changes := []ipam.Change{
		{PutPools: []ipam.Pool{pool}, PutHoldings: []ipam.Holding{{Pool: "v4", Addresses: addr.MustParseSetString("10.0.0.0/28")}}},
		{PutAttachments: []ipam.Attachment{{
			Key: ipam.Key{ContainerID: "abc", IfName: "eth0"}, Network: "net",
			Pod:       ipam.PodRef{Namespace: "ns", Name: "web", UID: "u1"},
			Addresses: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.2")}}, Created: t0,
		}, {
			Key: ipam.Key{ContainerID: "vm", IfName: "eth0"}, Network: "net",
			Pod:       ipam.PodRef{Namespace: "ns", Name: "virt-launcher-a", UID: "u3"},
			Addresses: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.10")}}, Created: t0,
			Claim: &ipam.ClaimRef{Namespace: "ns", Name: "vm-a", UID: "c1", MigrationTarget: true},
		}}, PutConfigPools: &configPools},
		{PutCooling: []ipam.Cooling{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.3"), FreedAt: t0}},
			PutReleasing: []ipam.Releasing{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.15"), Since: t0}}},
		{DeleteCooling: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.3")}},
			PutAttachments: []ipam.Attachment{{Key: ipam.RebuiltKey("u2"), Rebuilt: true, Created: t0,
				Addresses: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.3")}}}}},
		{PutAhead: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.4")}, {Pool: "v4", Addr: netip.MustParseAddr("10.0.0.5")}}},
		{DeleteAhead: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.4")}},
			PutAhead: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.0.0.6")}}},
	}
	var want ipam.Snapshot
	for _, ch := range changes {
		if err := j.Commit(ch); err != nil {
			t.Fatal(err)
		}
		want = want.Apply(ch)
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	j = open(t, dir, "node-a")
	defer j.Close()
	got, err := j.Load()
	if err != nil {
		t.Fatal(err)
	}
	if canon(t, got) != canon(t, want) {
		t.Fatalf("loaded\n%s\nwant\n%s", canon(t, got), canon(t, want))
	}
	if errs := j.Verify(); len(errs) > 0 {
		t.Fatal(errs)
	}
}

// TestUpgradesFormat1: a journal of format 1 (before records of addresses reserved ahead) opens,
// keeps its records, and is format 2 from then on, so an agent that reads only format 1 refuses
// it.
func TestUpgradesFormat1(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, "node-a")
	ch := ipam.Change{PutHoldings: []ipam.Holding{{Pool: "v4", Addresses: addr.MustParseSetString("10.0.0.0/28")}}}
	if err := j.Commit(ch); err != nil {
		t.Fatal(err)
	}
	if err := j.db.Update(func(tx *bolt.Tx) error {
		if err := tx.DeleteBucket(bucketAhead); err != nil {
			return err
		}
		return tx.Bucket(bucketMeta).Put(keyFormat, []byte("1"))
	}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	j = open(t, dir, "node-a")
	defer j.Close()
	got, err := j.Load()
	if err != nil {
		t.Fatal(err)
	}
	if want := (ipam.Snapshot{}).Apply(ch); canon(t, got) != canon(t, want) {
		t.Fatalf("loaded\n%s\nwant\n%s", canon(t, got), canon(t, want))
	}
	if err := j.db.View(func(tx *bolt.Tx) error {
		if f := string(tx.Bucket(bucketMeta).Get(keyFormat)); f != formatVersion {
			t.Errorf("format after the upgrade: %q, want %q", f, formatVersion)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func TestRefusesOtherNodeAndSecondOpener(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, "node-a")
	if _, err := Open(dir, Options{Node: "node-a", LockTimeout: 100 * time.Millisecond}); err == nil ||
		!strings.Contains(err.Error(), "another process holds its lock") {
		t.Fatalf("second open: %v", err)
	}
	j.Close()
	if _, err := Open(dir, Options{Node: "node-b"}); err == nil || !strings.Contains(err.Error(), `belongs to node "node-a"`) {
		t.Fatalf("open for another node: %v", err)
	}
}

// TestGroupCommit: concurrent commits all land, in fewer transactions than commits.
func TestGroupCommit(t *testing.T) {
	var mu sync.Mutex
	txs := 0
	j, err := Open(t.TempDir(), Options{Node: "n", ObserveWrite: func(time.Duration) { mu.Lock(); txs++; mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	const n = 200
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			k := ipam.Key{ContainerID: fmt.Sprintf("c%03d", i), IfName: "eth0"}
			if err := j.Commit(ipam.Change{PutAttachments: []ipam.Attachment{{Key: k, Created: t0}}}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	snap, err := j.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Attachments) != n {
		t.Fatalf("%d attachments, want %d", len(snap.Attachments), n)
	}
	t.Logf("%d commits in %d transactions", n, txs)
	if txs >= n {
		t.Errorf("no grouping: %d transactions for %d concurrent commits", txs, n)
	}
}

func TestCommitAfterClose(t *testing.T) {
	j := open(t, t.TempDir(), "n")
	j.Close()
	if err := j.Commit(ipam.Change{DeletePools: []string{"x"}}); err != ErrClosed {
		t.Fatalf("Commit after Close = %v", err)
	}
}

// A lazy change (a DEL already answered) waits up to Linger for a change that is not lazy and
// shares its transaction; alone it is written once Linger has passed; Close writes it at once.
func TestCommitLazy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var txs atomic.Int32
		dir := t.TempDir()
		j, err := Open(dir, Options{Node: "n", ObserveWrite: func(time.Duration) { txs.Add(1) }})
		if err != nil {
			t.Fatal(err)
		}
		att := func(cid string) ipam.Change {
			return ipam.Change{PutAttachments: []ipam.Attachment{{Key: ipam.Key{ContainerID: cid, IfName: "eth0"}, Created: t0}}}
		}
		lazy := func(cid string) <-chan error {
			done := make(chan error, 1)
			go func() { done <- j.CommitLazy(att(cid)) }()
			synctest.Wait() // queued: the committer lingers
			return done
		}
		pending := func(done <-chan error) bool {
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
				return false
			default:
				return true
			}
		}

		// Joined by a Commit: one transaction for both.
		first := lazy("del-1")
		if !pending(first) || txs.Load() != 0 {
			t.Fatalf("the lazy change was written at once (%d transactions)", txs.Load())
		}
		if err := j.Commit(att("add-1")); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if pending(first) {
			t.Fatal("the lazy change is still waiting after a Commit wrote its transaction")
		}
		if n := txs.Load(); n != 1 {
			t.Fatalf("%d transactions for a lazy change joined by a Commit, want 1", n)
		}

		// Alone: written once Linger has passed, not before.
		second := lazy("del-2")
		time.Sleep(Linger - time.Millisecond)
		synctest.Wait()
		if !pending(second) {
			t.Fatal("a lone lazy change was written before Linger")
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		if pending(second) || txs.Load() != 2 {
			t.Fatalf("a lone lazy change is not written once Linger passed (%d transactions)", txs.Load())
		}

		// Close writes a lingering change.
		third := lazy("del-3")
		if err := j.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-third; err != nil {
			t.Fatalf("a lazy change queued before Close: %v", err)
		}
		j = open(t, dir, "n")
		defer j.Close()
		snap, err := j.Load()
		if err != nil {
			t.Fatal(err)
		}
		if len(snap.Attachments) != 4 {
			t.Fatalf("%d attachments on disk, want 4: %+v", len(snap.Attachments), snap.Attachments)
		}
	})
}

// The handback mark survives a reopen of the journal, and so does its clearing; a node whose
// journal holds it refuses ADD after a restart.
func TestHandbackMarkSurvivesReopen(t *testing.T) {
	dir := t.TempDir()
	j := open(t, dir, "node-a")
	at := t0.Add(time.Hour)
	mark := ipam.HandbackMark{At: at, To: "host-local", Network: "net", Dir: "/var/lib/cni/networks/net"}
	if err := j.Commit(ipam.Change{PutHandback: &mark}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	j = open(t, dir, "node-a")
	snap, err := j.Load()
	if err != nil {
		t.Fatal(err)
	}
	if snap.Handback == nil || !snap.Handback.At.Equal(at) || snap.Handback.To != "host-local" || snap.Handback.Network != "net" {
		t.Fatalf("loaded handback mark %+v, want %+v", snap.Handback, mark)
	}
	st := ipam.New("node-a")
	st.Restore(snap)
	_, _, err = st.Add(ipam.AddRequest{Key: ipam.Key{ContainerID: "c1", IfName: "eth0"}}, at.Add(time.Minute))
	var hb *ipam.HandedBackError
	if !errors.As(err, &hb) || !strings.Contains(err.Error(), "handed back to host-local at 2025-01-01T01:00:00Z") {
		t.Fatalf("ADD after a restart with the mark: %v, want a *HandedBackError naming the time", err)
	}
	if err := j.Commit(ipam.Change{ClearHandback: true}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	j = open(t, dir, "node-a")
	defer j.Close()
	if snap, err = j.Load(); err != nil || snap.Handback != nil {
		t.Fatalf("after clearing: mark %+v, err %v", snap.Handback, err)
	}
}
