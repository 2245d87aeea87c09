package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/ipwarden/ipwarden/internal/nodelease"
)

// Lease timing defaults (docs/design.md, "One agent per node"): a holder renews every
// DefaultLeaseRenew; another agent takes a Lease not renewed for DefaultLeaseDuration. The renewal
// is the agent's only periodic write: at 15 s it is 0.067 writes/s per node (the kubelet's own
// node Lease: 0.1/s). A holder whose last renewal began more than a duration ago re-checks the
// Lease before it serves another ADD (Permit), so one paused past its Lease never serves before it
// has seen whether another agent took it.
const (
	DefaultLeaseDuration = 60 * time.Second
	DefaultLeaseRenew    = 15 * time.Second
	// recheckEvery bounds the re-checks an ADD asks for while the API server cannot be reached.
	recheckEvery = 2 * time.Second
)

// NodeLease keeps the node's coordination.k8s.io Lease ipwarden-agent-<node> (package nodelease)
// and tells the service whether it may serve ADD.
type NodeLease struct {
	api       client.Client
	namespace string
	node      string
	identity  string
	svc       leaseGate
	log       logr.Logger
	obs       nodelease.Observer

	duration, renew time.Duration

	mu          sync.Mutex // serializes rounds: the loop's and the re-checks ADDs ask for
	lastAttempt time.Time
	held        bool
	holder      string
	known       bool
	heldCh      chan struct{} // closed the first time the Lease is held
	lastLog     time.Time
	// written is the Lease as this agent's last write left it (nil when unknown). A renewal
	// writes over it without reading first: the write carries its resourceVersion, so it
	// lands only if no one else wrote the Lease since, and a conflict sends the round back to
	// reading and deciding (one PUT and no GET per renewal at rest).
	written *coordinationv1.Lease
}

// NewNodeLease returns the Lease keeper of node for identity, with Leases lasting duration and
// renewed every renew (0: the defaults).
func NewNodeLease(api client.Client, namespace, node, identity string, duration, renew time.Duration, svc leaseGate, log logr.Logger) *NodeLease {
	if duration <= 0 {
		duration = DefaultLeaseDuration
	}
	if renew <= 0 {
		renew = DefaultLeaseRenew
	}
	l := &NodeLease{api: client.WithFieldOwner(api, string(fieldOwner)), namespace: namespace, node: node, identity: identity,
		duration: duration, renew: renew, svc: svc, log: log, heldCh: make(chan struct{})}
	svc.setLeaseRecheck(l.recheck)
	return l
}

// recheck runs a round now, unless one began less than recheckEvery ago (the API server is away
// and every ADD would ask again).
func (l *NodeLease) recheck(ctx context.Context) {
	l.mu.Lock()
	recent := time.Since(l.lastAttempt) < recheckEvery
	l.mu.Unlock()
	if !recent {
		l.round(ctx)
	}
}

// Held is closed once the agent has held the Lease.
func (l *NodeLease) Held() <-chan struct{} { return l.heldCh }

// Run keeps the Lease until ctx ends, then gives it up so a successor takes it at once.
func (l *NodeLease) Run(ctx context.Context) {
	t := time.NewTicker(l.renew)
	defer t.Stop()
	for {
		l.round(ctx)
		select {
		case <-ctx.Done():
			l.release()
			return
		case <-t.C:
		}
	}
}

func (l *NodeLease) round(ctx context.Context) {
	l.mu.Lock()
	defer l.mu.Unlock()
	start := time.Now()
	l.lastAttempt = start
	rctx, cancel := context.WithTimeout(ctx, min(l.renew, 10*time.Second))
	defer cancel()
	held, holder, err := l.once(rctx)
	if err != nil {
		// The API server is away, or a race: change nothing (a holder keeps serving from what it
		// holds, as through any outage); the next round tries again.
		if ctx.Err() == nil && time.Since(l.lastLog) > 30*time.Second {
			l.log.Info("cannot read or renew the node's Lease; keeping the current state", "lease", l.namespace+"/"+nodelease.Name(l.node),
				"held", l.held, "error", err.Error())
			l.lastLog = time.Now()
		}
		return
	}
	changed := !l.known || held != l.held || holder != l.holder
	l.known, l.held, l.holder = true, held, holder
	// The permit runs from the round's start: no other agent can take the Lease before then.
	l.svc.setLease(held, holder, start.Add(l.duration))
	if held {
		select {
		case <-l.heldCh:
		default:
			close(l.heldCh)
		}
	}
	switch {
	case changed && held:
		l.log.Info("holding the node's Lease: this agent serves the node", "lease", l.namespace+"/"+nodelease.Name(l.node), "identity", l.identity)
	case !held && (changed || time.Since(l.lastLog) > 30*time.Second):
		l.log.Error(&nodelease.HeldByOther{Node: l.node, Holder: holder, Namespace: l.namespace},
			"refusing to serve ADD: another agent holds the node's Lease; waiting for it", "identity", l.identity)
		l.lastLog = time.Now()
	}
}

// once reads the Lease and does what nodelease.Decide says; it reports whether the agent holds
// it, and the other holder if not.
func (l *NodeLease) once(ctx context.Context) (bool, string, error) {
	key := client.ObjectKey{Namespace: l.namespace, Name: nodelease.Name(l.node)}
	id, secs := l.identity, int32(l.duration/time.Second)
	if w := l.written; w != nil {
		// Renew over the agent's own last write. Any other write since (another agent took
		// it, an operator edited or deleted it) makes this one fail, and the round reads.
		l.written = nil
		lease := w.DeepCopy()
		mt := metav1.NewMicroTime(time.Now())
		lease.Spec.HolderIdentity, lease.Spec.LeaseDurationSeconds, lease.Spec.RenewTime = &id, &secs, &mt
		err := l.api.Update(ctx, lease)
		switch {
		case err == nil:
			l.wrote(lease)
			return true, "", nil
		case !apierrors.IsConflict(err) && !apierrors.IsNotFound(err):
			return false, "", fmt.Errorf("renew Lease %s: %w", key, err)
		}
	}
	var lease coordinationv1.Lease
	var rec *nodelease.Record
	err := l.api.Get(ctx, key, &lease)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return false, "", err
	default:
		rec = &nodelease.Record{Version: lease.ResourceVersion}
		if lease.Spec.HolderIdentity != nil {
			rec.Holder = *lease.Spec.HolderIdentity
		}
	}
	now := time.Now()
	a := nodelease.Decide(rec, l.identity, l.obs.Observe(rec, now), now, l.duration)
	mt := metav1.NewMicroTime(now)
	switch a.Kind {
	case nodelease.Wait:
		return false, a.Holder, nil
	case nodelease.Create:
		lease = coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name,
			Labels: map[string]string{"app.kubernetes.io/name": "ipwarden", "app.kubernetes.io/component": "agent"}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &id, LeaseDurationSeconds: &secs, AcquireTime: &mt, RenewTime: &mt}}
		if err := l.api.Create(ctx, &lease); err != nil {
			return false, "", fmt.Errorf("create Lease %s: %w", key, err)
		}
		l.wrote(&lease)
		return true, "", nil
	case nodelease.Take:
		lease.Spec.HolderIdentity, lease.Spec.AcquireTime = &id, &mt
	}
	lease.Spec.LeaseDurationSeconds, lease.Spec.RenewTime = &secs, &mt
	if err := l.api.Update(ctx, &lease); err != nil { // optimistic: carries the resourceVersion read
		return false, "", fmt.Errorf("%s Lease %s: %w", a.Kind, key, err)
	}
	l.wrote(&lease)
	return true, "", nil
}

// wrote keeps the Lease as the agent's write left it (the API server's answer, with its new
// resourceVersion) for the next renewal, and tells the observer of the version it wrote.
func (l *NodeLease) wrote(lease *coordinationv1.Lease) {
	l.written = lease
	l.obs.Observe(&nodelease.Record{Holder: l.identity, Version: lease.ResourceVersion}, time.Now())
}

// release gives the Lease up (no holder) if the agent holds it.
func (l *NodeLease) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.written = nil
	if !l.held {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var lease coordinationv1.Lease
	if err := l.api.Get(ctx, client.ObjectKey{Namespace: l.namespace, Name: nodelease.Name(l.node)}, &lease); err != nil {
		return
	}
	if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity != l.identity {
		return
	}
	lease.Spec.HolderIdentity = nil
	if err := l.api.Update(ctx, &lease); err == nil {
		l.log.Info("gave up the node's Lease", "lease", l.namespace+"/"+nodelease.Name(l.node))
	}
}

// Identity returns the agent's Lease identity: the pod's name (or the host name) and an ID kept
// in the state directory, so an agent restarted on the same journal is the same holder, and two
// agents with separate journals never are.
func Identity(stateDir string) (string, error) {
	base := os.Getenv("POD_NAME")
	if base == "" {
		base, _ = os.Hostname()
	}
	path := filepath.Join(stateDir, "agent-id")
	b, err := os.ReadFile(path)
	id := strings.TrimSpace(string(b))
	if errors.Is(err, os.ErrNotExist) || (err == nil && id == "") {
		r := make([]byte, 6)
		if _, err := rand.Read(r); err != nil {
			return "", err
		}
		id = hex.EncodeToString(r)
		if err := os.WriteFile(path, []byte(id+"\n"), 0o600); err != nil {
			return "", fmt.Errorf("write the agent's identity %s: %w", path, err)
		}
	} else if err != nil {
		return "", fmt.Errorf("read the agent's identity %s: %w", path, err)
	}
	if len(id) > 64 {
		id = id[:64]
	}
	return base + "-" + id, nil
}
