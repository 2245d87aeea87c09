package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// A Node object deleted and re-created under the same name while its pods keep running (cloud
// autoscalers and node repair do this). The node's agent keeps renewing its Lease, which is what
// proves the machine still runs: the controller keeps the node's addresses (cooldown 0, so an
// address returned to the pool would be handed out at once) while the other node asks for every
// address there is, and the re-created Node gets its NodeIPAllocation back with them. Then the
// agent stops for good and the Node goes: its addresses return once the Lease expires.
func TestNodeDeletedAndRecreatedKeepsItsAddresses(t *testing.T) {
	ctx := context.Background()
	w := watchStatuses(t)
	n := startTwoNodes(t, "recreate", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.128.0.0/26"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: cooldown(0),
	}, "--gc-grace=1h", "--lease-duration=6s", "--lease-renew-interval=2s") // the Lease expires 6s after the agent stops (60s by default)
	ctrl, a, b, confA, confB := n.ctrl, n.a, n.b, n.confA, n.confB
	for i := range 6 {
		p := createBoundPod(t, fmt.Sprintf("recreate-a-%d", i), "recreate-a")
		r, e := cni(t, "ADD", confA, fmt.Sprintf("ra%d", i), podArgs("default", p.Name, string(p.UID)))
		if e != nil {
			t.Fatal(e)
		}
		setPodIP(t, p, addrOf(t, r.IPs[0].Address).String())
	}
	used := usedBy(t, a)

	node := &corev1.Node{}
	if err := k8s.Get(ctx, client.ObjectKey{Name: "recreate-a"}, node); err != nil {
		t.Fatal(err)
	}
	labels := node.Labels
	if err := k8s.Delete(ctx, node); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the controller to handle node a's deletion", func() error {
		if !ctrl.logContains("node deleted, but its agent still renews its Lease") && !ctrl.logContains("node deleted: its addresses return") {
			return fmt.Errorf("not logged yet")
		}
		return nil
	})
	// Node b asks for every address there is (61 usable, node a's pods use 6).
	for i := range 60 {
		go func() {
			p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: fmt.Sprintf("recreate-b-%d", i)},
				Spec: corev1.PodSpec{NodeName: "recreate-b", Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
			if err := k8s.Create(ctx, p); err != nil {
				return
			}
			_, _ = cni(t, "ADD", confB, fmt.Sprintf("rb%d", i), podArgs("default", p.Name, string(p.UID)))
		}()
	}
	t.Cleanup(func() {
		_ = k8s.DeleteAllOf(context.Background(), &corev1.Pod{}, client.InNamespace("default"), client.GracePeriodSeconds(0))
	})
	eventually(t, 60*time.Second, "node b to hold every address node a's pods do not use", func() error {
		hb := held(t, "recreate-b", "recreate")
		if hb.Overlaps(used) {
			t.Fatalf("node b was given %v, which node a's pods use", hb.Intersect(used))
		}
		if p := getPool(t, "recreate"); p.Status.Free > 0 {
			return fmt.Errorf("node b holds %d, the pool has %d free", size(hb), p.Status.Free)
		}
		return nil
	})
	if ub := usedBy(t, b); ub.Overlaps(used) {
		t.Fatalf("a pod on node b got %v, which a pod on node a uses", ub.Intersect(used))
	}

	// The Node comes back under the same name: its NodeIPAllocation is owned by the new Node
	// and still holds what its pods use.
	again := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "recreate-a", Labels: labels}}
	if err := k8s.Create(ctx, again); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "node a's NodeIPAllocation to be owned by the new Node and hold its pods' addresses", func() error {
		obj := nipa2(t, "recreate-a")
		if obj == nil {
			return fmt.Errorf("no NodeIPAllocation")
		}
		if len(obj.OwnerReferences) != 1 || obj.OwnerReferences[0].UID != again.UID {
			return fmt.Errorf("owners %v, new Node %s", obj.OwnerReferences, again.UID)
		}
		if h := held(t, "recreate-a", "recreate"); !h.ContainsSet(used) {
			return fmt.Errorf("holds %v, pods use %v", h, used)
		}
		return nil
	})
	if u := usedBy(t, a); !u.Equal(used) {
		t.Fatalf("node a's pods now use %v, before %v", u, used)
	}

	// The machine goes for good: the agent stops (its Lease is released on shutdown or expires)
	// and the Node is deleted. Its addresses return to the pool.
	a.kill()
	<-a.done
	if err := k8s.Delete(ctx, again); err != nil {
		t.Fatal(err)
	}
	eventually(t, 60*time.Second, "node a's addresses to return once its agent's Lease expired", func() error {
		if obj := nipa2(t, "recreate-a"); obj != nil {
			return fmt.Errorf("NodeIPAllocation recreate-a still there")
		}
		return nil
	})
	w.check(t)
}
