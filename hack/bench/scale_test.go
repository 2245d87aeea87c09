package main

import (
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
