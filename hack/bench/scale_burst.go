package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// The scale bench's burst (issue 30): each node's pods bound at the same moment, as a scheduler
// binds a large ReplicaSet's pods, and their ADDs sent to that node's agent at once, as its
// kubelet starts their sandboxes; burstNodes nodes burst at once, the next node starting as one
// ends, until every node has.

// nodeBurst is one node's burst.
type nodeBurst struct {
	pods   []podRef
	lat    []time.Duration // each ADD's latency, in pods' order
	failed int
	errs   []string      // the failed ADDs' errors
	bound  time.Duration // from the first create to the last pod bound
	took   time.Duration // from the first create to the last ADD answered
}

// burstNode binds the node's pods at once (every create at the same moment), then, once all are
// bound, sends all their ADDs to the node's agent at once. A create that fails is an error; an
// ADD that fails is counted.
func (s *scaleRun) burstNode(ctx context.Context, node int, tag string) (nodeBurst, error) {
	n := s.o.pods
	b := nodeBurst{pods: make([]podRef, n), lat: make([]time.Duration, n)}
	errs := make([]error, n)
	t0 := time.Now()
	var wg sync.WaitGroup
	for k := range n {
		wg.Go(func() {
			name := fmt.Sprintf("%s-%d-%d", tag, node, k)
			p, err := createPod(ctx, s.env.c, scaleNode(node), name)
			b.pods[k], errs[k] = podRef{node: node, name: name, uid: p.uid}, err
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return b, fmt.Errorf("bind the pods of %s: %w", scaleNode(node), err)
	}
	b.bound = time.Since(t0)
	addErrs := make([]error, n)
	for k := range n {
		wg.Go(func() { b.lat[k], addErrs[k] = s.add(ctx, b.pods[k]) })
	}
	wg.Wait()
	b.took = time.Since(t0)
	for k, err := range addErrs {
		if err != nil {
			b.failed++
			b.errs = append(b.errs, fmt.Sprintf("%s: %v", b.pods[k].name, err))
		}
	}
	return b, nil
}

// add sends the pod's ADD (sandbox "sandbox-<name>") to its node's agent over the socket, as
// the plugin does, and returns how long the agent took to answer.
func (s *scaleRun) add(ctx context.Context, p podRef) (time.Duration, error) {
	req := cniproto.Request{Op: cniproto.OpAdd, ContainerID: "sandbox-" + p.name, IfName: "eth0", Netns: "/proc/self/ns/net",
		Network: "bench", Pod: cniproto.Pod{Namespace: "default", Name: p.name, UID: p.uid}}
	actx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	start := time.Now()
	resp, err := cniproto.Call(actx, s.agents.sockets[p.node], req)
	d := time.Since(start)
	if err == nil && resp.Error != nil {
		err = errors.New(resp.Error.Msg)
	}
	return d, err
}

// burstResult is the whole fleet's burst.
type burstResult struct {
	pods        []podRef
	lat         []time.Duration // every ADD's latency, sorted
	bound, took []time.Duration // each node's, sorted
	failed      int
	errs        []string // the failed ADDs' errors, the first few
}

// burstAll runs every node's burst, par nodes at once.
func (s *scaleRun) burstAll(ctx context.Context, par int, tag string) (burstResult, error) {
	nodes := len(s.agents.sockets)
	each := make([]nodeBurst, nodes)
	err := forEach(ctx, nodes, max(par, 1), func(i int) error {
		var err error
		each[i], err = s.burstNode(ctx, i, tag)
		return err
	})
	var r burstResult
	for _, b := range each {
		r.pods = append(r.pods, b.pods...)
		r.lat = append(r.lat, b.lat...)
		r.bound, r.took = append(r.bound, b.bound), append(r.took, b.took)
		r.failed += b.failed
		if room := 5 - len(r.errs); room > 0 {
			r.errs = append(r.errs, b.errs[:min(room, len(b.errs))]...)
		}
	}
	for _, ds := range [][]time.Duration{r.lat, r.bound, r.took} {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	}
	return r, err
}

// histogram is a Prometheus histogram: cumulative counts by upper bound, ascending (+Inf last),
// its count and its sum.
type histogram struct {
	bounds, cum []float64
	count, sum  float64
}

// histogramOf reads histogram name from one scrape: the series whose labels are exactly label
// (`op="ADD"`; "" for none) and le.
func histogramOf(m metrics, name, label string) histogram {
	series, prefix := "", name+`_bucket{le="`
	if label != "" {
		series, prefix = "{"+label+"}", name+"_bucket{"+label+`,le="`
	}
	h := histogram{count: m[name+"_count"+series], sum: m[name+"_sum"+series]}
	type bucket struct{ le, n float64 }
	var bs []bucket
	for k, v := range m {
		le, ok := strings.CutPrefix(k, prefix)
		if !ok {
			continue
		}
		le = strings.TrimSuffix(le, `"}`)
		b, err := strconv.ParseFloat(le, 64) // "+Inf" parses as +Inf
		if err != nil {
			continue
		}
		bs = append(bs, bucket{b, v})
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].le < bs[j].le })
	for _, b := range bs {
		h.bounds, h.cum = append(h.bounds, b.le), append(h.cum, b.n)
	}
	return h
}

// plus adds o's counts to h's; both must have the same buckets (the same metric), or h is empty.
func (h histogram) plus(o histogram, sign float64) histogram {
	if len(h.bounds) == 0 && sign > 0 {
		h.bounds = append([]float64(nil), o.bounds...)
		h.cum = make([]float64, len(o.cum))
	}
	out := histogram{bounds: h.bounds, cum: append([]float64(nil), h.cum...), count: h.count + sign*o.count, sum: h.sum + sign*o.sum}
	for i := range out.cum {
		if i < len(o.cum) {
			out.cum[i] += sign * o.cum[i]
		}
	}
	return out
}

// quantile is the upper bound of the bucket holding the q-th observation (0 when empty; +Inf
// when it lies above the last finite bound).
func (h histogram) quantile(q float64) float64 {
	if h.count <= 0 {
		return 0
	}
	rank := math.Ceil(q * h.count)
	for i, c := range h.cum {
		if c >= rank {
			return h.bounds[i]
		}
	}
	return math.Inf(1)
}

// over is how many observations exceed bound (bound one of the bucket bounds).
func (h histogram) over(bound float64) float64 {
	for i, b := range h.bounds {
		if b == bound {
			return h.count - h.cum[i]
		}
	}
	return h.count
}

// fmtBound prints a bucket bound in seconds as a duration ("<= 50ms"), +Inf as "> the last".
func fmtBound(h histogram, b float64) string {
	if math.IsInf(b, 1) {
		last := 0.0
		if n := len(h.bounds); n > 1 {
			last = h.bounds[n-2]
		}
		return "> " + time.Duration(last*float64(time.Second)).String()
	}
	if b == 0 {
		return "0"
	}
	return "<= " + time.Duration(b*float64(time.Second)).String()
}
