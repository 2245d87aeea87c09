package integration

// The scheduler signal on the real API server with a real controller, agent and plugin: a node
// at maxPerNode with a pod waiting gets the condition ipwarden.io/AddressesExhausted and (with
// --exhausted-taint) the NoSchedule taint; one address back keeps them (hysteresis); two clear
// them.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent/nodesignal"
)

// signalOf returns the Node's AddressesExhausted condition (nil when absent) and whether it has
// the taint.
func signalOf(t *testing.T, node string) (*corev1.NodeCondition, bool) {
	t.Helper()
	var n corev1.Node
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, &n); err != nil {
		t.Fatal(err)
	}
	var cond *corev1.NodeCondition
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == nodesignal.ConditionType {
			cond = &n.Status.Conditions[i]
		}
	}
	return cond, slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == nodesignal.TaintKey && t.Effect == corev1.TaintEffectNoSchedule
	})
}

func waitSignal(t *testing.T, node string, status corev1.ConditionStatus, reason string, tainted bool) {
	t.Helper()
	eventually(t, 30*time.Second, fmt.Sprintf("condition %s=%s (%s), taint %v", nodesignal.ConditionType, status, reason, tainted), func() error {
		c, taint := signalOf(t, node)
		if c == nil || c.Status != status || c.Reason != reason || taint != tainted {
			return fmt.Errorf("condition %+v, taint %v", c, taint)
		}
		return nil
	})
}

func TestSchedulerSignal(t *testing.T) {
	const node = "signal-n1"
	agentPool(t, "signal", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.142.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 4}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
	ag := startAgent(t, node, "", "--exhausted-taint", "--exhausted-clear-free=2")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)

	// Nothing is short: the agent writes no condition at all.
	var pods []*corev1.Pod
	for i := range 4 {
		p := createBoundPod(t, fmt.Sprintf("signal-%d", i), node)
		addFor(t, conf, fmt.Sprintf("signal-sandbox-%d", i), p)
		pods = append(pods, p)
	}
	eventually(t, 20*time.Second, "the node to hold maxPerNode, all in use", func() error {
		if p := ag.pool(t, "signal"); p.Held != 4 || p.InUse != 4 {
			return fmt.Errorf("held %d, in use %d", p.Held, p.InUse)
		}
		return nil
	})
	if c, taint := signalOf(t, node); c != nil || taint {
		t.Fatalf("signal shown while no pod waits: %+v, taint %v", c, taint)
	}

	// A fifth pod is bound to the node: it would wait in ContainerCreating.
	createBoundPod(t, "signal-waiting", node)
	waitSignal(t, node, corev1.ConditionTrue, nodesignal.ReasonAtMaxPerNode, true)
	if ev := waitEvent(t, "AddressesExhausted", "Node", node, "", "maxPerNode"); ev.Type != corev1.EventTypeWarning {
		t.Errorf("event %+v, want a Warning", ev)
	}
	ag.waitMetric(t, 10*time.Second, "ipwarden_agent_addresses_exhausted", 1)

	// One address comes back: below --exhausted-clear-free, the signal stays.
	mustDel(t, conf, "signal-sandbox-0")
	forceDelete(t, pods[0])
	eventually(t, 20*time.Second, "one free address", func() error {
		if p := ag.pool(t, "signal"); p.Free != 1 {
			return fmt.Errorf("free %d", p.Free)
		}
		return nil
	})
	waitSignal(t, node, corev1.ConditionTrue, nodesignal.ReasonAddressesReturning, true)

	// Two: it clears, condition and taint.
	mustDel(t, conf, "signal-sandbox-1")
	forceDelete(t, pods[1])
	waitSignal(t, node, corev1.ConditionFalse, nodesignal.ReasonAddressesAvailable, false)
	waitEvent(t, "AddressesAvailable", "Node", node, "", "free addresses")
	if v := ag.metric(t, "ipwarden_agent_addresses_exhausted"); v != 0 {
		t.Errorf("ipwarden_agent_addresses_exhausted = %v after the signal cleared", v)
	}
}
