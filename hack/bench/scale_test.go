package main

import (
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseRequestsAndWatches(t *testing.T) {
	body := `# HELP apiserver_request_total x
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 30
apiserver_request_total{code="409",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="ipwarden.io",resource="nodeipallocations",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 5
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="POST",version="v1"} 100
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="LIST",version="v1"} 7
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="WATCH",version="v1"} 10
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="cluster",subresource="",verb="WATCH",version="v1"} 2
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="exec",verb="CONNECT",version="v1"} 1
`
	r := parseRequests(body)
	if r[[2]string{"PUT", "leases"}] != 32 || r[[2]string{"PUT", "nodeipallocations/status"}] != 5 || r[[2]string{"LIST", "pods"}] != 7 {
		t.Fatalf("parseRequests = %v", r)
	}
	w := r.writes()
	if w.total() != 137 {
		t.Fatalf("writes total %v (%v)", w.total(), w)
	}
	if got := w.ipwardens().total(); got != 37 {
		t.Fatalf("ipwarden's writes %v", got)
	}
	if got := w.ipwardens().perSecond(10*time.Second, 2); got != "PUT leases 1.600, PUT nodeipallocations/status 0.250" {
		t.Fatalf("perSecond = %q", got)
	}
	before := parseRequests(`apiserver_request_total{resource="leases",subresource="",verb="PUT"} 10`)
	if d := r.sub(before); d[[2]string{"PUT", "leases"}] != 22 {
		t.Fatalf("sub = %v", d)
	}
	ws := parseWatches(body)
	if ws["pods"] != 12 || len(ws) != 1 {
		t.Fatalf("parseWatches = %v", ws)
	}
	if m := ws.sub(watchCounts{"pods": 2}).maxPerNode(5); m != 2 {
		t.Fatalf("maxPerNode = %v", m)
	}
}

func TestIPWaitHistogram(t *testing.T) {
	scrapeOf := func(body string) histogram {
		return histogramOf(parseMetrics(strings.NewReader(body)), "ipwarden_agent_ip_wait_seconds", "")
	}
	// One agent before the burst: 16 ADDs that found an address ready.
	before := scrapeOf(`ipwarden_agent_ip_wait_seconds_bucket{le="0"} 16
ipwarden_agent_ip_wait_seconds_bucket{le="0.1"} 16
ipwarden_agent_ip_wait_seconds_bucket{le="1"} 16
ipwarden_agent_ip_wait_seconds_bucket{le="+Inf"} 16
ipwarden_agent_ip_wait_seconds_sum 0
ipwarden_agent_ip_wait_seconds_count 16
ipwarden_agent_ip_wait_seconds_other 99
`)
	// After: 100 more, of which 80 ready, 18 waited under 100 ms, one under 1 s, one longer.
	after := scrapeOf(`ipwarden_agent_ip_wait_seconds_bucket{le="+Inf"} 116
ipwarden_agent_ip_wait_seconds_bucket{le="0.1"} 114
ipwarden_agent_ip_wait_seconds_bucket{le="0"} 96
ipwarden_agent_ip_wait_seconds_bucket{le="1"} 115
ipwarden_agent_ip_wait_seconds_sum 4
ipwarden_agent_ip_wait_seconds_count 116
`)
	if want := []float64{0, 0.1, 1, math.Inf(1)}; !reflect.DeepEqual(after.bounds, want) {
		t.Fatalf("bounds %v, want %v (ascending, +Inf last)", after.bounds, want)
	}
	var fleet histogram
	fleet = fleet.plus(after, 1).plus(after, 1) // two agents
	d := fleet.plus(before, -1).plus(before, -1)
	if d.count != 200 || d.sum != 8 || d.over(0) != 40 || d.over(0.1) != 4 || d.over(1) != 2 {
		t.Fatalf("the burst's histogram: count %v sum %v over 0 %v over 1s %v", d.count, d.sum, d.over(0), d.over(1))
	}
	for _, tc := range []struct {
		q    float64
		want float64
	}{{0, 0}, {0.5, 0}, {0.8, 0}, {0.81, 0.1}, {0.98, 0.1}, {0.99, 1}, {0.995, math.Inf(1)}, {1, math.Inf(1)}} {
		if got := d.quantile(tc.q); got != tc.want {
			t.Errorf("quantile(%v) = %v, want %v", tc.q, got, tc.want)
		}
	}
	if got := fmtBound(d, d.quantile(1)); got != "> 1s" {
		t.Errorf("fmtBound(max) = %q", got)
	}
	if got := fmtBound(d, 0.1); got != "<= 100ms" {
		t.Errorf("fmtBound(0.1) = %q", got)
	}
	if got := (histogram{}).quantile(0.99); got != 0 {
		t.Errorf("an empty histogram's p99 = %v", got)
	}
	if got := meanSeconds(d); got != "40ms" {
		t.Errorf("meanSeconds = %q", got)
	}
}

func TestHistogramOfLabeled(t *testing.T) {
	m := parseMetrics(strings.NewReader(`ipwarden_agent_cni_request_duration_seconds_bucket{op="ADD",le="0.001"} 3
ipwarden_agent_cni_request_duration_seconds_bucket{op="ADD",le="+Inf"} 5
ipwarden_agent_cni_request_duration_seconds_sum{op="ADD"} 0.5
ipwarden_agent_cni_request_duration_seconds_count{op="ADD"} 5
ipwarden_agent_cni_request_duration_seconds_bucket{op="DEL",le="0.001"} 7
ipwarden_agent_cni_request_duration_seconds_bucket{op="DEL",le="+Inf"} 7
ipwarden_agent_cni_request_duration_seconds_count{op="DEL"} 7
`))
	h := histogramOf(m, "ipwarden_agent_cni_request_duration_seconds", `op="ADD"`)
	if h.count != 5 || h.sum != 0.5 || !reflect.DeepEqual(h.cum, []float64{3, 5}) || h.quantile(0.5) != 0.001 {
		t.Fatalf("ADD histogram %+v", h)
	}
	var sum agentHistograms
	sum = sum.plus(agentHistograms{add: h}, 1).plus(agentHistograms{}, 1) // an agent that did not answer adds nothing
	if sum.add.count != 5 || len(sum.ipWait.bounds) != 0 {
		t.Fatalf("sum %+v", sum)
	}
}
