package journal

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// filled writes a journal with n attachments into a fresh directory and returns its path.
func filled(t testing.TB, n int) (dir, path string) {
	t.Helper()
	dir = t.TempDir()
	j := open(t, dir, "node-a")
	var ch ipam.Change
	for i := range n {
		a := ipam.Attachment{Key: ipam.Key{ContainerID: fmt.Sprintf("%064d", i), IfName: "eth0"}, Created: t0,
			Pod:       ipam.PodRef{Namespace: "ns", Name: fmt.Sprintf("pod-%d", i), UID: fmt.Sprintf("uid-%d", i)},
			Addresses: []ipam.Address{{Pool: "v4", Addr: netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})}}}
		ch.PutAttachments = append(ch.PutAttachments, a)
	}
	if err := j.Commit(ch); err != nil {
		t.Fatal(err)
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	return dir, filepath.Join(dir, FileName)
}

// Damage functions, shared by the tests below.

func truncateHalf(t *testing.T, path string) {
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, fi.Size()/2); err != nil {
		t.Fatal(err)
	}
}

// randomPages overwrites every page from first on with random bytes.
func randomPages(seed uint64, first int) func(t *testing.T, path string) {
	return func(t *testing.T, path string) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		ps := os.Getpagesize()
		r := rand.New(rand.NewPCG(seed, 1))
		for i := first * ps; i < len(b); i++ {
			b[i] = byte(r.Uint32())
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// someRandomPages overwrites a few random pages (never the meta pages) with random bytes.
func someRandomPages(seed uint64) func(t *testing.T, path string) {
	return func(t *testing.T, path string) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		ps := os.Getpagesize()
		r := rand.New(rand.NewPCG(seed, 2))
		pages := len(b) / ps
		for range 3 {
			p := 2 + r.IntN(pages-2)
			for i := p * ps; i < (p+1)*ps; i++ {
				b[i] = byte(r.Uint32())
			}
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// boltVersion3 sets both meta pages' bbolt version to 3, checksums fixed.
func boltVersion3(t *testing.T, path string) {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ps := os.Getpagesize()
	for _, off := range []int{0, ps} {
		m := b[off+pageHeaderSize : off+pageHeaderSize+metaSize]
		binary.NativeEndian.PutUint32(m[4:], 3)
		h := fnvSum(m[:checksumOffset])
		binary.NativeEndian.PutUint64(m[checksumOffset:], h)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// formatVersion99 writes a journal format this agent does not read.
func formatVersion99(t *testing.T, path string) {
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketMeta).Put(keyFormat, []byte("99")) }); err != nil {
		t.Fatal(err)
	}
}

// badRecord stores an attachment record that does not decode.
func badRecord(t *testing.T, path string) {
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketAttachments).Put([]byte("x\x00eth0"), []byte("{not json"))
	}); err != nil {
		t.Fatal(err)
	}
}

func TestCheckFile(t *testing.T) {
	tests := []struct {
		name   string
		damage func(*testing.T, string)
		reason string // "" for a healthy file
	}{
		{"healthy", func(*testing.T, string) {}, ""},
		{"truncated to half", truncateHalf, ReasonTruncated},
		{"truncated to 100 bytes", func(t *testing.T, p string) { _ = os.Truncate(p, 100) }, ReasonTruncated},
		{"empty", func(t *testing.T, p string) { _ = os.Truncate(p, 0) }, ReasonTruncated},
		{"garbage everywhere", randomPages(1, 0), ReasonCorrupt},
		{"bbolt version 3", boltVersion3, ReasonIncompatibleVersion},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, path := filled(t, 200)
			tc.damage(t, path)
			err := CheckFile(path)
			got := ""
			if de, ok := err.(*DamageError); ok {
				got = de.Reason
			} else if err != nil {
				t.Fatalf("CheckFile: %v (not a DamageError)", err)
			}
			if got != tc.reason {
				t.Fatalf("CheckFile = %v, want reason %q", err, tc.reason)
			}
		})
	}
}

// Every kind of damage ends in an open, empty, working journal, the damaged file moved aside
// under a name that says so, and a Recovery naming the reason. Random pages in the tree are
// tried with many seeds: none may crash the process.
func TestOpenOrRecover(t *testing.T) {
	type tc struct {
		name    string
		damage  func(*testing.T, string)
		reasons []string // any of these; nil: not damaged
	}
	tests := []tc{
		{"healthy", func(*testing.T, string) {}, nil},
		{"truncated", truncateHalf, []string{ReasonTruncated}},
		{"bbolt version 3", boltVersion3, []string{ReasonIncompatibleVersion}},
		{"journal format 99", formatVersion99, []string{ReasonIncompatibleVersion}},
		{"undecodable record", badRecord, []string{ReasonCorrupt}},
		{"garbage after the meta pages", randomPages(7, 2), []string{ReasonCorrupt}},
	}
	for seed := range uint64(40) {
		tests = append(tests, tc{fmt.Sprintf("three random pages, seed %d", seed), someRandomPages(seed),
			[]string{ReasonCorrupt, ""}}) // a page that was free is harmless
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir, path := filled(t, 300)
			tc.damage(t, path)
			now := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
			j, snap, rec, err := OpenOrRecover(dir, Options{Node: "node-a"}, now)
			if err != nil {
				t.Fatalf("OpenOrRecover: %v", err)
			}
			defer j.Close()
			if tc.reasons == nil {
				if rec != nil || len(snap.Attachments) != 300 {
					t.Fatalf("healthy journal: recovery %+v, %d attachments", rec, len(snap.Attachments))
				}
				return
			}
			if rec == nil {
				if !strings.Contains(tc.name, "random pages") {
					t.Fatal("damage not detected")
				}
				if len(snap.Attachments) != 300 {
					t.Fatalf("undetected damage changed the records: %d attachments", len(snap.Attachments))
				}
				return
			}
			ok := false
			for _, r := range tc.reasons {
				ok = ok || r == rec.Reason
			}
			if !ok {
				t.Fatalf("reason %q (%s), want one of %v", rec.Reason, rec.Problem, tc.reasons)
			}
			if rec.MovedTo != path+".damaged-20260102T030405.000000006Z" {
				t.Fatalf("moved to %s", rec.MovedTo)
			}
			if _, err := os.Stat(rec.MovedTo); err != nil {
				t.Fatalf("the damaged file is not kept: %v", err)
			}
			if !snap.IsEmpty() {
				t.Fatalf("the new journal is not empty: %d attachments", len(snap.Attachments))
			}
			k := ipam.Key{ContainerID: "after", IfName: "eth0"}
			if err := j.Commit(ipam.Change{PutAttachments: []ipam.Attachment{{Key: k, Created: t0}}}); err != nil {
				t.Fatalf("commit to the new journal: %v", err)
			}
			if errs := j.Verify(); len(errs) > 0 {
				t.Fatal(errs)
			}
		})
	}
}

// Errors that are not damage move nothing: another agent's lock, another node's journal.
func TestOpenOrRecoverKeepsUndamaged(t *testing.T) {
	dir, path := filled(t, 3)
	j := open(t, dir, "node-a")
	if _, _, _, err := OpenOrRecover(dir, Options{Node: "node-a", LockTimeout: 100 * time.Millisecond}, time.Now()); err == nil ||
		!strings.Contains(err.Error(), "another process holds its lock") {
		t.Fatalf("second opener: %v", err)
	}
	j.Close()
	if _, _, _, err := OpenOrRecover(dir, Options{Node: "node-b"}, time.Now()); err == nil || !strings.Contains(err.Error(), "belongs to node") {
		t.Fatalf("other node: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("files in the state directory: %v", entries)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
}

func fnvSum(b []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write(b)
	return h.Sum64()
}

func TestHoldMarker(t *testing.T) {
	dir := t.TempDir()
	if _, on, err := HeldUntil(dir); on || err != nil {
		t.Fatalf("no marker: %v %v", on, err)
	}
	until := time.Date(2026, 1, 1, 0, 5, 0, 0, time.UTC)
	if err := MarkHold(dir, until); err != nil {
		t.Fatal(err)
	}
	if got, on, err := HeldUntil(dir); !on || err != nil || !got.Equal(until) {
		t.Fatalf("marker: %v %v %v", got, on, err)
	}
	if err := os.WriteFile(filepath.Join(dir, HoldFileName), []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, on, err := HeldUntil(dir); !on || err == nil || !got.IsZero() {
		t.Fatalf("garbage marker: %v %v %v", got, on, err)
	}
	if err := ClearHold(dir); err != nil {
		t.Fatal(err)
	}
	if _, on, _ := HeldUntil(dir); on {
		t.Fatal("marker not cleared")
	}
}

// bbolt failing during a write (a page damaged after the load) breaks the journal, not the
// process: the commit fails, later commits fail at once, Close returns, and the next start
// moves the file aside.
func TestWritePanicBreaksTheJournal(t *testing.T) {
	dir, path := filled(t, 3)
	j, _, rec, err := OpenOrRecover(dir, Options{Node: "node-a"}, time.Now())
	if err != nil || rec != nil {
		t.Fatalf("open: %v %+v", err, rec)
	}
	j.beforeWrite = func() { panic("invalid page type: 0") }
	k := ipam.Key{ContainerID: "x", IfName: "eth0"}
	err = j.Commit(ipam.Change{PutAttachments: []ipam.Attachment{{Key: k, Created: t0}}})
	if err == nil || !strings.Contains(err.Error(), "bbolt failed writing it: invalid page type") {
		t.Fatalf("commit: %v", err)
	}
	select {
	case <-j.Broken():
	default:
		t.Fatal("Broken not closed")
	}
	if err := j.Commit(ipam.Change{DeleteAttachments: []ipam.Key{k}}); err == nil {
		t.Fatal("a commit after the break succeeded")
	}
	done := make(chan error, 1)
	go func() { done <- j.Close() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close blocked")
	}
	j2, snap, rec, err := OpenOrRecover(dir, Options{Node: "node-a"}, time.Now())
	if err != nil || rec == nil || rec.Reason != ReasonCorrupt || !strings.Contains(rec.Problem, "invalid page type") {
		t.Fatalf("next start: %v %+v", err, rec)
	}
	defer j2.Close()
	if !snap.IsEmpty() {
		t.Fatal("the new journal is not empty")
	}
	if _, err := os.Stat(path + brokenSuffix); !os.IsNotExist(err) {
		t.Fatalf("marker left: %v", err)
	}
}

// FuzzOpenOrRecover: whatever bytes the journal file holds, the agent gets an open, usable
// journal (the file moved aside if it is not a journal it can read), never a crash.
func FuzzOpenOrRecover(f *testing.F) {
	_, path := filled(f, 5)
	good, err := os.ReadFile(path)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good, uint32(0), uint32(0))
	f.Add(good, uint32(3*os.Getpagesize()), uint32(200))
	f.Add(good[:len(good)/2], uint32(0), uint32(0))
	f.Add([]byte("not a journal"), uint32(0), uint32(0))
	f.Fuzz(func(t *testing.T, data []byte, at, n uint32) {
		if len(data) > 1<<20 {
			return
		}
		b := append([]byte(nil), data...)
		// Flip n bytes from at on, so mutations of a real journal reach its pages.
		for i := uint32(0); i < n && int(at)+int(i) < len(b); i++ {
			b[int(at)+int(i)] ^= 0xA5
		}
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, FileName), b, 0o600); err != nil {
			t.Fatal(err)
		}
		j, _, _, err := OpenOrRecover(dir, Options{Node: "node-a"}, time.Now())
		if err != nil {
			if strings.Contains(err.Error(), "belongs to node") {
				return // a valid journal of another node: refused, not damaged
			}
			t.Fatalf("OpenOrRecover: %v", err)
		}
		defer j.Close()
		if err := j.Commit(ipam.Change{DeletePools: []string{"x"}}); err != nil {
			t.Fatalf("commit: %v", err)
		}
	})
}
