package main

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// newPool (issue 31): with 1 % of the agents stopped (nodes down, or a DaemonSet rolling out:
// their NodeIPAllocations stay, nobody reports for them), how long the first pod on a running
// node waits for an address of a pool created then (the controller's --pool-settle is its
// default, 60 s): a pool over every node (the stopped ones among them), a pool over that one
// running node alone, and that pool grown by a CIDR while its only address is in use. Each is
// timed from the IPPool write to the pod's successful ADD, as a runtime retries a failed sandbox,
// on a controller with nothing else to write (the pool over every node makes every agent ask for
// addresses ahead; those fills end before the next change).
func (s *scaleRun) newPool(ctx context.Context) ([]figure, error) {
	n := len(s.agents.cfgs)
	down := max(n/100, 1)
	var stopped []int
	for k := range down {
		stopped = append(stopped, k*(n/down)+(n/down)/2) // spread, never node 0
	}
	for _, i := range stopped {
		s.agents.stop(i)
	}
	defer func() {
		for _, i := range stopped {
			s.agents.start(i)
		}
	}()
	s.log("new pool: %d of %d agents stopped (%v)", down, n, stopped)

	c := s.env.c
	req0, err := apiRequests(ctx, s.env.cp.Config)
	if err != nil {
		return nil, err
	}
	scaling := ipwardenv1.Scaling{BatchSize: 1, BufferPercent: 0, MaxPerNode: 16, ReleaseDelay: &metav1.Duration{}}
	pool := func(name string, cidr ipwardenv1.CIDR, sel map[string]string) *ipwardenv1.IPPool {
		return &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.IPPoolSpec{
			CIDRs: []ipwardenv1.CIDR{cidr}, Scaling: scaling, NodeSelector: &metav1.LabelSelector{MatchLabels: sel}}}
	}
	// firstAdd ADDs a new pod on node 0 from pool until it succeeds, timed from since.
	firstAdd := func(pod, pool string, since time.Time) (time.Duration, int, error) {
		p, err := createPod(ctx, c, scaleNode(0), pod)
		if err != nil {
			return 0, 0, err
		}
		failed := 0
		for try := 0; ; try++ {
			req := cniproto.Request{Op: cniproto.OpAdd, ContainerID: fmt.Sprintf("sandbox-%s-%d", pod, try), IfName: "eth0", Netns: "/proc/self/ns/net",
				Network: "bench", Pools: []string{pool}, Pod: cniproto.Pod{Namespace: "default", Name: p.name, UID: p.uid}}
			actx, cancel := context.WithTimeout(ctx, 90*time.Second)
			resp, err := cniproto.Call(actx, s.agents.sockets[0], req)
			cancel()
			if err == nil && resp.Error == nil {
				return time.Since(since), failed, nil
			}
			failed++
			if time.Since(since) > 3*time.Minute {
				return 0, failed, fmt.Errorf("no address of pool %s for pod %s after 3 minutes: %v %v", pool, pod, err, resp)
			}
			select {
			case <-ctx.Done():
				return 0, failed, ctx.Err()
			case <-time.After(100 * time.Millisecond): // the runtime's retry of a failed sandbox
			}
		}
	}

	// A pool over every node.
	all := pool("bench-newpool-all", "10.80.0.0/16", map[string]string{"ipwarden.io/bench-pool": "bench-scale"})
	t0 := time.Now()
	if err := c.Create(ctx, all); err != nil {
		return nil, err
	}
	waitAll, failAll, err := firstAdd("newpool-all", all.Name, t0)
	if err != nil {
		return nil, err
	}
	// The other nodes' fills from that pool (each agent asks for addresses ahead) finish first: the
	// next change is timed on a quiet controller.
	if err := settle(ctx, s.env.cp.Config, 3*time.Second, 3*time.Minute); err != nil {
		return nil, err
	}
	// A pool over node 0 alone.
	var node corev1.Node
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := c.Get(ctx, client.ObjectKey{Name: scaleNode(0)}, &node); err != nil {
			return err
		}
		node.Labels["ipwarden.io/bench-newpool"] = "one"
		return c.Update(ctx, &node)
	}); err != nil {
		return nil, err
	}
	one := pool("bench-newpool-one", "10.81.0.1/32", map[string]string{"ipwarden.io/bench-newpool": "one"})
	t0 = time.Now()
	if err := c.Create(ctx, one); err != nil {
		return nil, err
	}
	waitOne, failOne, err := firstAdd("newpool-one", one.Name, t0)
	if err != nil {
		return nil, err
	}
	if err := settle(ctx, s.env.cp.Config, 3*time.Second, 3*time.Minute); err != nil {
		return nil, err
	}
	// That pool grows by a CIDR while its one address is in use.
	t0 = time.Now()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error { // the controller writes its status
		if err := c.Get(ctx, client.ObjectKeyFromObject(one), one); err != nil {
			return err
		}
		one.Spec.CIDRs = append(one.Spec.CIDRs, "10.81.0.2/32")
		return c.Update(ctx, one)
	}); err != nil {
		return nil, err
	}
	waitGrown, failGrown, err := firstAdd("newpool-grown", one.Name, t0)
	if err != nil {
		return nil, err
	}
	req1, err := apiRequests(ctx, s.env.cp.Config)
	if err != nil {
		return nil, err
	}
	reqs := req1.sub(req0)
	s.log("new pool with %d agents down: over every node, first ADD after %s (%d failed tries); over one running node %s (%d); grown by a CIDR %s (%d)",
		down, waitAll.Round(time.Millisecond), failAll, waitOne.Round(time.Millisecond), failOne, waitGrown.Round(time.Millisecond), failGrown)
	goal := "well under --pool-settle 60s (the wait before)"
	name := func(what string) string {
		return fmt.Sprintf("scale %d nodes, %d agents down (1 %%): %s", n, down, what)
	}
	return []figure{
		{name: name("new pool over every node, first pod's wait"), value: waitAll.Round(time.Millisecond).String(), goal: goal, ok: waitAll < 30*time.Second},
		{name: name("new pool over one running node, first pod's wait"), value: waitOne.Round(time.Millisecond).String(), goal: goal, ok: waitOne < 30*time.Second},
		{name: name("that pool grown by a CIDR, next pod's wait"), value: waitGrown.Round(time.Millisecond).String(), goal: goal, ok: waitGrown < 30*time.Second},
		{name: name("the three pool changes: LISTs of pods (the controller's reads of silent nodes), agents' spec PATCHes, status PUTs"),
			value: fmt.Sprintf("%.0f / %.0f / %.0f", reqs.of("LIST", "pods"), reqs.of("PATCH", "nodeipallocations"), reqs.of("PUT", "nodeipallocations/status")),
			goal:  "(informational)", ok: true},
	}, nil
}
