package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/nodesignal"
)

// NodeSignal is the IO shell of the scheduler signal (package nodesignal decides): after each
// pool monitor round it sets or clears the Node's condition ipwarden.io/AddressesExhausted and,
// with Taint, the NoSchedule taint of that name. It writes the Node only when the decision
// changes. Only the monitor calls it.
type NodeSignal struct {
	api    client.Client
	node   string
	taint  bool
	params nodesignal.Params
	log    logr.Logger
	now    func() metav1.Time
	events record.EventRecorder // nil: none
	gauge  prometheus.Gauge     // nil: none

	known   bool // shown and reason are what the Node shows
	shown   bool
	reason  string
	tainted bool
	uid     types.UID // the Node's, for events

	// The takeover and handback conditions as the Node shows them (nodesignal.DecideTakeover,
	// nodesignal.DecideHandback).
	takeover, handback shownCondition
}

// shownCondition is what the Node shows of one of the agent's True/False conditions.
type shownCondition struct {
	shown, on bool
	message   string
}

// Event reasons on the Node.
const (
	EventAddressesExhausted = "AddressesExhausted" // Warning: the signal was set
	EventAddressesAvailable = "AddressesAvailable" // Normal: it cleared
)

// SetReporting makes the signal record events on the Node and keep gauge at 1 while it is set.
func (n *NodeSignal) SetReporting(events record.EventRecorder, gauge prometheus.Gauge) {
	n.events, n.gauge = events, gauge
}

// NewNodeSignal returns the signal writer for node; taint adds the NoSchedule taint too.
func NewNodeSignal(api client.Client, node string, taint bool, params nodesignal.Params, log logr.Logger) *NodeSignal {
	return &NodeSignal{api: client.WithFieldOwner(api, string(fieldOwner)), node: node, taint: taint, params: params, log: log, now: metav1.Now}
}

// Update decides from the pool stats and the handback mark (nil: none) and writes the Node if
// the decision changed.
func (n *NodeSignal) Update(ctx context.Context, stats []ipam.PoolStats, handback *ipam.HandbackMark) error {
	if !n.known {
		var node corev1.Node
		if err := n.api.Get(ctx, client.ObjectKey{Name: n.node}, &node); apierrors.IsNotFound(err) {
			return nil // no Node object (being deleted, or a test without one): nothing to show it on
		} else if err != nil {
			return fmt.Errorf("read Node %s: %w", n.node, err)
		}
		for _, c := range node.Status.Conditions {
			switch c.Type {
			case nodesignal.ConditionType:
				n.shown, n.reason = c.Status == corev1.ConditionTrue, c.Reason
			case nodesignal.TakeoverConditionType:
				n.takeover = shownCondition{shown: true, on: c.Status == corev1.ConditionTrue, message: c.Message}
			case nodesignal.HandbackConditionType:
				n.handback = shownCondition{shown: true, on: c.Status == corev1.ConditionTrue, message: c.Message}
			}
		}
		n.tainted = slices.ContainsFunc(node.Spec.Taints, isSignalTaint)
		n.uid = node.UID
		n.known = true
	}
	pools := make([]nodesignal.Pool, 0, len(stats))
	for _, s := range stats {
		if !s.Served {
			continue
		}
		pools = append(pools, nodesignal.Pool{Name: s.Pool, Held: s.Held, InUse: s.InUse, Free: s.Free, Requested: s.Requested,
			Demand: s.Demand, Exhausted: s.Exhausted})
	}
	d := nodesignal.Decide(pools, n.shown, n.params)
	// No condition yet and nothing to say: write nothing (no write per node at start).
	if d.Exhausted != n.shown || (n.reason != "" && d.Reason != n.reason) {
		if err := n.writeCondition(ctx, d); err != nil {
			n.known = false
			return err
		}
		if d.Exhausted != n.shown {
			n.log.Info("scheduler signal changed", "condition", nodesignal.ConditionType, "exhausted", d.Exhausted, "reason", d.Reason, "message", d.Message)
			if n.events != nil {
				ref := &corev1.ObjectReference{Kind: "Node", Name: n.node, UID: n.uid, APIVersion: "v1"}
				if d.Exhausted {
					n.events.Event(ref, corev1.EventTypeWarning, EventAddressesExhausted, d.Message)
				} else {
					n.events.Event(ref, corev1.EventTypeNormal, EventAddressesAvailable, d.Message)
				}
			}
		}
		n.shown, n.reason = d.Exhausted, d.Reason
	}
	if n.gauge != nil {
		n.gauge.Set(map[bool]float64{false: 0, true: 1}[n.shown])
	}
	if err := n.updateTakeover(ctx, stats); err != nil {
		n.known = false
		return err
	}
	if err := n.updateHandback(ctx, handback); err != nil {
		n.known = false
		return err
	}
	wantTaint := n.taint && d.Exhausted
	if wantTaint != n.tainted {
		if err := n.writeTaint(ctx, wantTaint); err != nil {
			n.known = false
			return err
		}
		n.log.Info("scheduler signal taint changed", "taint", nodesignal.TaintKey, "present", wantTaint)
		n.tainted = wantTaint
	}
	return nil
}

// updateTakeover shows on the Node whether running pods still use addresses ipwarden adopted
// (condition ipwarden.io/TakeoverComplete, nodesignal.DecideTakeover).
func (n *NodeSignal) updateTakeover(ctx context.Context, stats []ipam.PoolStats) error {
	adopted := map[string]int{}
	for _, s := range stats {
		adopted[s.Pool] = s.Adopted
	}
	d := nodesignal.DecideTakeover(adopted, n.takeover.shown, n.takeover.on, n.takeover.message)
	if !d.Write {
		return nil
	}
	changed, err := n.showCondition(ctx, nodesignal.TakeoverConditionType, &n.takeover, d.Complete, d.Reason, d.Message)
	if err != nil || !changed {
		return err
	}
	n.log.Info("takeover condition changed", "condition", nodesignal.TakeoverConditionType, "complete", d.Complete, "message", d.Message)
	if n.events != nil && d.Complete {
		ref := &corev1.ObjectReference{Kind: "Node", Name: n.node, UID: n.uid, APIVersion: "v1"}
		n.events.Event(ref, corev1.EventTypeNormal, nodesignal.ReasonTakeoverComplete, d.Message)
	}
	return nil
}

// updateHandback shows on the Node whether it is handed back to host-local (condition
// ipwarden.io/HandedBack, nodesignal.DecideHandback).
func (n *NodeSignal) updateHandback(ctx context.Context, mark *ipam.HandbackMark) error {
	var hb *nodesignal.Handback
	if mark != nil {
		hb = &nodesignal.Handback{At: mark.At, To: mark.To, Network: mark.Network}
	}
	d := nodesignal.DecideHandback(hb, n.handback.shown, n.handback.on, n.handback.message)
	if !d.Write {
		return nil
	}
	changed, err := n.showCondition(ctx, nodesignal.HandbackConditionType, &n.handback, d.On, d.Reason, d.Message)
	if err == nil && changed {
		n.log.Info("handback condition changed", "condition", nodesignal.HandbackConditionType, "handedBack", d.On, "message", d.Message)
	}
	return err
}

// showCondition writes the condition typ, True when on, and records it in was. Its transition
// time moves only when the status changes (or the Node showed none); changed says whether it did.
func (n *NodeSignal) showCondition(ctx context.Context, typ corev1.NodeConditionType, was *shownCondition, on bool, reason, message string) (changed bool, err error) {
	status := corev1.ConditionFalse
	if on {
		status = corev1.ConditionTrue
	}
	now := n.now()
	cond := corev1.NodeCondition{Type: typ, Status: status, Reason: reason, Message: message, LastHeartbeatTime: now}
	changed = !was.shown || on != was.on
	if changed {
		cond.LastTransitionTime = now
	}
	if err := n.patchCondition(ctx, cond); err != nil {
		return false, err
	}
	*was = shownCondition{shown: true, on: on, message: message}
	return changed, nil
}

func isSignalTaint(t corev1.Taint) bool { return t.Key == nodesignal.TaintKey }

// writeCondition patches the condition into the Node's status (strategic merge on the type).
func (n *NodeSignal) writeCondition(ctx context.Context, d nodesignal.Decision) error {
	status := corev1.ConditionFalse
	if d.Exhausted {
		status = corev1.ConditionTrue
	}
	now := n.now()
	cond := corev1.NodeCondition{Type: nodesignal.ConditionType, Status: status, Reason: d.Reason, Message: d.Message,
		LastHeartbeatTime: now}
	if d.Exhausted != n.shown {
		cond.LastTransitionTime = now
	}
	return n.patchCondition(ctx, cond)
}

// patchCondition patches one condition into the Node's status (strategic merge on the type).
func (n *NodeSignal) patchCondition(ctx context.Context, cond corev1.NodeCondition) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.node}}
	body, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{cond}}})
	if err != nil {
		return err
	}
	patch := client.RawPatch(types.StrategicMergePatchType, body)
	if err := n.api.Status().Patch(ctx, node, patch); err != nil {
		return fmt.Errorf("write condition %s on Node %s: %w", cond.Type, n.node, err)
	}
	return nil
}

// writeTaint adds or removes the taint, leaving every other taint as it is (optimistic lock).
func (n *NodeSignal) writeTaint(ctx context.Context, present bool) error {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var node corev1.Node
		if err := n.api.Get(ctx, client.ObjectKey{Name: n.node}, &node); err != nil {
			return err
		}
		base := node.DeepCopy()
		has := slices.ContainsFunc(node.Spec.Taints, isSignalTaint)
		switch {
		case present && !has:
			node.Spec.Taints = append(node.Spec.Taints, corev1.Taint{Key: nodesignal.TaintKey, Effect: corev1.TaintEffectNoSchedule})
		case !present && has:
			node.Spec.Taints = slices.DeleteFunc(node.Spec.Taints, isSignalTaint)
		default:
			return nil
		}
		return n.api.Patch(ctx, &node, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}))
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("write taint %s on Node %s: %w", nodesignal.TaintKey, n.node, err)
	}
	return err
}
