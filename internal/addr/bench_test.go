package addr

import (
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"
)

// randomSet returns a set of about n disjoint small ranges spread over
// 10.0.0.0/8.
func randomSet(seed uint64, n int) Set {
	rnd := rand.New(rand.NewPCG(seed, 0))
	base, _ := key(ip("10.0.0.0"))
	rs := make([]Range, n)
	for i := range rs {
		lo := base.addU64(rnd.Uint64N(1 << 24))
		hi := lo.addU64(rnd.Uint64N(64))
		if maxV4.less(hi) {
			hi = maxV4
		}
		rs[i] = rng{lo, hi}.toRange(true)
	}
	return NewSet(rs...)
}

func BenchmarkSetUnion(b *testing.B) {
	x, y := randomSet(1, 10000), randomSet(2, 10000)
	b.Run("10k+10k", func(b *testing.B) {
		for b.Loop() {
			_ = x.Union(y)
		}
	})
	one := ms("10.200.0.0/28")
	b.Run("10k+1", func(b *testing.B) {
		for b.Loop() {
			_ = x.Union(one)
		}
	})
}

func BenchmarkSetSubtract(b *testing.B) {
	x, y := randomSet(1, 10000), randomSet(2, 10000)
	b.Run("10k-10k", func(b *testing.B) {
		for b.Loop() {
			_ = x.Subtract(y)
		}
	})
	one := ms("10.200.0.0/28")
	b.Run("10k-1", func(b *testing.B) {
		for b.Loop() {
			_ = x.Subtract(one)
		}
	})
	pool := ms("10.0.0.0/8")
	b.Run("pool-10k", func(b *testing.B) {
		for b.Loop() {
			_ = pool.Subtract(x)
		}
	})
}

func BenchmarkSetIntersect(b *testing.B) {
	x, y := randomSet(1, 10000), randomSet(2, 10000)
	for b.Loop() {
		_ = x.Intersect(y)
	}
}

func BenchmarkSetContains(b *testing.B) {
	x := randomSet(1, 10000)
	rnd := rand.New(rand.NewPCG(3, 0))
	probes := make([]netip.Addr, 1024)
	for i := range probes {
		probes[i] = netip.AddrFrom4([4]byte{10, byte(rnd.Uint32()), byte(rnd.Uint32()), byte(rnd.Uint32())})
	}
	i := 0
	for b.Loop() {
		_ = x.Contains(probes[i&1023])
		i++
	}
}

func BenchmarkParseSet(b *testing.B) {
	items := randomSet(1, 10000).Strings()
	b.ReportMetric(float64(len(items)), "items")
	for b.Loop() {
		if _, err := ParseSet(items); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkStrings(b *testing.B) {
	x := randomSet(1, 10000)
	for b.Loop() {
		_ = x.Strings()
	}
}

// clusterAllocator builds a /12 pool holding 5,000 nodes with 30 addresses
// each (150,000 addresses, in a few ranges per node), with pod churn
// leaving single-address holes.
func clusterAllocator(tb testing.TB) (*Allocator, []Set, time.Time) {
	a := NewAllocator(ms("10.0.0.0/12"), time.Minute)
	now := t0
	nodes := make([]Set, 5000)
	for i := range nodes {
		s, err := a.Allocate(16, Set{}, now)
		if err != nil {
			tb.Fatal(err)
		}
		nodes[i] = s
	}
	for i := range nodes {
		s, err := a.Allocate(14, nodes[i], now)
		if err != nil {
			tb.Fatal(err)
		}
		nodes[i] = nodes[i].Union(s)
	}
	rnd := rand.New(rand.NewPCG(4, 0))
	for range 3000 {
		i := rnd.IntN(len(nodes))
		as := nodes[i].Addrs(30)
		x := SetOfAddrs(as[rnd.IntN(len(as))])
		if err := a.Free(x, now); err != nil {
			tb.Fatal(err)
		}
		nodes[i] = nodes[i].Subtract(x)
	}
	now = now.Add(time.Hour)
	a.Expire(now)
	return a, nodes, now
}

func BenchmarkAllocate16(b *testing.B) {
	base, nodes, now := clusterAllocator(b)
	allocRanges, freeRanges := base.Allocated().NumRanges(), base.Usable(now).NumRanges()
	b.Run("near", func(b *testing.B) {
		defer func() {
			b.ReportMetric(float64(allocRanges), "alloc-ranges")
			b.ReportMetric(float64(freeRanges), "free-ranges")
		}()
		a := base.Clone()
		i := 0
		for b.Loop() {
			if i%20000 == 0 {
				a = base.Clone() // stay far from exhaustion
			}
			if _, err := a.Allocate(16, nodes[i%len(nodes)], now); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("fresh", func(b *testing.B) {
		a := base.Clone()
		i := 0
		for b.Loop() {
			if i%20000 == 0 {
				a = base.Clone()
			}
			if _, err := a.Allocate(16, Set{}, now); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("alloc+free", func(b *testing.B) {
		a := base.Clone()
		t := now
		i := 0
		for b.Loop() {
			s, err := a.Allocate(16, nodes[i%len(nodes)], t)
			if err != nil {
				b.Fatal(err)
			}
			if err := a.Free(s, t); err != nil {
				b.Fatal(err)
			}
			t = t.Add(time.Second)
			i++
		}
	})
}
