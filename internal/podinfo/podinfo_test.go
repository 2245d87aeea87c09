package podinfo

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestOf(t *testing.T) {
	now := metav1.Now()
	yes := true
	base := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1"},
		Spec:       corev1.PodSpec{NodeName: "n1"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning,
			PodIPs: []corev1.PodIP{{IP: "10.0.0.5"}, {IP: "garbage"}, {IP: "fd00::5"}}},
	}
	for _, tc := range []struct {
		name   string
		mod    func(*corev1.Pod)
		mayRun bool
		check  func(Pod) bool
	}{
		{"running", func(*corev1.Pod) {}, true, func(p Pod) bool {
			return p.Namespace == "ns" && p.Name == "p" && p.UID == "u1" && p.Node == "n1" &&
				slices.Equal(p.IPs, []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")})
		}},
		{"succeeded", func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }, false, func(p Pod) bool { return p.Finished }},
		{"failed", func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }, false, func(p Pod) bool { return p.Finished }},
		{"deleting may still run", func(p *corev1.Pod) { p.DeletionTimestamp = &now }, true, func(p Pod) bool { return p.Deleting }},
		{"host network", func(p *corev1.Pod) { p.Spec.HostNetwork = true }, false, func(p Pod) bool { return p.HostNetwork }},
		{"pending unscheduled", func(p *corev1.Pod) { p.Spec.NodeName = ""; p.Status = corev1.PodStatus{Phase: corev1.PodPending} }, true,
			func(p Pod) bool { return p.Node == "" && len(p.IPs) == 0 }},
		{"no statefulset", func(*corev1.Pod) {}, true, func(p Pod) bool { return p.StatefulSet == "" && p.Ordinal == -1 && !p.Sticky }},
		{"statefulset by label", func(p *corev1.Pod) {
			p.Name = "web-x"
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", Controller: &yes}}
			p.Labels = map[string]string{LabelPodIndex: "3"}
			p.Annotations = map[string]string{AnnotationSticky: "true"}
		}, true, func(p Pod) bool { return p.StatefulSet == "web" && p.Ordinal == 3 && p.Sticky }},
		{"statefulset by name", func(p *corev1.Pod) {
			p.Name = "web-12"
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", Controller: &yes}}
		}, true, func(p Pod) bool { return p.StatefulSet == "web" && p.Ordinal == 12 && !p.Sticky }},
		{"statefulset, odd name", func(p *corev1.Pod) {
			p.Name = "web-012"
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", Controller: &yes}}
		}, true, func(p Pod) bool { return p.StatefulSet == "web" && p.Ordinal == -1 }},
		{"owner that is not the controller", func(p *corev1.Pod) {
			p.Name = "web-1"
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web"}}
		}, true, func(p Pod) bool { return p.StatefulSet == "" && p.Ordinal == -1 }},
		{"annotations", func(p *corev1.Pod) {
			p.Annotations = map[string]string{AnnotationPools: "blue-v4,blue-v6", AnnotationIPAddresses: "10.0.5.20"}
		}, true, func(p Pod) bool { return p.Pools == "blue-v4,blue-v6" && p.IPAddresses == "10.0.5.20" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			obj := *base.DeepCopy()
			tc.mod(&obj)
			got := Of(&obj)
			if got.MayRun() != tc.mayRun || !tc.check(got) {
				t.Fatalf("Of = %+v, MayRun %v (want %v)", got, got.MayRun(), tc.mayRun)
			}
		})
	}
}

func TestParseNetworkStatus(t *testing.T) {
	ip := netip.MustParseAddr
	multus := `[{"name":"kindnet","interface":"eth0","ips":["10.244.1.5"],"default":true},` +
		`{"name":"default/storage","interface":"net1","ips":["10.99.0.5","fd99::5/64"]}]`
	for _, tc := range []struct {
		name    string
		value   string
		network string
		want    []netip.Addr // the addresses of the entries naming network
	}{
		{"secondary by short name", multus, "storage", []netip.Addr{ip("10.99.0.5"), ip("fd99::5")}},
		{"secondary by namespaced name", multus, "default/storage", []netip.Addr{ip("10.99.0.5"), ip("fd99::5")}},
		{"the default entry names no secondary network", multus, "kindnet", nil},
		{"the pod network is never read from it", multus, "", nil},
		{"another network", multus, "backup", nil},
		{"absent", "", "storage", nil},
		{"malformed reads as none", `{"name":`, "storage", nil},
		{"oversized reads as none", `[` + strings.Repeat(" ", maxNetworkStatus) + `]`, "storage", nil},
		{"garbage address skipped", `[{"name":"storage","ips":["nope","10.99.0.7"]}]`, "storage", []netip.Addr{ip("10.99.0.7")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []netip.Addr
			for _, n := range ParseNetworkStatus(tc.value) {
				if n.Names(tc.network) {
					got = append(got, n.IPs...)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("addresses on %q = %v, want %v", tc.network, got, tc.want)
			}
		})
	}
}
