package sim

import (
	"errors"
	"fmt"
	"github.com/ipwarden/ipwarden/internal/controller"
	"math/bits"
	"net/netip"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/ippool"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// Start is how the cluster looks at time 0.
type Start string

const (
	// StartWarm: every node already runs its initial pods and holds what its agent asks for,
	// as in a cluster that has been up for a while. The run measures steady state.
	StartWarm Start = "warm"
	// StartCold: nodes hold nothing and every initial pod is bound at time 0, as after a fresh
	// install or a full restart of every node. The run measures the controller's catch-up.
	StartCold Start = "cold"
)

// Config is one simulation. Errors from Validate name the ipwarden simulate flag of each field.
type Config struct {
	// Nodes is the number of nodes (--nodes). Ignored with a Trace, whose nodes are used.
	Nodes int
	// PodsPerNode is the mean number of pods running on a node in steady state (--pods-per-node).
	PodsPerNode float64
	// Churn is the pod starts per node per minute (--churn). Pod lifetimes are exponential with
	// mean PodsPerNode/Churn minutes, so the running count stays around PodsPerNode.
	Churn float64

	// PoolCIDRs are the pool's networks (--pool-cidr); when empty a pool of PoolSize addresses
	// is carved from 10.0.0.0/8 (--pool-size).
	PoolCIDRs []netip.Prefix
	PoolSize  int
	// Scaling is the pool's spec.scaling (--batch-size, --buffer-percent, --max-per-node,
	// --release-slack-percent, --release-delay).
	Scaling scaling.Params
	// ReuseCooldown is the pool's spec.reuseCooldown (--reuse-cooldown).
	ReuseCooldown time.Duration

	// ControllerWorkers is the controller's --workers (--controller-workers).
	ControllerWorkers int
	// ControllerLatency is how long one status write of the controller takes, during which its
	// worker is busy (--controller-latency).
	ControllerLatency time.Duration
	// KubeAPIQPS and KubeAPIBurst are the controller's client rate limit, its flags of the same
	// names (--kube-api-qps, --kube-api-burst): every write waits for a token. 0 QPS: no limit.
	KubeAPIQPS   float64
	KubeAPIBurst int
	// WatchDelay is how long a write takes to reach the other side's informer (--watch-delay).
	WatchDelay time.Duration
	// MinSyncInterval, ControllerResync and PoolStatusInterval are the controller's flags of
	// the same names (--min-sync-interval, --controller-resync, --pool-status-interval).
	MinSyncInterval    time.Duration
	ControllerResync   time.Duration
	PoolStatusInterval time.Duration

	// AgentLatency is how long an agent's spec write takes; changes meanwhile coalesce into
	// the next write (--agent-latency).
	AgentLatency time.Duration
	// AgentResync is the longest time between two recomputations of a node's request
	// (--agent-resync).
	AgentResync time.Duration
	// AddDelay is the time from a pod's binding to its CNI ADD (--add-delay): the agent counts
	// the pod as demand from its binding on.
	AddDelay time.Duration
	// AddressWait is how long an ADD waits for an address before the agent fails it with CNI
	// error 11 (--address-wait).
	AddressWait time.Duration

	// Duration is the simulated time (--duration); SampleInterval the time series' step
	// (--sample-interval).
	Duration       time.Duration
	SampleInterval time.Duration
	// Seed makes a run reproducible (--seed).
	Seed uint64
	// Start is the state at time 0 (--start).
	Start Start
	// Burst pods are bound to the first node at BurstAt and run to the end (--burst, --burst-at).
	Burst   int
	BurstAt time.Duration
	// Trace, when set, replaces the synthetic workload (--trace).
	Trace *Trace

	// onMachine, when set, is given the controller's machine before it starts leading (tests).
	onMachine func(*controller.Machine)
}

// DefaultConfig is a 100-node cluster on a 10.0.0.0/16 pool with the API's default settings and the
// controller's default flags.
func DefaultConfig() Config {
	return Config{
		Nodes:              100,
		PodsPerNode:        30,
		Churn:              1,
		PoolSize:           65534, // 10.0.0.0/16 without its network and broadcast address
		Scaling:            scaling.DefaultParams,
		ReuseCooldown:      30 * time.Second,
		ControllerWorkers:  4,
		ControllerLatency:  20 * time.Millisecond,
		KubeAPIQPS:         100,
		KubeAPIBurst:       200,
		WatchDelay:         20 * time.Millisecond,
		MinSyncInterval:    100 * time.Millisecond,
		ControllerResync:   time.Minute,
		PoolStatusInterval: time.Second,
		AgentLatency:       20 * time.Millisecond,
		AgentResync:        time.Minute,
		AddDelay:           time.Second,
		AddressWait:        10 * time.Second,
		Duration:           time.Hour,
		SampleInterval:     10 * time.Second,
		Seed:               1,
		Start:              StartWarm,
	}
}

// maxNodes bounds --nodes: far beyond any cluster, low enough to keep memory sane.
const maxNodes = 200000

// Validate reports the first setting the simulation cannot run with, naming its flag and what
// to do.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	if c.Trace == nil {
		if c.Nodes < 1 || c.Nodes > maxNodes {
			bad("--nodes %d: must be between 1 and %d", c.Nodes, maxNodes)
		}
		if c.PodsPerNode < 0 || c.PodsPerNode > 65536 {
			bad("--pods-per-node %g: must be between 0 and 65536", c.PodsPerNode)
		}
		if c.Churn < 0 {
			bad("--churn %g: must be 0 or more pod starts per node per minute", c.Churn)
		}
		if c.Churn > 0 && c.PodsPerNode == 0 {
			bad("--churn %g with --pods-per-node 0: pods would live no time at all; set --pods-per-node to the steady-state pod count", c.Churn)
		}
	} else if len(c.Trace.Nodes) == 0 {
		bad("--trace: the trace has no events")
	}
	if len(c.PoolCIDRs) == 0 {
		if c.PoolSize < 1 || c.PoolSize > 1<<24-2 {
			bad("--pool-size %d: must be between 1 and 16777214 (10.0.0.0/8); for larger or IPv6 pools give --pool-cidr", c.PoolSize)
		}
	} else {
		for _, p := range c.PoolCIDRs {
			if !p.IsValid() || p != p.Masked() {
				bad("--pool-cidr %s: has host bits set: write %s", p, p.Masked())
			} else if p.Addr().Is4() != c.PoolCIDRs[0].Addr().Is4() {
				bad("--pool-cidr: all CIDRs of a pool must be of one family")
			}
		}
	}
	switch {
	case c.Scaling.BatchSize < 1 || c.Scaling.BatchSize > 65536:
		bad("--batch-size %d: must be between 1 and 65536", c.Scaling.BatchSize)
	case c.Scaling.BufferPercent < 0 || c.Scaling.BufferPercent > 100:
		bad("--buffer-percent %d: must be between 0 and 100", c.Scaling.BufferPercent)
	case c.Scaling.MaxPerNode < c.Scaling.BatchSize || c.Scaling.MaxPerNode > 65536:
		bad("--max-per-node %d: must be at least --batch-size %d and at most 65536", c.Scaling.MaxPerNode, c.Scaling.BatchSize)
	case c.Scaling.ReleaseSlackPercent < 0 || c.Scaling.ReleaseSlackPercent > scaling.MaxReleaseSlackPercent:
		bad("--release-slack-percent %d: must be between 0 and %d", c.Scaling.ReleaseSlackPercent, scaling.MaxReleaseSlackPercent)
	case c.Scaling.ReleaseDelay < 0:
		bad("--release-delay %s: must not be negative (0s gives back at once)", c.Scaling.ReleaseDelay)
	}
	nonNeg := func(flag string, d time.Duration) {
		if d < 0 {
			bad("%s %s: must not be negative", flag, d)
		}
	}
	positive := func(flag string, d time.Duration) {
		if d <= 0 {
			bad("%s %s: must be positive, such as 1s or 500ms", flag, d)
		}
	}
	nonNeg("--reuse-cooldown", c.ReuseCooldown)
	if c.ControllerWorkers < 1 || c.ControllerWorkers > 1024 {
		bad("--controller-workers %d: must be between 1 and 1024", c.ControllerWorkers)
	}
	nonNeg("--controller-latency", c.ControllerLatency)
	if c.KubeAPIQPS < 0 {
		bad("--kube-api-qps %g: must be 0 (no limit) or more", c.KubeAPIQPS)
	}
	if c.KubeAPIBurst < 1 {
		bad("--kube-api-burst %d: must be at least 1", c.KubeAPIBurst)
	}
	nonNeg("--watch-delay", c.WatchDelay)
	nonNeg("--min-sync-interval", c.MinSyncInterval)
	nonNeg("--controller-resync", c.ControllerResync)
	positive("--pool-status-interval", c.PoolStatusInterval)
	nonNeg("--agent-latency", c.AgentLatency)
	positive("--agent-resync", c.AgentResync)
	nonNeg("--add-delay", c.AddDelay)
	positive("--address-wait", c.AddressWait)
	positive("--duration", c.Duration)
	if c.Duration > 7*24*time.Hour {
		bad("--duration %s: at most one week (168h) of simulated time", c.Duration)
	}
	positive("--sample-interval", c.SampleInterval)
	if c.SampleInterval > 0 && c.Duration/c.SampleInterval > 1_000_000 {
		bad("--sample-interval %s: gives more than a million samples over --duration %s; raise it", c.SampleInterval, c.Duration)
	}
	if c.Start != StartWarm && c.Start != StartCold {
		bad("--start %q: use warm (nodes already hold addresses and run their pods) or cold (nothing held, every pod starts at time 0)", c.Start)
	}
	if c.Burst < 0 || c.Burst > 65536 {
		bad("--burst %d: must be between 0 and 65536 pods", c.Burst)
	}
	if c.BurstAt < 0 || (c.Burst > 0 && c.BurstAt >= c.Duration) {
		bad("--burst-at %s: must lie within --duration %s", c.BurstAt, c.Duration)
	}
	return errors.Join(errs...)
}

// PoolSpec returns the simulated IPPool's spec: the given CIDRs, or for PoolSize the smallest
// block of 10.0.0.0/8 with room for that many addresses after the addresses the controller
// reserves (network, broadcast), its top end excluded so that exactly PoolSize remain.
func (c Config) PoolSpec() (ipwardenv1.IPPoolSpec, error) {
	spec := ipwardenv1.IPPoolSpec{
		Scaling: ipwardenv1.Scaling{
			BatchSize:     int32(c.Scaling.BatchSize),
			BufferPercent: int32(c.Scaling.BufferPercent),
			MaxPerNode:    int32(c.Scaling.MaxPerNode),
		},
		ReuseCooldown: metav1.Duration{Duration: c.ReuseCooldown},
	}
	slack := int32(c.Scaling.ReleaseSlackPercent)
	spec.Scaling.ReleaseSlackPercent = &slack
	spec.Scaling.ReleaseDelay = &metav1.Duration{Duration: c.Scaling.ReleaseDelay}
	cidrs := c.PoolCIDRs
	if len(cidrs) == 0 {
		hostBits := min(bits.Len32(uint32(max(c.PoolSize, 1))+1), 24) // 2^hostBits >= size+2
		cidrs = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, 0, 0}), 32-hostBits)}
	}
	for _, p := range cidrs {
		spec.CIDRs = append(spec.CIDRs, ipwardenv1.CIDR(p.String()))
	}
	cfg, err := ippool.Parse(spec)
	if err != nil {
		return spec, fmt.Errorf("pool: %w", err)
	}
	if len(c.PoolCIDRs) > 0 {
		return spec, nil
	}
	size := uint64(c.PoolSize)
	have, _ := cfg.Addresses.Size().Uint64()
	if have > size {
		for _, b := range cfg.Addresses.Subtract(cfg.Addresses.First(int(size))).Prefixes() {
			e := b.String()
			if b.IsSingleIP() {
				e = b.Addr().String()
			}
			spec.Exclude = append(spec.Exclude, ipwardenv1.IPOrCIDR(e))
		}
		if cfg, err = ippool.Parse(spec); err != nil {
			return spec, fmt.Errorf("pool: %w", err)
		}
		have, _ = cfg.Addresses.Size().Uint64()
	}
	if have != size {
		return spec, fmt.Errorf("--pool-size %d: 10.0.0.0/8 holds only %d usable addresses; give --pool-cidr", c.PoolSize, have)
	}
	return spec, nil
}
