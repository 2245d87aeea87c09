package agent

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The client an ADD reads a pod's metadata with when the watch lacks it has no client-side rate
// limiter (the agent's default client does: QPS 5), so such an ADD never waits on one.
func TestMetadataClientHasNoRateLimiter(t *testing.T) {
	base := &rest.Config{Host: "https://127.0.0.1:1"}
	limiter := func(c *rest.Config) bool {
		t.Helper()
		c = rest.CopyConfig(c)
		c.GroupVersion = &corev1.SchemeGroupVersion
		c.APIPath = "/api"
		c.NegotiatedSerializer = scheme.Codecs.WithoutConversion()
		rc, err := rest.RESTClientFor(c)
		if err != nil {
			t.Fatal(err)
		}
		return rc.GetRateLimiter() != nil
	}
	if !limiter(base) {
		t.Fatal("the default client has no rate limiter: the test would prove nothing")
	}
	if limiter(metadataConfig(base)) {
		t.Fatal("the ADD path's metadata client has a client-side rate limiter")
	}
	if got := metadataConfig(base).Timeout; got != podMetaTimeout {
		t.Fatalf("timeout %s, want %s", got, podMetaTimeout)
	}
}

// PublishSpec's order is data (decidePublish): a new leader is acknowledged before anything else,
// then a cache that has not shown the agent's last write waits, then only a change worth a write
// (or a newly observed pool) is written.
func TestDecidePublish(t *testing.T) {
	req := func(n int) []ipam.PoolRequest { return []ipam.PoolRequest{{Pool: "v4", Requested: n}} }
	obs := []ipwardenv1.ObservedPool{{Pool: "v4", UID: "u1", Generation: 1}}
	record := func(rv, acked string, n int, observed []ipwardenv1.ObservedPool) *ipwardenv1.NodeIPAllocation {
		o := &ipwardenv1.NodeIPAllocation{}
		o.ResourceVersion = rv
		o.Spec.AcknowledgedLeader = acked
		o.Spec.Pools = specPools(req(n))
		o.Spec.ObservedPools = observed
		return o
	}
	wrote := func(baseRV string, n int, observed []ipwardenv1.ObservedPool) writtenSpec {
		return writtenSpec{pools: specPools(req(n)), observed: observed, baseRV: baseRV, newRV: baseRV + "+1"}
	}
	for _, tc := range []struct {
		name     string
		cur      *ipwardenv1.NodeIPAllocation
		leader   string
		observed []ipwardenv1.ObservedPool
		reqs     []ipam.PoolRequest
		last     writtenSpec
		want     publishStep
	}{
		{"a new leader first, even with nothing to write", record("5", "old", 16, obs), "new", obs, req(16), writtenSpec{}, publishAcknowledge},
		{"a new leader first, even while the cache lags", record("5", "old", 16, obs), "new", obs, req(32), wrote("5", 32, obs), publishAcknowledge},
		{"no leader known: no acknowledgement", record("5", "", 16, obs), "", obs, req(32), writtenSpec{}, publishWrite},
		{"the cache shows the base of our last write, same request", record("5", "l", 16, obs), "l", obs, req(32), wrote("5", 32, obs), publishCacheLags},
		{"the cache shows the base of our last write, another request", record("5", "l", 16, obs), "l", obs, req(48), wrote("5", 32, obs), publishWrite},
		{"the cache shows our write", record("6", "l", 32, obs), "l", obs, req(32), wrote("5", 32, obs), publishNothing},
		{"nothing written yet, the record already says it", record("5", "l", 16, obs), "l", obs, req(16), writtenSpec{}, publishNothing},
		{"a raise is worth a write", record("5", "l", 16, obs), "l", obs, req(32), writtenSpec{}, publishWrite},
		{"a newly observed pool is always written", record("5", "l", 16, nil), "l", obs, req(16), writtenSpec{}, publishWrite},
	} {
		if got := decidePublish(tc.cur, tc.leader, tc.observed, tc.reqs, tc.last); got != tc.want {
			t.Errorf("%s: decidePublish = %d, want %d", tc.name, got, tc.want)
		}
	}
}
