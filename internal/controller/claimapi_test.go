package controller

import (
	"context"
	"sync"
	"testing"
	"time"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	claimfake "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned/fake"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The driver's IPAMClaim access: without the CRD, Watch says ready at once and keeps looking
// (start-up is not blocked); with it, the claims present are delivered before ready.
func TestClaimAPIWatch(t *testing.T) {
	for _, tc := range []struct {
		name      string
		installed bool
		delivered int
	}{
		{"without the CRD", false, 0},
		{"with the CRD", true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			claim := &ipamclaimsv1.IPAMClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "vms", Name: "vm-a.net", UID: "u1"}}
			cs := claimfake.NewSimpleClientset(claim)
			if tc.installed {
				cs.Resources = []*metav1.APIResourceList{{GroupVersion: "k8s.cni.cncf.io/v1alpha1", APIResources: []metav1.APIResource{{Name: "ipamclaims", Namespaced: true, Kind: "IPAMClaim"}}}}
			}
			api := &clientClaimAPI{cs: cs, poll: time.Second, log: func(string, ...any) {}}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var mu sync.Mutex
			got := 0
			ready := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				api.Watch(ctx, func(*ipamclaimsv1.IPAMClaim) { mu.Lock(); got++; mu.Unlock() }, func(string, string) {}, ready)
			}()
			select {
			case <-ready:
			case <-time.After(10 * time.Second):
				t.Fatal("Watch did not say ready")
			}
			mu.Lock()
			if got != tc.delivered {
				t.Fatalf("delivered %d claims before ready, want %d", got, tc.delivered)
			}
			mu.Unlock()
			cancel()
			<-done
			if tc.installed {
				items, err := api.List(context.Background())
				if err != nil || len(items) != 1 {
					t.Fatalf("list: %v %v", items, err)
				}
			}
		})
	}
}

// Without a ClaimAPI the claim operations fail, so a list never releases a binding.
func TestPerformClaimWithoutTheAPI(t *testing.T) {
	c := &Controller{metrics: NewMetrics(nil)}
	r := OpResult{}
	c.performClaim(context.Background(), Op{Kind: OpListClaims}, &r)
	if r.Err == nil || r.ClaimUIDs != nil {
		t.Fatalf("result %+v", r)
	}
}
