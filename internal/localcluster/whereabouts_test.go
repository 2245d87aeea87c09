package localcluster

import (
	"encoding/json"
	"fmt"
	"testing"
)

// Whereabouts' objects as the API server returns them: the IPPool's allocations are offsets from
// its range's address (whereabouts v0.9.4 toAllocationMap), an OverlappingRangeIPReservation is
// named for its address.
func TestWhereaboutsReservations(t *testing.T) {
	var pool, orip map[string]any
	if err := json.Unmarshal([]byte(`{"metadata": {"name": "10.244.0.0-24", "namespace": "kube-system"},
		"spec": {"range": "10.244.0.0/24", "allocations": {
			"12": {"id": "c12", "podref": "ns/b", "ifname": "eth0"},
			"10": {"id": "c10", "podref": "ns/a", "ifname": "eth0"},
			"256": {"id": "c256", "podref": "ns/c"}}}}`), &pool); err != nil {
		t.Fatal(err)
	}
	got, err := WhereaboutsPoolReservations(pool)
	if err != nil {
		t.Fatal(err)
	}
	if want := "[10.244.0.10=ns/a/c10 10.244.0.12=ns/b/c12 10.244.1.0=ns/c/c256]"; fmt.Sprint(got) != want {
		t.Fatalf("pool reservations %v, want %s", got, want)
	}
	if _, err := WhereaboutsPoolReservations(map[string]any{"spec": map[string]any{"range": "10.244.0.0/24", "allocations": map[string]any{"x": map[string]any{}}}}); err == nil {
		t.Fatal("an offset that is no number was accepted")
	}
	if err := json.Unmarshal([]byte(`{"metadata": {"name": "fd00--a"}, "spec": {"containerid": "c1", "podref": "ns/a", "ifname": "eth0"}}`), &orip); err != nil {
		t.Fatal(err)
	}
	r, err := WhereaboutsOverlappingReservation(orip)
	if err != nil || r.String() != "fd00::a=ns/a/c1" {
		t.Fatalf("overlapping reservation %v %v, want fd00::a=ns/a/c1", r, err)
	}
}
