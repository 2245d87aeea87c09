package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// controllerBench measures the controller at scale against a real API server: hollow agents
// (goroutines of this process, many per process as in kubemark) write NodeIPAllocation specs for
// N nodes; a real `ipwarden controller` process fills them.
type controllerBench struct {
	nodes, perNode, parallel int
	cidr                     string
	bin                      string
	cp                       *controlplane.ControlPlane
	c                        client.Client
	log                      func(string, ...any)
}

func (b *controllerBench) run(ctx context.Context) ([]figure, error) {
	var figs []figure
	b.log("creating pool, %d Nodes and their NodeIPAllocations with %d addresses requested each (hollow agents)", b.nodes, b.perNode)
	pool := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "bench"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:   []ipwardenv1.CIDR{ipwardenv1.CIDR(b.cidr)},
		Scaling: ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250},
	}}
	if err := b.c.Create(ctx, pool); err != nil {
		return nil, err
	}
	start := time.Now()
	err := b.forEachNode(ctx, func(name string) error {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := b.c.Create(ctx, n); err != nil {
			return err
		}
		a := &ipwardenv1.NodeIPAllocation{
			ObjectMeta: metav1.ObjectMeta{Name: name, OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: name, UID: n.UID}}},
			Spec:       ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "bench", Requested: int32(b.perNode)}}},
		}
		return b.c.Create(ctx, a)
	})
	if err != nil {
		return nil, err
	}
	b.log("created %d nodes in %s", b.nodes, time.Since(start).Round(time.Millisecond))

	// Cold fill: a controller starts on a cluster whose every node asks for addresses.
	proc, err := b.startController(ctx, "--resync-period=10s")
	if err != nil {
		return nil, err
	}
	want := int64(b.nodes * b.perNode)
	if err := b.waitAllocated(ctx, want, 10*time.Minute); err != nil {
		proc.stop()
		return nil, err
	}
	fill := time.Since(proc.started)
	figs = append(figs, figure{fmt.Sprintf("cold fill: %d nodes, %d addresses", b.nodes, want), fill.Round(time.Millisecond).String(), "(informational)", true})

	// Idle full passes: CPU the controller spends per 10 s resync of the whole fleet.
	cpu0 := proc.cpu()
	idle := 30 * time.Second
	b.log("measuring idle CPU over %s (3 full passes)", idle)
	select {
	case <-time.After(idle):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	perPass := (proc.cpu() - cpu0) / 3
	figs = append(figs, figure{fmt.Sprintf("full resync pass (CPU, %d nodes, nothing to change)", b.nodes), perPass.Round(time.Millisecond).String(), "(backstop, once a minute)", true})

	// One dirty node, end to end through the API server.
	var lat []time.Duration
	for i := range 20 {
		name := fmt.Sprintf("bench-%05d", (i*7919)%b.nodes)
		req := int32(b.perNode + 16*(1+i%2))
		t0 := time.Now()
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			a := &ipwardenv1.NodeIPAllocation{}
			if err := b.c.Get(ctx, client.ObjectKey{Name: name}, a); err != nil {
				return err
			}
			a.Spec.Pools[0].Requested = req
			return b.c.Update(ctx, a)
		}); err != nil {
			return nil, err
		}
		if err := localcluster.WaitFor(ctx, time.Minute, 2*time.Millisecond, func() error {
			a := &ipwardenv1.NodeIPAllocation{}
			if err := b.c.Get(ctx, client.ObjectKey{Name: name}, a); err != nil {
				return err
			}
			if len(a.Status.Pools) != 1 || a.Status.Pools[0].Held != req {
				return fmt.Errorf("node %s not filled to %d", name, req)
			}
			return nil
		}); err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(t0))
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	figs = append(figs, figure{"one dirty node: spec write to filled status (p50 / max of 20)",
		fmt.Sprintf("%s / %s", lat[len(lat)/2].Round(100*time.Microsecond), lat[len(lat)-1].Round(100*time.Microsecond)), "(informational)", true})

	rss := proc.rss()
	figs = append(figs, figure{"controller resident memory", fmt.Sprintf("%d MiB", rss>>20), "< 300 MiB", rss < 300<<20})
	proc.stop()

	// Cold start: a new controller on the filled cluster rebuilds its state and serves.
	proc, err = b.startController(ctx)
	if err != nil {
		return nil, err
	}
	defer proc.stop()
	if err := proc.waitLog(ctx, `"msg":"controller serving"`, 5*time.Minute); err != nil {
		return nil, err
	}
	cold := time.Since(proc.started)
	figs = append(figs, figure{fmt.Sprintf("cold start: rebuild %d addresses and serve", want), cold.Round(time.Millisecond).String(), "< 10s", cold < 10*time.Second})
	return figs, nil
}

func (b *controllerBench) forEachNode(ctx context.Context, f func(string) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, b.parallel)
	for range b.parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(b.nodes) || ctx.Err() != nil {
					return
				}
				if err := f(fmt.Sprintf("bench-%05d", i)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func (b *controllerBench) waitAllocated(ctx context.Context, want int64, timeout time.Duration) error {
	last := time.Now()
	return localcluster.WaitFor(ctx, timeout, 50*time.Millisecond, func() error {
		p := &ipwardenv1.IPPool{}
		if err := b.c.Get(ctx, client.ObjectKey{Name: "bench"}, p); err != nil {
			return err
		}
		if p.Status.Allocated >= want {
			return nil
		}
		if time.Since(last) > 5*time.Second {
			b.log("  %d of %d addresses allocated", p.Status.Allocated, want)
			last = time.Now()
		}
		return fmt.Errorf("pool not filled to %d: %d allocated", want, p.Status.Allocated)
	})
}

// benchProc is a controller process of the bench and when it started.
type benchProc struct {
	*localcluster.Process
	started time.Time
}

func (b *controllerBench) startController(ctx context.Context, extra ...string) (*benchProc, error) {
	logPath := filepath.Join(b.cp.Dir, fmt.Sprintf("controller-%d.log", time.Now().UnixNano()))
	args := append([]string{"controller", "--kubeconfig", b.cp.Kubeconfig, "--leader-elect=false", "--claim-settle=100ms", "--pool-settle=-1s",
		"--metrics-bind-address=0", "--health-probe-bind-address=0"}, extra...)
	started := time.Now()
	p, err := localcluster.Start("controller", b.bin, logPath, args...)
	if err != nil {
		return nil, err
	}
	return &benchProc{Process: p, started: started}, nil
}

func (p *benchProc) stop() { p.Stop() }

func (p *benchProc) waitLog(ctx context.Context, s string, timeout time.Duration) error {
	var exited bool
	err := localcluster.WaitFor(ctx, timeout, 5*time.Millisecond, func() error {
		if strings.Contains(p.LogTail(1<<20), s) {
			return nil
		}
		if exited = !p.Running(); exited {
			return nil
		}
		return fmt.Errorf("no %q in the controller log", s)
	})
	if exited {
		return fmt.Errorf("controller exited; log %s", p.Log)
	}
	return err
}

// cpu is the process's user+system CPU time so far.
func (p *benchProc) cpu() time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Pid()))
	if err != nil {
		return 0
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseInt(fields[11], 10, 64)
	st, _ := strconv.ParseInt(fields[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100 // USER_HZ
}

// rss is the process's resident set size in bytes.
func (p *benchProc) rss() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.Pid()))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			kb, _ := strconv.ParseInt(strings.Fields(line)[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}
