package addr

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// check verifies the allocator's internal invariants.
func (a *Allocator) check() error {
	for name, s := range map[string]Set{"pool": a.pool, "allocated": a.allocated.s, "cooling": a.cooling.s, "free": a.free.s} {
		if err := checkCanonical(s); err != nil {
			return fmt.Errorf("%s: %v", name, err)
		}
	}
	if want := a.pool.Subtract(a.allocated.s).Subtract(a.cooling.s); !a.free.s.Equal(want) {
		return fmt.Errorf("free = %v, want pool-allocated-cooling = %v", a.free.s, want)
	}
	if a.freeSize != a.free.s.Size() {
		return fmt.Errorf("cached free size %v != %v", a.freeSize, a.free.s.Size())
	}
	if a.allocated.s.Overlaps(a.cooling.s) {
		return fmt.Errorf("allocated %v overlaps cooling %v", a.allocated.s, a.cooling.s)
	}
	var all Set
	for i, b := range a.batches {
		if b.set.IsEmpty() {
			return fmt.Errorf("batch %d empty", i)
		}
		if i > 0 && b.at.Before(a.batches[i-1].at) {
			return fmt.Errorf("batch %d out of time order", i)
		}
		if all.Overlaps(b.set) {
			return fmt.Errorf("batch %d overlaps earlier batches", i)
		}
		all = all.Union(b.set)
	}
	if !all.Equal(a.cooling.s) {
		return fmt.Errorf("cooling %v != union of batches %v", a.cooling.s, all)
	}
	return nil
}

func mustCheck(t testing.TB, a *Allocator) {
	t.Helper()
	if err := a.check(); err != nil {
		t.Fatal(err)
	}
}

func mustAlloc(t testing.TB, a *Allocator, n int, near Set, now time.Time, want string) Set {
	t.Helper()
	got, err := a.Allocate(n, near, now)
	if err != nil {
		t.Fatalf("Allocate(%d, %v): %v", n, near, err)
	}
	mustCheck(t, a)
	if w := ms(want); !got.Equal(w) {
		t.Fatalf("Allocate(%d, near %q) = %q, want %q", n, near, got, w)
	}
	return got
}

func TestAllocatorBuddy(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/24"), time.Minute)
	if a.Cooldown() != time.Minute || !a.Pool().Equal(ms("10.0.0.0/24")) {
		t.Fatal("accessors")
	}
	n1 := mustAlloc(t, a, 16, Set{}, t0, "10.0.0.0/28")
	n1 = n1.Union(mustAlloc(t, a, 16, n1, t0, "10.0.0.16/28")) // extends to a /27
	if n1.String() != "10.0.0.0/27" {
		t.Fatalf("node holdings %v", n1)
	}
	// Smallest free block holding 4 is the /27 at .32; first /30 of it.
	mustAlloc(t, a, 4, Set{}, t0, "10.0.0.32/30")
	// 3 rounds up to 4: the free /30 at .36 is now the smallest block.
	mustAlloc(t, a, 3, Set{}, t0, "10.0.0.36-10.0.0.38")
	mustAlloc(t, a, 1, Set{}, t0, "10.0.0.39")
	mustAlloc(t, a, 64, Set{}, t0, "10.0.0.64/26")
	mustAlloc(t, a, 5, Set{}, t0, "10.0.0.40-10.0.0.44")
	if got := a.Available(t0); got != CountOf(256-32-4-3-1-64-5) {
		t.Fatalf("Available = %v", got)
	}
	if got := a.Allocated().String(); got != "10.0.0.0-10.0.0.44,10.0.0.64/26" {
		t.Fatalf("Allocated = %v", got)
	}
}

func TestAllocatorBestFit(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/24"), 0)
	if err := a.Reserve(ms("10.0.0.0-10.0.0.99, 10.0.0.104-10.0.0.127")); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	// Free: .100/30 and .128/25; a /30 request takes the hole.
	mustAlloc(t, a, 4, Set{}, t0, "10.0.0.100/30")
	mustAlloc(t, a, 2, Set{}, t0, "10.0.0.128/31")
}

func TestAllocatorNear(t *testing.T) {
	for _, tc := range []struct {
		name, pool, reserved, near string
		n                          int
		want                       string
	}{
		{"extend after", "10.0.0.0/24", "10.0.0.0/28", "10.0.0.0/28", 16, "10.0.0.16/28"},
		{"extend before to aggregate", "10.0.0.0/24", "10.0.0.16/28", "10.0.0.16/28", 16, "10.0.0.0/28"},
		{"extend after when before is taken", "10.0.0.0/24", "10.0.0.0/27", "10.0.0.16/28", 8, "10.0.0.32/29"},
		{"fill gap", "10.0.0.0/24", "10.0.0.0-10.0.0.5,10.0.0.8-10.0.0.15", "10.0.0.0-10.0.0.5,10.0.0.8-10.0.0.15", 2, "10.0.0.6/31"},
		{"fill holes, smallest first, then extend", "10.0.0.0/24", "10.0.0.0-10.0.0.9,10.0.0.11-10.0.0.19,10.0.0.22-10.0.0.31",
			"10.0.0.0-10.0.0.9,10.0.0.11-10.0.0.19,10.0.0.22-10.0.0.31", 5, "10.0.0.10,10.0.0.20-10.0.0.21,10.0.0.32/31"},
		{"a hole larger than the request is extended into, not filled", "10.0.0.0/24", "10.0.0.0/28,10.0.0.48/28", "10.0.0.0/28,10.0.0.48/28", 4, "10.0.0.16/30"},
		{"a hole partly taken is left", "10.0.0.0/24", "10.0.0.0-10.0.0.9,10.0.0.11-10.0.0.15", "10.0.0.0-10.0.0.9,10.0.0.12-10.0.0.15", 2, "10.0.0.16/31"},
		{"single extension", "10.0.0.0/24", "10.0.0.0/28", "10.0.0.0/28", 1, "10.0.0.16"},
		{"block beats ragged extension", "10.0.0.0/24", "10.0.0.5", "10.0.0.5", 16, "10.0.0.16/28"},
		{"no room next to near", "10.0.0.0/24", "10.0.0.0/26", "10.0.0.16/28", 16, "10.0.0.64/28"},
		{"near not in pool", "10.0.0.0/24", "", "192.168.0.0/24", 4, "10.0.0.0/30"},
		{"near at top of v4", "255.255.255.0/24", "255.255.255.240/28", "255.255.255.240/28", 16, "255.255.255.224/28"},
		{"near at bottom of v4", "0.0.0.0/24", "0.0.0.0/28", "0.0.0.0/28", 16, "0.0.0.16/28"},
		{"v6 extend", "2001:db8::/64", "2001:db8::/124", "2001:db8::/124", 16, "2001:db8::10/124"},
		{"v6 across 64-bit word", "2001:db8::/63", "2001:db8::ffff:ffff:ffff:fff0/124", "2001:db8::ffff:ffff:ffff:fff0/124", 32, "2001:db8::ffff:ffff:ffff:ffd0-2001:db8::ffff:ffff:ffff:ffef"},
		{"v6 top edge", max6 + "/128, ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff0/124", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff8/125", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff8/125", 8, "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff0/125"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := NewAllocator(ms(tc.pool), time.Minute)
			if err := a.Reserve(ms(tc.reserved)); err != nil {
				t.Fatal(err)
			}
			mustAlloc(t, a, tc.n, ms(tc.near), t0, tc.want)
		})
	}
}

// With SetRoom(2) a holder with nothing yet starts at the bottom of a free block four times its
// request, so the next holder starts in another one and the first can grow in place; when no
// such block is left, the smallest that fits.
func TestAllocatorRoom(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/24"), time.Minute)
	a.SetRoom(2)
	first := mustAlloc(t, a, 16, Set{}, t0, "10.0.0.0/28")
	mustAlloc(t, a, 16, Set{}, t0, "10.0.0.64/28")
	mustAlloc(t, a, 32, first, t0, "10.0.0.16-10.0.0.47")
	mustAlloc(t, a, 16, Set{}, t0, "10.0.0.128/28")
	mustAlloc(t, a, 16, Set{}, t0, "10.0.0.192/28")
	// No free /26 is left: the smallest free block that fits.
	mustAlloc(t, a, 16, Set{}, t0, "10.0.0.48/28")
	// A clone keeps the setting: its second holder starts a block further, not right after.
	c := NewAllocator(ms("10.0.0.0/24"), time.Minute)
	c.SetRoom(2)
	c = c.Clone()
	mustAlloc(t, c, 16, Set{}, t0, "10.0.0.0/28")
	mustAlloc(t, c, 16, Set{}, t0, "10.0.0.64/28")
}

func TestAllocatorAssemble(t *testing.T) {
	for _, tc := range []struct {
		pool string
		n    int
		want string
	}{
		{"10.0.0.0/30, 10.0.0.8/31, 10.0.0.16, 10.0.0.20", 7, "10.0.0.0/30, 10.0.0.8/31, 10.0.0.16"},
		{"10.0.0.0/30, 10.0.0.8/30", 5, "10.0.0.0/30, 10.0.0.8"},
		{"10.0.0.0/30, 10.0.0.8/30", 8, "10.0.0.0/30, 10.0.0.8/30"},
		{"10.0.0.1-10.0.0.6", 5, "10.0.0.2/31, 10.0.0.4/31, 10.0.0.1"},
		{"10.0.0.0/30, 2001:db8::/126", 8, "10.0.0.0/30, 2001:db8::/126"},
		// 3 needs a /30: none, so take the /31 then the lowest single.
		{"10.0.0.1, 10.0.0.3, 10.0.0.6/31", 3, "10.0.0.1, 10.0.0.6/31"},
	} {
		a := NewAllocator(ms(tc.pool), 0)
		mustAlloc(t, a, tc.n, Set{}, t0, tc.want)
	}
}

func TestAllocatorEdges(t *testing.T) {
	a := NewAllocator(ms("::/0"), time.Minute)
	if got := a.Available(t0); got != MaxCount {
		t.Fatalf("Available(::/0) = %v", got)
	}
	mustAlloc(t, a, 1, Set{}, t0, "::")
	mustAlloc(t, a, 1<<40, Set{}, t0, "::100:0:0/88") // first aligned 2^40 block after ::
	if got := a.Available(t0); got != MaxCount.Sub(CountOf(1<<40+1)).Add(CountOf(1)) {
		t.Fatalf("Available = %v", got)
	}

	a = NewAllocator(ms("0.0.0.0/0"), 0)
	mustAlloc(t, a, 1<<31, Set{}, t0, "0.0.0.0/1")
	mustAlloc(t, a, 1<<31, Set{}, t0, "128.0.0.0/1")
	if _, err := a.Allocate(1, Set{}, t0); err == nil {
		t.Fatal("allocated from a full pool")
	}

	a = NewAllocator(ms("255.255.255.254/31"), 0)
	mustAlloc(t, a, 1, ms("255.255.255.255"), t0, "255.255.255.254")
	mustAlloc(t, a, 1, ms("255.255.255.254"), t0, "255.255.255.255")

	a = NewAllocator(ms("10.0.0.0/24"), 0)
	if s, err := a.Allocate(0, Set{}, t0); err != nil || !s.IsEmpty() {
		t.Fatalf("Allocate(0) = %v, %v", s, err)
	}
	if _, err := a.Allocate(-1, Set{}, t0); err == nil {
		t.Fatal("Allocate(-1) succeeded")
	}

	var empty Allocator // zero value: empty pool
	if _, err := empty.Allocate(1, Set{}, t0); err == nil || empty.Available(t0) != (Count{}) {
		t.Fatal("zero Allocator")
	}
}

func TestAllocatorExhausted(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/29"), time.Minute)
	got := mustAlloc(t, a, 6, Set{}, t0, "10.0.0.0-10.0.0.5")
	before := a.Allocated()
	_, err := a.Allocate(3, got, t0)
	var ex *ExhaustedError
	if !errors.As(err, &ex) || ex.Requested != 3 || ex.Available != CountOf(2) {
		t.Fatalf("err = %#v", err)
	}
	if err.Error() != "pool has 2 usable addresses, need 3" {
		t.Fatalf("message %q", err)
	}
	if !a.Allocated().Equal(before) || a.Available(t0) != CountOf(2) {
		t.Fatal("failed Allocate changed state")
	}
	// Cooling addresses do not count as available.
	if err := a.Free(ms("10.0.0.0/30"), t0); err != nil {
		t.Fatal(err)
	}
	_, err = a.Allocate(3, Set{}, t0.Add(59*time.Second))
	if !errors.As(err, &ex) || ex.Available != CountOf(2) {
		t.Fatalf("err = %v", err)
	}
	mustAlloc(t, a, 3, Set{}, t0.Add(time.Minute), "10.0.0.0-10.0.0.2")
}

func TestAllocatorCooldownFIFO(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/28"), time.Minute)
	mustAlloc(t, a, 16, Set{}, t0, "10.0.0.0/28")
	if err := a.Free(ms("10.0.0.0/30"), t0); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(ms("10.0.0.8/30"), t0.Add(10*time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(ms("10.0.0.4"), t0.Add(10*time.Second)); err != nil { // merges into the same batch
		t.Fatal(err)
	}
	mustCheck(t, a)
	if len(a.batches) != 2 {
		t.Fatalf("%d batches", len(a.batches))
	}
	if got := a.Cooling().String(); got != "10.0.0.0-10.0.0.4,10.0.0.8/30" {
		t.Fatalf("Cooling = %v", got)
	}
	if got := a.Available(t0.Add(59 * time.Second)); !got.IsZero() {
		t.Fatalf("Available before cooldown = %v", got)
	}
	if got := a.Expire(t0.Add(time.Minute)); got.String() != "10.0.0.0/30" {
		t.Fatalf("first Expire = %v", got)
	}
	if got := a.Usable(t0.Add(time.Minute)); got.String() != "10.0.0.0/30" {
		t.Fatalf("Usable = %v", got)
	}
	if got := a.Expire(t0.Add(69 * time.Second)); !got.IsEmpty() {
		t.Fatalf("early Expire = %v", got)
	}
	if got := a.Expire(t0.Add(70 * time.Second)); got.String() != "10.0.0.4,10.0.0.8/30" {
		t.Fatalf("second Expire = %v", got)
	}
	mustCheck(t, a)
	if !a.Cooling().IsEmpty() || a.Available(t0.Add(time.Hour)) != CountOf(9) {
		t.Fatal("after expiry")
	}

	// A batch freed with an earlier time than the newest still expires first.
	b := NewAllocator(ms("10.0.0.0/28"), time.Minute)
	mustAlloc(t, b, 2, Set{}, t0, "10.0.0.0/31")
	_ = b.Free(ms("10.0.0.0"), t0.Add(30*time.Second))
	_ = b.Free(ms("10.0.0.1"), t0)
	mustCheck(t, b)
	if got := b.Expire(t0.Add(time.Minute)); got.String() != "10.0.0.1" {
		t.Fatalf("Expire = %v", got)
	}
}

func TestAllocatorCooldownZero(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/30"), -time.Second)
	if a.Cooldown() != 0 {
		t.Fatal("negative cooldown kept")
	}
	got := mustAlloc(t, a, 4, Set{}, t0, "10.0.0.0/30")
	if err := a.Free(got, t0); err != nil {
		t.Fatal(err)
	}
	mustAlloc(t, a, 4, Set{}, t0, "10.0.0.0/30")
}

func TestAllocatorFreeErrors(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/28"), time.Minute)
	mustAlloc(t, a, 4, Set{}, t0, "10.0.0.0/30")
	err := a.Free(ms("10.0.0.2-10.0.0.5"), t0)
	var na *NotAllocatedError
	if !errors.As(err, &na) || na.Addrs.String() != "10.0.0.4/31" || err.Error() != "addresses not allocated: 10.0.0.4/31" {
		t.Fatalf("err = %v", err)
	}
	if a.Allocated().String() != "10.0.0.0/30" || !a.Cooling().IsEmpty() {
		t.Fatal("failed Free changed state")
	}
	if err := a.Free(Set{}, t0); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(ms("10.0.0.0/30"), t0); err != nil {
		t.Fatal(err)
	}
	// Double free.
	if err := a.Free(ms("10.0.0.1"), t0); !errors.As(err, &na) {
		t.Fatalf("double free: %v", err)
	}
}

func TestAllocatorReserve(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/28"), time.Minute)
	if err := a.Reserve(ms("10.0.0.0/30, 192.168.0.1")); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if got := a.Conflicts().String(); got != "192.168.0.1" {
		t.Fatalf("Conflicts = %v", got)
	}
	if got := a.Available(t0); got != CountOf(12) {
		t.Fatalf("Available = %v", got)
	}
	err := a.Reserve(ms("10.0.0.3-10.0.0.5, 192.168.0.1"))
	var aa *AlreadyAllocatedError
	if !errors.As(err, &aa) || aa.Addrs.String() != "10.0.0.3,192.168.0.1" || !strings.Contains(err.Error(), "already allocated: 10.0.0.3,192.168.0.1") {
		t.Fatalf("err = %v", err)
	}
	if a.Allocated().String() != "10.0.0.0/30,192.168.0.1" {
		t.Fatal("failed Reserve changed state")
	}
	// Reserving cooling addresses takes them out of the cooldown.
	if err := a.Free(ms("10.0.0.0/30"), t0); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(ms("192.168.0.1"), t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := a.Reserve(ms("10.0.0.0/31,192.168.0.1")); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if a.Cooling().String() != "10.0.0.2/31" || len(a.batches) != 1 {
		t.Fatalf("Cooling = %v, %d batches", a.Cooling(), len(a.batches))
	}
	if err := a.Reserve(Set{}); err != nil {
		t.Fatal(err)
	}
}

func TestAllocatorSetPool(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/24, 10.0.1.0/24"), time.Minute)
	n1 := mustAlloc(t, a, 256, Set{}, t0, "10.0.0.0/24")
	mustAlloc(t, a, 16, Set{}, t0, "10.0.1.0/28")
	// Drop the first CIDR and exclude part of the second.
	a.SetPool(ms("10.0.1.0-10.0.1.7, 10.0.1.128/25"))
	mustCheck(t, a)
	if got := a.Conflicts().String(); got != "10.0.0.0/24,10.0.1.8/29" {
		t.Fatalf("Conflicts = %v", got)
	}
	if !a.Allocated().ContainsSet(n1) {
		t.Fatal("SetPool took addresses away")
	}
	if got := a.Available(t0); got != CountOf(128) {
		t.Fatalf("Available = %v", got)
	}
	mustAlloc(t, a, 16, Set{}, t0, "10.0.1.128/28")
	// Conflicting addresses freed cool down, then vanish.
	if err := a.Free(ms("10.0.0.0/24"), t0); err != nil {
		t.Fatal(err)
	}
	if got := a.Expire(t0.Add(time.Minute)); got.String() != "10.0.0.0/24" {
		t.Fatalf("Expire = %v", got)
	}
	mustCheck(t, a)
	if got := a.Available(t0.Add(time.Minute)); got != CountOf(112) {
		t.Fatalf("Available = %v", got)
	}
	// Growing the pool back makes the conflict disappear.
	a.SetPool(ms("10.0.0.0/23"))
	mustCheck(t, a)
	if !a.Conflicts().IsEmpty() {
		t.Fatalf("Conflicts = %v", a.Conflicts())
	}
}

func TestErrorMessages(t *testing.T) {
	e := &ExhaustedError{Requested: 16, Available: MaxCount}
	if e.Error() != "pool has 340282366920938463463374607431768211455 usable addresses, need 16" {
		t.Fatal(e.Error())
	}
	var as []netip.Addr
	for i := range 20 {
		as = append(as, netip.AddrFrom4([4]byte{10, 0, 0, byte(2 * i)}))
	}
	msg := (&NotAllocatedError{Addrs: SetOfAddrs(as...)}).Error()
	if msg != "addresses not allocated: 10.0.0.0,10.0.0.2,10.0.0.4,10.0.0.6,10.0.0.8,10.0.0.10,10.0.0.12,10.0.0.14,... (20 ranges, 20 addresses)" {
		t.Fatal(msg)
	}
}

func TestAllocatorUnreserveAndBatches(t *testing.T) {
	a := NewAllocator(ms("10.0.0.0/28"), time.Minute)
	got := mustAlloc(t, a, 8, Set{}, t0, "10.0.0.0/29")
	if err := a.Unreserve(ms("10.0.0.8")); err == nil {
		t.Fatal("Unreserve of a free address succeeded")
	}
	if err := a.Unreserve(Set{}); err != nil {
		t.Fatal(err)
	}
	if err := a.Unreserve(ms("10.0.0.4/30")); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if a.Available(t0) != CountOf(12) || !a.Cooling().IsEmpty() {
		t.Fatal("Unreserve did not free at once")
	}
	_ = a.Free(got.First(2), t0)
	_ = a.Free(ms("10.0.0.2"), t0.Add(time.Second))
	bs := a.CoolingBatches()
	if len(bs) != 2 || bs[0].Addrs.String() != "10.0.0.0/31" || !bs[0].Freed.Equal(t0) || bs[1].Addrs.String() != "10.0.0.2" {
		t.Fatalf("CoolingBatches = %v", bs)
	}
	a.SetCooldown(time.Hour)
	if got := a.Expire(t0.Add(time.Minute + time.Second)); !got.IsEmpty() {
		t.Fatalf("Expire after raising the cooldown = %v", got)
	}
	a.SetCooldown(-1)
	if got := a.Expire(t0.Add(time.Second)); got.String() != "10.0.0.0-10.0.0.2" {
		t.Fatalf("Expire = %v", got)
	}
	mustCheck(t, a)
}

func TestAllocatorSaturatedPool(t *testing.T) {
	a := NewAllocator(ms("0.0.0.0/0,::/0"), time.Minute)
	s := mustAlloc(t, a, 3, Set{}, t0, "0.0.0.0/31,0.0.0.2")
	_ = a.Free(s, t0)
	if got := a.Expire(t0.Add(time.Minute)); !got.Equal(s) {
		t.Fatalf("Expire = %v", got)
	}
	mustCheck(t, a)
	if a.Available(t0) != MaxCount {
		t.Fatal("Available")
	}
	b := NewAllocator(ms("::/0"), 0)
	mustAlloc(t, b, 1, Set{}, t0, "::")
	if got := b.Available(t0); got != MaxCount {
		t.Fatalf("Available = %v, want 2^128-1", got)
	}
	mustAlloc(t, b, 1, Set{}, t0, "::1")
	if got := b.Available(t0); got != MaxCount.Sub(CountOf(1)) {
		t.Fatalf("Available = %v, want 2^128-2", got)
	}
}

func TestCowSet(t *testing.T) {
	// In-place updates of an owned set never disturb sets handed out.
	c := &cowSet{}
	c.add(ms("10.0.0.0/24"))
	c.add(ms("10.0.2.0/24"))
	v := c.view()
	c.add(ms("10.0.1.0/24"))
	c.remove(ms("10.0.0.5, 2001:db8::1"))
	c.add(ms("2001:db8::/64"))
	c.remove(ms("2001:db8::1"))
	c.add(ms("10.0.0.5"))
	if v.String() != "10.0.0.0/24,10.0.2.0/24" {
		t.Fatalf("view changed: %v", v)
	}
	if c.s.String() != "10.0.0.0-10.0.2.255,2001:db8::,2001:db8::2-2001:db8::ffff:ffff:ffff:ffff" || checkCanonical(c.s) != nil || !c.owned.Load() {
		t.Fatalf("c = %v owned %v", c.s, c.owned.Load())
	}
	c.remove(ms("10.0.0.0/22"))
	c.remove(ms("2001:db8::/64"))
	if !c.s.IsEmpty() || c.owned.Load() || c.s.rs != nil {
		t.Fatalf("emptied c = %#v", c.s)
	}
	// Adding the caller's set to an empty one must not take ownership.
	p := ms("10.0.0.0/30")
	c.add(p)
	c.add(ms("10.0.0.8"))
	if p.String() != "10.0.0.0/30" {
		t.Fatalf("caller's set changed: %v", p)
	}
}

func TestAllocatorConcurrentReaders(t *testing.T) {
	// Read-only methods may run together under a read lock while writers
	// take the write lock (run with -race).
	a := NewAllocator(ms("10.0.0.0/16"), time.Second)
	var mu sync.RWMutex
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				mu.RLock()
				s := a.Allocated()
				_ = a.Cooling()
				_ = a.Conflicts()
				_ = a.CoolingBatches()
				mu.RUnlock()
				if err := checkCanonical(s); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	now := t0
	for i := range 200 {
		mu.Lock()
		s, err := a.Allocate(3, Set{}, now)
		if err == nil && i%2 == 0 {
			err = a.Free(s, now)
		}
		mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		now = now.Add(100 * time.Millisecond)
	}
	wg.Wait()
}

// Return frees at once, with no cooldown; addresses outside the pool are forgotten; addresses
// not allocated are refused and nothing changes.
func TestAllocatorReturn(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	a := NewAllocator(ms("10.0.0.0/28"), time.Hour)
	got, err := a.Allocate(8, Set{}, now)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Return(ms("10.0.0.0/31,10.0.0.9")); err == nil {
		t.Fatal("Return of an address not allocated succeeded")
	}
	if !a.Allocated().Equal(got) {
		t.Fatalf("a refused Return changed the allocation: %v", a.Allocated())
	}
	if err := a.Return(ms("10.0.0.0/30")); err != nil {
		t.Fatal(err)
	}
	if !a.Cooling().IsEmpty() || a.Available(now).Cmp(CountOf(12)) != 0 || !a.Usable(now).ContainsSet(ms("10.0.0.0/30")) {
		t.Fatalf("after Return: cooling %v, available %v", a.Cooling(), a.Available(now))
	}
	// Outside the pool after it shrank: forgotten, not free.
	if err := a.Reserve(ms("10.0.1.0")); err != nil {
		t.Fatal(err)
	}
	if err := a.Return(ms("10.0.1.0")); err != nil || a.Usable(now).Contains(netip.MustParseAddr("10.0.1.0")) {
		t.Fatalf("outside address: err %v, usable %v", err, a.Usable(now))
	}
}
