package localcluster

import (
	"fmt"
	"strings"
	"testing"
)

func TestAPIWrites(t *testing.T) {
	for _, tc := range []struct {
		name, metrics string
		want          string // fmt of the map
		err           bool
	}{
		{"empty", "", "map[]", false},
		{"reads and other metrics are left out", `# HELP apiserver_request_total x
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="LIST",version="v1"} 7
apiserver_request_total_other{verb="POST",resource="pods"} 3
apiserver_requested_deprecated_apis{group="",resource="pods",verb="POST"} 1
`, "map[]", false},
		{"writes per resource, group and subresource, any code", `apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1"} 100
apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="status",verb="PATCH",version="v1"} 5
apiserver_request_total{code="200",component="apiserver",dry_run="",group="whereabouts.cni.cncf.io",resource="ippools",scope="namespace",subresource="",verb="PATCH",version="v1alpha1"} 4.5e+01
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="PUT",version="v1"} 3
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="DELETE",version="v1"} 1
apiserver_request_total{code="200",component="apiserver",dry_run="",group="ipwarden.io",resource="nodeipallocations",scope="cluster",subresource="status",verb="APPLY",version="v1alpha1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="DELETECOLLECTION",version="v1"} 1
`, "map[ippools.whereabouts.cni.cncf.io:45 leases.coordination.k8s.io:4 nodeipallocations.ipwarden.io/status:2 pods:103 pods/status:5]", false},
		{"a bad value is an error", `apiserver_request_total{group="",resource="pods",verb="POST"} x`, "", true},
		{"a line with no closing brace is an error", `apiserver_request_total{group="",resource="pods",verb="POST" 1`, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := APIWrites(strings.NewReader(tc.metrics))
			if (err != nil) != tc.err {
				t.Fatalf("err = %v, want error %v", err, tc.err)
			}
			if err == nil && fmt.Sprint(got) != tc.want {
				t.Fatalf("got %v, want %s", got, tc.want)
			}
		})
	}
}

func TestDiffWrites(t *testing.T) {
	got := DiffWrites(map[string]float64{"pods": 10, "leases.coordination.k8s.io": 4},
		map[string]float64{"pods": 110, "leases.coordination.k8s.io": 4, "ippools.whereabouts.cni.cncf.io": 3})
	if want := "map[ippools.whereabouts.cni.cncf.io:3 pods:100]"; fmt.Sprint(got) != want {
		t.Fatalf("got %v, want %s", got, want)
	}
}
