package integration

// Pool choice (docs/design.md, "Choosing pools and addresses"): real agent, controller and
// plugin processes on the real API server, with real pods and namespaces.

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

func createNamespace(t *testing.T, name string, labels, annotations map[string]string) {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: annotations}}
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), ns) })
}

// createAnnotatedPod creates a pod bound to node in namespace with annotations.
func createAnnotatedPod(t *testing.T, namespace, name, node string, annotations map[string]string) *corev1.Pod {
	t.Helper()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, Annotations: annotations},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)) })
	return p
}

func inPrefix(t *testing.T, cidr, prefix string) bool {
	t.Helper()
	return netip.MustParsePrefix(prefix).Contains(addrOf(t, cidr))
}

// A pod's annotation wins over its namespace's, which wins over the CNI config's pools, which win
// over the node's pools. A pool's namespaceSelector is enforced whatever names it: a pod naming a
// pool its namespace may not use gets a clear CNI error and no address, and so does one naming a
// pool that does not exist or does not select the node. The node's request counts annotated pods
// in the pools they name before their ADD.
func TestPoolChoice(t *testing.T) {
	const node = "pool-choice"
	scale := ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 64}
	agentPool(t, "pc-a", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.150.0.0/24"}, ReuseCooldown: cooldown(0),
		Scaling: ipwardenv1.Scaling{BatchSize: 1, BufferPercent: 0, MaxPerNode: 64}})
	agentPool(t, "pc-b", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.150.1.0/24"}, ReuseCooldown: cooldown(0), Scaling: scale})
	agentPool(t, "pc-c", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.150.2.0/24"}, ReuseCooldown: cooldown(0), Scaling: scale})
	agentPool(t, "pc-blue", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.150.3.0/24"}, ReuseCooldown: cooldown(0), Scaling: scale,
		NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.test/team": "blue"}}})
	agentPool(t, "pc-blue6", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"fd00:150::/120"}, ReuseCooldown: cooldown(0), Scaling: scale,
		NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.test/team": "blue"}}})
	agentPool(t, "pc-far", "elsewhere", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.150.4.0/24"}, Scaling: scale})
	createNamespace(t, "pc-red", map[string]string{"ipwarden.test/team": "red"}, map[string]string{podinfo.AnnotationPools: "pc-b"})
	createNamespace(t, "pc-blue", map[string]string{"ipwarden.test/team": "blue"}, nil)
	agentNode(t, node, node)
	startController(t)

	// Three pods that name pc-a, bound before the agent starts: pc-a has batch 1 and no buffer,
	// so the node's request for it is exactly the pods that will draw from it.
	var podsA []*corev1.Pod
	for i := range 3 {
		podsA = append(podsA, createAnnotatedPod(t, "pc-red", fmt.Sprintf("a-%d", i), node, map[string]string{podinfo.AnnotationPools: "pc-a"}))
	}
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	eventually(t, 20*time.Second, "the request for pc-a to count the annotated pods", func() error {
		if n, _ := requested(t, node, "pc-a"); n != 3 {
			return fmt.Errorf("requested %d", n)
		}
		return nil
	})

	conf := pluginConf("1.1.0", ag.socket, "pc-c")
	// Pod annotation over namespace annotation over config.
	if a := addFor(t, conf, "pc-pod", podsA[0]); !inPrefix(t, a, "10.150.0.0/24") {
		t.Fatalf("annotated pod got %s, want an address of pc-a", a)
	}
	plain := createAnnotatedPod(t, "pc-red", "plain", node, nil)
	if a := addFor(t, conf, "pc-ns", plain); !inPrefix(t, a, "10.150.1.0/24") {
		t.Fatalf("pod in an annotated namespace got %s, want an address of pc-b", a)
	}
	def := createAnnotatedPod(t, "default", "pc-default", node, nil)
	if a := addFor(t, conf, "pc-cfg", def); !inPrefix(t, a, "10.150.2.0/24") {
		t.Fatalf("pod without annotations got %s, want an address of pc-c (the CNI config)", a)
	}
	// Dual-stack by annotation in a namespace the pools admit: one address per family.
	blue := createAnnotatedPod(t, "pc-blue", "dual", node, map[string]string{podinfo.AnnotationPools: "pc-blue, pc-blue6"})
	r, e := cni(t, "ADD", conf, "pc-dual", podArgs(blue.Namespace, blue.Name, string(blue.UID)))
	if e != nil {
		t.Fatalf("dual-stack ADD: %v", e)
	}
	if len(r.IPs) != 2 || !inPrefix(t, r.IPs[0].Address, "10.150.3.0/24") || !inPrefix(t, r.IPs[1].Address, "fd00:150::/120") {
		t.Fatalf("dual-stack ADD gave %v", r.addrs())
	}

	// Refusals: a clear error, code 7, and nothing handed out.
	before := len(ag.attachmentIDs(t))
	for _, tc := range []struct {
		ns, name, pools, want string
	}{
		{"pc-red", "sneaky", "pc-blue", `pool "pc-blue" may not be used by namespace "pc-red"`},
		{"pc-red", "missing", "pc-nope", `pool "pc-nope" is not an IPPool the agent knows`},
		{"pc-red", "far", "pc-far", `pool "pc-far" does not serve node pool-choice`},
		{"pc-blue", "twofour", "pc-blue,pc-a", "one address family"},
		{"pc-red", "bad", "pc-a,,pc-b", "empty pool name"},
	} {
		p := createAnnotatedPod(t, tc.ns, tc.name, node, map[string]string{podinfo.AnnotationPools: tc.pools})
		_, e := cni(t, "ADD", conf, "pc-"+tc.name, podArgs(p.Namespace, p.Name, string(p.UID)))
		if e == nil || e.Code != 7 || !strings.Contains(e.Msg, tc.want) {
			t.Errorf("ADD of pod %s/%s with pools %q: error %+v, want code 7 with %q", tc.ns, tc.name, tc.pools, e, tc.want)
		}
	}
	// The namespace's annotation is enforced as well: pc-red may not name pc-blue either.
	createNamespace(t, "pc-red2", map[string]string{"ipwarden.test/team": "red"}, map[string]string{podinfo.AnnotationPools: "pc-blue"})
	p := createAnnotatedPod(t, "pc-red2", "ns-sneaky", node, nil)
	if _, e := cni(t, "ADD", conf, "pc-ns-sneaky", podArgs(p.Namespace, p.Name, string(p.UID))); e == nil || e.Code != 7 ||
		!strings.Contains(e.Msg, "namespace annotation ipwarden.io/pools") || !strings.Contains(e.Msg, "may not be used") {
		t.Errorf("ADD in a namespace whose annotation names a pool it may not use: %+v", e)
	}
	if got := len(ag.attachmentIDs(t)); got != before {
		t.Fatalf("%d attachments after refused ADDs, want %d", got, before)
	}
}
