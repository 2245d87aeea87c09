package sim

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/ippool"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string // substring of the error; "" for none
	}{
		{"defaults", func(*Config) {}, ""},
		{"no nodes", func(c *Config) { c.Nodes = 0 }, "--nodes 0: must be between 1 and 200000"},
		{"negative churn", func(c *Config) { c.Churn = -1 }, "--churn -1"},
		{"churn without pods", func(c *Config) { c.PodsPerNode = 0 }, "--pods-per-node 0"},
		{"static cluster", func(c *Config) { c.PodsPerNode, c.Churn = 0, 0 }, ""},
		{"batch zero", func(c *Config) { c.Scaling.BatchSize = 0 }, "--batch-size 0: must be between 1 and 65536"},
		{"buffer too big", func(c *Config) { c.Scaling.BufferPercent = 101 }, "--buffer-percent 101"},
		{"max below batch", func(c *Config) { c.Scaling.MaxPerNode = 8 }, "--max-per-node 8: must be at least --batch-size 16"},
		{"pool too big", func(c *Config) { c.PoolSize = 1 << 24 }, "for larger or IPv6 pools give --pool-cidr"},
		{"host bits", func(c *Config) { c.PoolCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.1/24")} }, "write 10.0.0.0/24"},
		{"mixed families", func(c *Config) {
			c.PoolCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("fd00::/120")}
		}, "one family"},
		{"ipv6 pool", func(c *Config) { c.PoolCIDRs = []netip.Prefix{netip.MustParsePrefix("fd00::/64")} }, ""},
		{"negative cooldown", func(c *Config) { c.ReuseCooldown = -time.Second }, "--reuse-cooldown -1s: must not be negative"},
		{"no workers", func(c *Config) { c.ControllerWorkers = 0 }, "--controller-workers 0"},
		{"negative qps", func(c *Config) { c.KubeAPIQPS = -1 }, "--kube-api-qps -1"},
		{"no burst", func(c *Config) { c.KubeAPIBurst = 0 }, "--kube-api-burst 0"},
		{"zero duration", func(c *Config) { c.Duration = 0 }, "--duration 0s: must be positive"},
		{"too many samples", func(c *Config) { c.SampleInterval = time.Millisecond }, "--sample-interval 1ms"},
		{"bad start", func(c *Config) { c.Start = "lukewarm" }, `--start "lukewarm"`},
		{"burst after the end", func(c *Config) { c.Burst, c.BurstAt = 10, 2*time.Hour }, "--burst-at 2h0m0s"},
		{"empty trace", func(c *Config) { c.Trace = &Trace{} }, "--trace: the trace has no events"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.mod(&c)
			err := c.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate() = %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Validate() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestPoolSpec(t *testing.T) {
	for _, size := range []int{1, 2, 3, 62, 64, 1000, 65536, 150000, 1<<24 - 2} {
		c := DefaultConfig()
		c.PoolSize = size
		spec, err := c.PoolSpec()
		if err != nil {
			t.Fatalf("PoolSpec(size %d): %v", size, err)
		}
		cfg, err := ippool.Parse(spec)
		if err != nil {
			t.Fatalf("PoolSpec(size %d) = %+v, which the controller rejects: %v", size, spec, err)
		}
		if got, _ := cfg.Addresses.Size().Uint64(); got != uint64(size) {
			t.Errorf("PoolSpec(size %d) = %v minus %v: %d usable addresses", size, spec.CIDRs, spec.Exclude, got)
		}
	}
	c := DefaultConfig()
	c.PoolCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.0.2.0/24")}
	spec, err := c.PoolSpec()
	if err != nil || len(spec.CIDRs) != 2 || len(spec.Exclude) != 0 {
		t.Errorf("PoolSpec with CIDRs = %+v, %v: want them as they are", spec, err)
	}
}

func TestParseTrace(t *testing.T) {
	good := `time_seconds,node,pod,event
# a comment
5, n2, b, start
0,n1,a,start
10,n1,a,stop
10.5,n1,a,START
`
	tr, err := ParseTrace(strings.NewReader(good))
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"n2", "n1"}; !slices.Equal(tr.Nodes, want) {
		t.Errorf("nodes %v, want %v (order of first appearance)", tr.Nodes, want)
	}
	var got []string
	for _, ev := range tr.Events {
		got = append(got, ev.At.String()+" "+ev.Node+"/"+ev.Pod+map[bool]string{false: " start", true: " stop"}[ev.Stop])
	}
	want := []string{"0s n1/a start", "5s n2/b start", "10s n1/a stop", "10.5s n1/a start"}
	if !slices.Equal(got, want) {
		t.Errorf("events %q, want %q", got, want)
	}
	if tr.End() != 10500*time.Millisecond {
		t.Errorf("End() = %s, want 10.5s", tr.End())
	}

	for _, tc := range []struct{ in, want string }{
		{"0,n1,a\n", "trace line 1: 3 fields, want 4"},
		{"x,n1,a,start\n", `trace line 1: time_seconds "x"`},
		{"-1,n1,a,start\n", `time_seconds "-1"`},
		{"1,,a,start\n", "node and pod must not be empty"},
		{"1,n1,a,begin\n", `event "begin": want start or stop`},
		{"1,n1,a,start\n2,n1,a,start\n", "trace line 2: pod a starts on node n1 while it is running"},
		{"1,n1,a,stop\n", "trace line 1: pod a stops on node n1 but is not running there"},
		{"2,n1,a,start\n1,n1,a,stop\n", "trace line 2: pod a stops on node n1 but is not running"},
	} {
		if _, err := ParseTrace(strings.NewReader(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseTrace(%q) = %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

func TestAgendaOrder(t *testing.T) {
	var q agenda
	rng := rand.New(rand.NewPCG(1, 2))
	type item struct {
		at  time.Duration
		seq int
	}
	var want []item
	for i := range 2000 {
		at := time.Duration(rng.IntN(50)) * time.Millisecond
		q.push(at, evSample, int32(i), 0)
		want = append(want, item{at, i})
	}
	slices.SortStableFunc(want, func(a, b item) int { return int(a.at - b.at) })
	for i, w := range want {
		ev := q.pop()
		if ev.at != w.at || int(ev.a) != w.seq {
			t.Fatalf("pop %d = (%s, %d), want (%s, %d): events must come by time, then in the order scheduled", i, ev.at, ev.a, w.at, w.seq)
		}
	}
	if q.len() != 0 {
		t.Fatalf("agenda not empty")
	}
}

func TestStats(t *testing.T) {
	var h countHist
	for _, v := range []int{1, 2, 2, 3, 10} {
		h.add(v)
	}
	if got, want := h.stats(), (Stats{Mean: 3.6, P50: 2, P99: 10, Max: 10}); got != want {
		t.Errorf("countHist stats = %+v, want %+v", got, want)
	}
	if got := (&countHist{}).stats(); got != (Stats{}) {
		t.Errorf("empty countHist stats = %+v, want zero", got)
	}
	ds := []time.Duration{3 * time.Second, time.Second, 2 * time.Second}
	if got, want := durationStats(ds, 0), (Stats{Mean: 2, P50: 2, P99: 3, Max: 3}); got != want {
		t.Errorf("durationStats = %+v, want %+v", got, want)
	}
	// 97 pods that did not wait and 3 that did: the median is 0, p99 the second longest wait.
	if got, want := durationStats(ds, 97), (Stats{Mean: 0.06, P50: 0, P99: 2, Max: 3}); got != want {
		t.Errorf("durationStats with zeros = %+v, want %+v", got, want)
	}
	if got := durationStats(nil, 0); got != (Stats{}) {
		t.Errorf("durationStats of nothing = %+v, want zero", got)
	}
}

func TestTokenBucket(t *testing.T) {
	b := newTokenBucket(10, 2) // 10 per second, burst 2
	ms := time.Millisecond
	for i, tc := range []struct{ now, want time.Duration }{
		{0, 0}, {0, 0}, // the burst
		{0, 100 * ms}, {0, 200 * ms}, // then one per 100ms, reserved ahead
		{1000 * ms, 1000 * ms}, {1000 * ms, 1000 * ms}, // refilled to the burst, no more
		{1000 * ms, 1100 * ms},
	} {
		if got := b.take(tc.now); got != tc.want {
			t.Fatalf("take %d at %s = %s, want %s", i, tc.now, got, tc.want)
		}
	}
	if got := newTokenBucket(0, 1).take(5 * ms); got != 5*ms {
		t.Fatalf("no limit: take = %s, want now", got)
	}
}

func TestNiceAxes(t *testing.T) {
	for _, tc := range []struct{ raw, step float64 }{{0.3, 0.5}, {1, 1}, {1.1, 2}, {3, 5}, {7, 10}, {46000, 50000}, {0, 1}} {
		if got := niceStep(tc.raw); got != tc.step {
			t.Errorf("niceStep(%g) = %g, want %g", tc.raw, got, tc.step)
		}
	}
	for _, tc := range []struct {
		v    float64
		want string
	}{{0, "0"}, {2.5, "2.5"}, {1500, "1500"}, {250000, "250k"}, {1.2e6, "1.2M"}} {
		if got := fmtNum(tc.v); got != tc.want {
			t.Errorf("fmtNum(%g) = %q, want %q", tc.v, got, tc.want)
		}
	}
}
