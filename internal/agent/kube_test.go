package agent

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
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
