package integration

// Sticky StatefulSet addresses (docs/design.md, "Sticky StatefulSet addresses"): real agents on
// two nodes, controller and plugin processes on the real API server. The test API server runs
// no StatefulSet controller: the test creates the StatefulSet object and its pods itself.

import (
	"context"
	"fmt"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

func stickyRecord(t *testing.T, pool string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, e := range getPool(t, pool).Status.Sticky {
		out[fmt.Sprintf("%s/%s-%d", e.Namespace, e.StatefulSet, e.Ordinal)] = string(e.Address)
	}
	return out
}

// A StatefulSet pod keeps its address when it is deleted and re-created on another node: the
// pool's status records the address for default/web-0, the old node gives it back once the old
// pod's attachment is gone, and the new node's pod gets it. Scaling the StatefulSet below the
// ordinal with whenScaled: Delete returns it.
func TestStickyStatefulSetAddress(t *testing.T) {
	const label = "sticky"
	agentPool(t, "sk", label, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.154.0.0/24"}, ReuseCooldown: cooldown(0),
		Sticky: true, Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}})
	agentNode(t, "sticky-a", label)
	agentNode(t, "sticky-b", label)
	startController(t)
	agA := startAgent(t, "sticky-a", "")
	agB := startAgent(t, "sticky-b", "")
	agA.waitServing(t)
	agB.waitServing(t)
	confA, confB := pluginConf("1.1.0", agA.socket), pluginConf("1.1.0", agB.socket)

	one := int32(1)
	sts := &appsv1.StatefulSet{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: appsv1.StatefulSetSpec{Replicas: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "web"}},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "none"}}}},
			PersistentVolumeClaimRetentionPolicy: &appsv1.StatefulSetPersistentVolumeClaimRetentionPolicy{
				WhenScaled: appsv1.DeletePersistentVolumeClaimRetentionPolicyType}}}
	if err := k8s.Create(context.Background(), sts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), sts) })
	yes := true
	webPod := func(node string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web-0",
			Labels:          map[string]string{"app": "web", podinfo.LabelPodIndex: "0"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", UID: sts.UID, Controller: &yes}}},
			Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
		if err := k8s.Create(context.Background(), p); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)) })
		return p
	}

	p := webPod("sticky-a")
	addr := addFor(t, confA, "web-0-a", p)
	eventually(t, 20*time.Second, "the pool to record web-0's address", func() error {
		if got := stickyRecord(t, "sk")["default/web-0"]; got+"/24" != addr {
			return fmt.Errorf("record %v, want %s", stickyRecord(t, "sk"), addr)
		}
		return nil
	})
	if r, _, _ := runCheck(t); len(r.Sticky) != 1 || r.Sticky[0].Identity != "default/web-0" || r.Sticky[0].Address+"/24" != addr {
		t.Fatalf("ipwarden check lists sticky %+v", r.Sticky)
	}
	// Another pod on sticky-a never gets the reserved address once web-0 is gone.
	if _, e := cni(t, "DEL", confA, "web-0-a", podArgs(p.Namespace, p.Name, string(p.UID))); e != nil {
		t.Fatal(e)
	}
	if err := k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		if a := mustAdd(t, confA, fmt.Sprintf("other-%d", i)).IPs[0].Address; a == addr {
			t.Fatalf("another pod got web-0's reserved address %s", a)
		}
	}

	// web-0 re-created on sticky-b: it gets the same address (a first try may be refused while
	// sticky-a still holds it; sticky-a gives it back, being unused there).
	eventually(t, 10*time.Second, "the old pod object to be gone", func() error {
		err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), &corev1.Pod{})
		if err == nil {
			return fmt.Errorf("still there")
		}
		return client.IgnoreNotFound(err)
	})
	p2 := webPod("sticky-b")
	eventually(t, 40*time.Second, "web-0 on sticky-b to get its address", func() error {
		r, e := cni(t, "ADD", confB, "web-0-b", podArgs(p2.Namespace, p2.Name, string(p2.UID)))
		if e != nil {
			return fmt.Errorf("%s", e.Msg)
		}
		if r.IPs[0].Address != addr {
			t.Fatalf("web-0 on sticky-b got %s, want %s", r.IPs[0].Address, addr)
		}
		return nil
	})

	// Scale to zero with whenScaled: Delete: the reservation goes back to the pool.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(sts), sts); err != nil {
			return err
		}
		zero := int32(0)
		sts.Spec.Replicas = &zero
		return k8s.Update(context.Background(), sts)
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the reservation to be returned", func() error {
		if r := stickyRecord(t, "sk"); len(r) != 0 {
			return fmt.Errorf("record %v", r)
		}
		return nil
	})
}
