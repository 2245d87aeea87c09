package agent

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
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

// A pod the informer has not delivered yet is read whole from the API server: the ResourceClaims
// its spec names reach the ADD (a shared named claim is refused, ipam.reservedForAnother), with
// its annotations. The cache here knows no pod (a real watch's lag); the API server has it.
func TestPodMetaOnACacheMissReadsTheSpec(t *testing.T) {
	claim := "shared"
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "web-2", UID: "uid-web-2",
		Annotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: "vm"}},
		Spec: corev1.PodSpec{ResourceClaims: []corev1.PodResourceClaim{{Name: "addr", ResourceClaimName: &claim}}}}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}
	k := &Kube{cache: readerCache{r: fake.NewClientBuilder().WithObjects(ns.DeepCopy()).Build()}, meta: fake.NewClientBuilder().WithObjects(pod, ns).Build()}
	meta, err := k.PodMeta(context.Background(), "app", "web-2", "uid-web-2")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(meta.ResourceClaims, []string{"shared"}) || meta.NetworkAnnotations[ipamclaim.AnnotationPrimaryClaim] != "vm" {
		t.Fatalf("PodMeta on a cache miss: claims %v, annotations %v; want [shared] and the claim reference", meta.ResourceClaims, meta.NetworkAnnotations)
	}
}

// readerCache is a cache.Cache whose reads come from a client (only Get is used here).
type readerCache struct {
	cache.Cache
	r client.Reader
}

func (c readerCache) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	return c.r.Get(ctx, key, obj, opts...)
}
