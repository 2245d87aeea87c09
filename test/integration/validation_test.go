package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

var objCounter atomic.Int64

// createYAML submits an object as a user would with kubectl: YAML, given a fresh name.
func createYAML(ctx context.Context, t *testing.T, kind, body string) (*unstructured.Unstructured, error) {
	t.Helper()
	name := fmt.Sprintf("v-%d", objCounter.Add(1))
	doc := fmt.Sprintf("apiVersion: ipwarden.io/v1alpha1\nkind: %s\nmetadata:\n  name: %s\n%s", kind, name, body)
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
		t.Fatalf("test YAML: %v\n%s", err, doc)
	}
	err := k8s.Create(ctx, u)
	if err == nil {
		t.Cleanup(func() { _ = k8s.Delete(context.Background(), u) })
	}
	return u, err
}

func TestIPPoolValidation(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		spec    string
		wantErr []string // every fragment must appear; empty means accepted
	}{
		{name: "valid IPv4 pool", spec: `
spec:
  cidrs: [10.244.0.0/16, 10.245.0.0/24]
  exclude: [10.244.0.1, 10.244.255.0/24]
  gateway: 10.244.0.1
  routes: [{dst: 0.0.0.0/0}]`},
		{name: "valid IPv6 pool", spec: `
spec:
  cidrs: ["fd00:10::/64"]
  exclude: ["fd00:10::1"]
  gateway: "fd00:10::1"
  scaling: {batchSize: 8, bufferPercent: 0, maxPerNode: 8}
  reuseCooldown: 1m30s`},
		{name: "zero cooldown is allowed", spec: `
spec:
  cidrs: [10.1.0.0/24]
  reuseCooldown: "0s"`},
		{name: "unparsable CIDR", spec: `
spec:
  cidrs: [10.0.0.0/33]`, wantErr: []string{`"10.0.0.0/33" is not a CIDR`}},
		{name: "not an address at all", spec: `
spec:
  cidrs: [pods]`, wantErr: []string{`"pods" is not a CIDR`}},
		{name: "CIDR with host bits", spec: `
spec:
  cidrs: [10.0.0.1/24]`, wantErr: []string{`"10.0.0.1/24" has host bits set: write the network address`}},
		{name: "no CIDRs", spec: `
spec:
  cidrs: []`, wantErr: []string{"spec.cidrs", "at least 1 items"}},
		{name: "mixed families", spec: `
spec:
  cidrs: [10.0.0.0/24, "fd00::/64"]`, wantErr: []string{"all cidrs of a pool must be of one family"}},
		{name: "exclusion outside the pool", spec: `
spec:
  cidrs: [10.0.0.0/24]
  exclude: [10.0.0.5, 192.168.1.0/24, 10.0.1.1]`, wantErr: []string{"every exclude entry must lie inside one of the pool's cidrs"}},
		{name: "exclusion that is not an address", spec: `
spec:
  cidrs: [10.0.0.0/24]
  exclude: [10.0.0.300]`, wantErr: []string{`"10.0.0.300" is neither an IP address nor a CIDR`}},
		{name: "batchSize zero", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {batchSize: 0}`, wantErr: []string{"spec.scaling.batchSize", "greater than or equal to 1"}},
		{name: "maxPerNode below batchSize", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {batchSize: 16, maxPerNode: 8}`, wantErr: []string{"maxPerNode must be at least batchSize"}},
		{name: "maxPerNode below default batchSize", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {maxPerNode: 4}`, wantErr: []string{"maxPerNode must be at least batchSize"}},
		{name: "bufferPercent above 100", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {bufferPercent: 101}`, wantErr: []string{"spec.scaling.bufferPercent", "less than or equal to 100"}},
		{name: "bufferPercent negative", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {bufferPercent: -1}`, wantErr: []string{"spec.scaling.bufferPercent", "greater than or equal to 0"}},
		{name: "releaseSlackPercent above 1000", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {releaseSlackPercent: 1001}`, wantErr: []string{"spec.scaling.releaseSlackPercent", "less than or equal to 1000"}},
		{name: "releaseDelay negative", spec: `
spec:
  cidrs: [10.0.0.0/24]
  scaling: {releaseDelay: -3m}`, wantErr: []string{`releaseDelay "-3m" must be a non-negative duration`}},
		{name: "negative cooldown", spec: `
spec:
  cidrs: [10.0.0.0/24]
  reuseCooldown: -5s`, wantErr: []string{`reuseCooldown "-5s" must be a non-negative duration`}},
		{name: "cooldown without unit", spec: `
spec:
  cidrs: [10.0.0.0/24]
  reuseCooldown: "30"`, wantErr: []string{`reuseCooldown "30" must be a non-negative duration`}},
		{name: "gateway of the other family", spec: `
spec:
  cidrs: [10.0.0.0/24]
  gateway: "fd00::1"`, wantErr: []string{"gateway must be of the pool's address family"}},
		{name: "gateway not an address", spec: `
spec:
  cidrs: [10.0.0.0/24]
  gateway: router`, wantErr: []string{`"router" is not an IP address`}},
		{name: "route to a bad network", spec: `
spec:
  cidrs: [10.0.0.0/24]
  routes: [{dst: 0.0.0.0/-1}]`, wantErr: []string{`"0.0.0.0/-1" is not a CIDR`}},
		{name: "missing spec", spec: "", wantErr: []string{"spec: Required value"}},
		{name: "valid node selector", spec: `
spec:
  cidrs: [10.2.0.0/24]
  nodeSelector:
    matchLabels: {pool: a}
    matchExpressions: [{key: zone, operator: In, values: [z1]}, {key: gpu, operator: DoesNotExist}]`},
		{name: "node selector with an unknown operator", spec: `
spec:
  cidrs: [10.0.0.0/24]
  nodeSelector:
    matchExpressions: [{key: zone, operator: Equals, values: [z1]}]`, wantErr: []string{"operator must be In, NotIn, Exists or DoesNotExist"}},
		{name: "node selector In without values", spec: `
spec:
  cidrs: [10.0.0.0/24]
  nodeSelector:
    matchExpressions: [{key: zone, operator: In}]`, wantErr: []string{"In and NotIn need values"}},
		{name: "route via a bad next hop", spec: `
spec:
  cidrs: [10.0.0.0/24]
  routes: [{dst: 0.0.0.0/0, gw: gateway}]`, wantErr: []string{`"gateway" is not an IP address`}},
		{name: "too many cidrs", spec: `
spec:
  cidrs: [` + manyCIDRs(33) + `]`, wantErr: []string{"spec.cidrs", "must have at most 32 items"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := createYAML(ctx, t, "IPPool", tc.spec)
			if len(tc.wantErr) == 0 {
				if err != nil {
					t.Fatalf("valid pool rejected: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("invalid pool accepted; want an error containing %q", tc.wantErr)
			}
			for _, frag := range tc.wantErr {
				if !strings.Contains(err.Error(), frag) {
					t.Fatalf("error %q\ndoes not contain %q", err, frag)
				}
			}
		})
	}
}

func TestIPPoolDefaults(t *testing.T) {
	ctx := context.Background()
	u, err := createYAML(ctx, t, "IPPool", "spec:\n  cidrs: [10.50.0.0/16]\n")
	if err != nil {
		t.Fatal(err)
	}
	var pool ipwardenv1.IPPool
	if err := k8s.Get(ctx, client.ObjectKey{Name: u.GetName()}, &pool); err != nil {
		t.Fatal(err)
	}
	sc := pool.Spec.Scaling
	if sc.BatchSize != 16 || sc.BufferPercent != 50 || sc.MaxPerNode != 250 ||
		sc.ReleaseSlackPercent == nil || *sc.ReleaseSlackPercent != 100 || sc.ReleaseDelay == nil || sc.ReleaseDelay.Duration != 3*time.Minute {
		t.Errorf("scaling defaults = %+v, want batch 16, buffer 50, maxPerNode 250, releaseSlackPercent 100, releaseDelay 3m", sc)
	}
	if pool.Spec.ReuseCooldown.Duration != 30*time.Second {
		t.Errorf("reuseCooldown default = %v, want 30s", pool.Spec.ReuseCooldown.Duration)
	}
}

func TestNodeIPAllocationValidation(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		body    string
		wantErr []string
	}{
		{name: "valid spec", body: `
spec:
  pools:
  - pool: pods-v4
    requested: 32
    releasing: [10.0.0.5, 10.0.0.8/30, 10.0.0.20-10.0.0.29]
  - pool: pods-v6
    requested: 16
    releasing: ["fd00::5"]`},
		{name: "empty spec", body: "spec: {}"},
		{name: "negative request", body: `
spec:
  pools: [{pool: a, requested: -1}]`, wantErr: []string{"spec.pools[0].requested", "greater than or equal to 0"}},
		{name: "releasing garbage", body: `
spec:
  pools: [{pool: a, requested: 1, releasing: [10.0.0.5-]}]`, wantErr: []string{`"10.0.0.5-" is not an address, a CIDR or a range`}},
		{name: "pool listed twice", body: `
spec:
  pools: [{pool: a, requested: 1}, {pool: a, requested: 2}]`, wantErr: []string{"Duplicate value"}},
		{name: "pool name missing", body: `
spec:
  pools: [{requested: 1}]`, wantErr: []string{"spec.pools[0].pool: Required value"}},
		{name: "request above the maximum", body: `
spec:
  pools: [{pool: a, requested: 70000}]`, wantErr: []string{"spec.pools[0].requested", "less than or equal to 65536"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := createYAML(ctx, t, "NodeIPAllocation", tc.body)
			if len(tc.wantErr) == 0 {
				if err != nil {
					t.Fatalf("valid object rejected: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("invalid object accepted; want an error containing %q", tc.wantErr)
			}
			for _, frag := range tc.wantErr {
				if !strings.Contains(err.Error(), frag) {
					t.Fatalf("error %q\ndoes not contain %q", err, frag)
				}
			}
		})
	}
}

// TestPrinterColumns reads the tables kubectl shows for `kubectl get ippools,nodeipallocations`.
func TestPrinterColumns(t *testing.T) {
	ctx := context.Background()
	pool, err := createYAML(ctx, t, "IPPool", "spec:\n  cidrs: [10.60.0.0/24]\n")
	if err != nil {
		t.Fatal(err)
	}
	var p ipwardenv1.IPPool
	if err := k8s.Get(ctx, client.ObjectKey{Name: pool.GetName()}, &p); err != nil {
		t.Fatal(err)
	}
	p.Status = ipwardenv1.IPPoolStatus{Capacity: 256, Allocated: 48, Free: 208, Nodes: 3,
		Conditions: []metav1.Condition{{Type: ipwardenv1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Serving", LastTransitionTime: metav1.Now()}}}
	if err := k8s.Status().Update(ctx, &p); err != nil {
		t.Fatal(err)
	}
	nipa, err := createYAML(ctx, t, "NodeIPAllocation", "spec:\n  pools: [{pool: a, requested: 32}, {pool: b, requested: 16}]\n")
	if err != nil {
		t.Fatal(err)
	}
	var n ipwardenv1.NodeIPAllocation
	if err := k8s.Get(ctx, client.ObjectKey{Name: nipa.GetName()}, &n); err != nil {
		t.Fatal(err)
	}
	n.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "a", Addresses: []string{"10.0.0.0/27"}, Held: 32}, {Pool: "b", Addresses: []string{"10.1.0.0/29", "10.1.0.9-10.1.0.12"}, Held: 12}}
	n.Status.Held = 44
	n.Status.Summary = ipwardenv1.Summarize(n.Spec, n.Status)
	if err := k8s.Status().Update(ctx, &n); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		resource, name string
		want           map[string]string
	}{
		{"ippools", pool.GetName(), map[string]string{"CIDRs": `["10.60.0.0/24"]`, "Capacity": "256", "Allocated": "48", "Free": "208", "Nodes": "3", "Exhausted": "false", "Ready": "True"}},
		{"nodeipallocations", nipa.GetName(), map[string]string{"Held/Requested": "a 32/32, b 12/16", "Held": "44"}},
	} {
		t.Run(tc.resource, func(t *testing.T) {
			got := getTable(ctx, t, tc.resource, tc.name)
			for col, want := range tc.want {
				if got[col] != want {
					t.Errorf("column %s = %q, want %q (table %v)", col, got[col], want, got)
				}
			}
		})
	}
}

// getTable asks the API server for the server-side table of one object, as kubectl get does.
func getTable(ctx context.Context, t *testing.T, resource, name string) map[string]string {
	t.Helper()
	cfg := rest.CopyConfig(restConfig)
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cfg.Host+"/apis/ipwarden.io/v1alpha1/"+resource+"/"+name, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var table metav1.Table
	if err := json.NewDecoder(resp.Body).Decode(&table); err != nil {
		t.Fatal(err)
	}
	if len(table.Rows) != 1 {
		t.Fatalf("table has %d rows, want 1", len(table.Rows))
	}
	out := map[string]string{}
	for i, col := range table.ColumnDefinitions {
		v := table.Rows[0].Cells[i]
		switch v := v.(type) {
		case string:
			out[col.Name] = v
		default:
			b, _ := json.Marshal(v)
			out[col.Name] = string(b)
		}
	}
	return out
}

func manyCIDRs(n int) string {
	var parts []string
	for i := range n {
		parts = append(parts, fmt.Sprintf("10.%d.0.0/24", i))
	}
	return strings.Join(parts, ", ")
}

// The status is the controller's: the API still rejects addresses that are not address text.
func TestNodeIPAllocationStatusShape(t *testing.T) {
	ctx := context.Background()
	u, err := createYAML(ctx, t, "NodeIPAllocation", "spec: {}\n")
	if err != nil {
		t.Fatal(err)
	}
	var n ipwardenv1.NodeIPAllocation
	if err := k8s.Get(ctx, client.ObjectKey{Name: u.GetName()}, &n); err != nil {
		t.Fatal(err)
	}
	n.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "a", Addresses: []string{"10.0.0.0/28; rm -rf"}, Held: 16}}
	err = k8s.Status().Update(ctx, &n)
	if err == nil || !strings.Contains(err.Error(), "status.pools[0].addresses[0]") {
		t.Fatalf("malformed status address accepted or unclear: %v", err)
	}
}
