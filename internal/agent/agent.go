// Package agent is ipwarden's node agent: it serves the CNI plugin's requests over a unix socket
// from the node's warm set of addresses, records every assignment in a durable journal before
// answering, and keeps the node's NodeIPAllocation request right-sized (the pool monitor).
//
// The decisions live in the pure state machine of package ipam, the leak collector's in package
// gc, the node Lease's in package nodelease; the journal in package journal. This package is the
// imperative shell: Service (requests, journal, waiting, and the gate that says when ADD may be
// served), Kube (informers and the spec write), NodeLease, Monitor (scaling rounds), Collector
// (leak collection), and Run, which wires them in this order:
//
//  1. open and load the journal (bbolt, <state-dir>/journal.db) and restore the state;
//  2. listen on the socket and serve at once from the journal: DEL, CHECK, LIST, and ADD from the
//     addresses the journal holds (the pools it served and their holdings), whether or not the
//     API server answers;
//  3. in the background, retrying while the API server is away: start the informers, take the
//     node's Lease, wait for the controller to create the node's NodeIPAllocation, reconcile (push
//     pools, holdings and pods into the state; rebuild attachments for running pods whose
//     addresses the journal lacks), and only then run the monitor (spec publishing), the watch
//     loop and the leak collector.
//
// # When ADD is served (gate)
//
// A new or lost journal holds no address, so such an agent serves ADD only after step 3; until
// then ADD fails with code 11 and says what the agent waits for ("waiting for the API server",
// "waiting for the controller to create NodeIPAllocation ..."). An agent whose journal holds
// addresses serves ADD from them before the API server answers: it held the node's Lease when it
// last talked to it, since holdings are journaled only after the Lease is taken.
//
// # One agent per node
//
// The agent holds the coordination.k8s.io Lease ipwarden-agent-<node> in --lease-namespace
// (package nodelease; identity: pod name and an ID kept in the state directory). While another
// agent holds it, ADD is refused with an error naming the holder and the spec is not published;
// seeing another holder stops ADD at once. A renewal that fails because the API server is away
// changes nothing (the agent serves from what it holds, as through any outage). The agent does not
// take over a socket another process answers on. On SIGTERM it gives the Lease up.
//
// # Leak collection
//
// Addresses of pods that are gone come back without a CNI DEL in three ways (package gc holds the
// decisions and the safety argument): the deletion of a pod bound to the node makes the
// attachments recorded for its UID candidates (event path); a full check every
// --gc-full-check-interval picks attachments older than --gc-grace whose pod the informer cache
// does not show; and the CNI GC verb frees attachments the runtime no longer lists (a GC without a
// valid-attachments list frees nothing). All three re-read the pod from the API server (not the
// cache) and keep the attachment when that pod still exists or the read fails. A pod that is gone is not a stopped sandbox: its attachment is freed
// at once only when the network namespace path recorded at ADD (CNI_NETNS) no longer exists,
// never while it exists (reported after --gc-sandbox-grace, event IPAddressSandboxOutlivesPod),
// after --gc-sandbox-grace when the agent cannot check the path (--netns-dirs), and after
// --gc-grace for attachments recorded without a path. A free goes through the DEL path: journal
// first, then the pool's reuse cooldown. --gc-dry-run reports (log,
// IPAddressGarbageCollectionDryRun events, metrics) what would be freed and frees nothing. Events
// IPAddressGarbageCollected and IPAddressGarbageCollectionFailed go on the pod when the agent saw
// its deletion, else on the node's NodeIPAllocation.
//
// # Pool edits
//
// The agent never hands out an address outside its pool's current spec (CIDRs less spec.exclude,
// the gateway and the reserved network/broadcast addresses; ipam.Pool.Usable), even while its
// status holds it: free ones are released at the next monitor round, ones in use when freed.
//
// # A lost journal
//
// If the journal is missing or empty, the addresses of running pods are known from what the node
// shows: the container runtime's sandboxes (--cri-socket, the pod network only), else the pods'
// status.podIPs, and Multus' network-status for secondary networks (docs/design.md, "The node
// forgets"). Each such pod (bound to the node, not host-network, not Succeeded/Failed) whose
// address lies in one of the node's pools of that network gets an attachment keyed by its pod UID
// (ipam.RebuiltKey), because its container ID is unknown. Those addresses are never handed out
// while the record exists, and the rest of the node's holding stays out of use until the hold,
// network by network, ends. CNI GC never frees a rebuilt record (no runtime can list its
// container ID); the leak collector frees it by pod UID once the pod is gone and the runtime no
// longer shows its sandbox. When an ADD later
// arrives for that pod UID, it is the pod's new sandbox: kubelet has stopped the old one (and its DEL, for a
// container ID the agent does not know, was a no-op success), so the ADD adopts the recorded
// addresses of the pools it asks for and the pod keeps its address. The DEL of the old container
// ID can never free the adopted addresses, since it names a different attachment. With --dra, the
// DRA reservations the journal held are re-created from their claims' status entries, which the
// driver writes only after a reservation is journaled, before the hold starts
// (docs/design.md, "After a lost journal").
package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"

	"github.com/ipwarden/ipwarden/internal/agent/cri"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/nodesignal"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// ReasonJournalRecovered is the event on the node's NodeIPAllocation when a damaged journal was
// moved aside.
const ReasonJournalRecovered = "JournalRecovered"

// Config configures Run.
type Config struct {
	Node        string
	RestConfig  *rest.Config
	Scheme      *runtime.Scheme
	Socket      string
	StateDir    string
	Pools       []string
	AddressWait time.Duration
	MetricsAddr string
	ProbeAddr   string
	Resync      time.Duration
	// RequestCoalesce is the pool monitor's coalescing quiet time (Monitor.SetCoalesce).
	RequestCoalesce time.Duration
	// GCGrace: an attachment younger than this is never freed by the full check or CNI GC.
	GCGrace time.Duration
	// GCFullCheckInterval is the period of the leak collector's full check (default 5m).
	GCFullCheckInterval time.Duration
	// GCDryRun: the leak collector and CNI GC report what they would free and free nothing.
	GCDryRun bool
	// GCSandboxGrace: a gone pod's attachment whose network namespace the agent cannot check is
	// freed this long after the pod was gone; one whose namespace still exists is reported then
	// (and kept). Default 10m.
	GCSandboxGrace time.Duration
	// NetnsDirs are the directories in which the agent sees pods' network namespaces (default
	// DefaultNetnsDirs).
	NetnsDirs []string
	// LeaseNamespace holds the node's Lease ipwarden-agent-<node> (one agent per node).
	LeaseNamespace string
	// LeaseDuration and LeaseRenew: another agent takes the node's Lease once it has not been
	// renewed for LeaseDuration; the holder renews it every LeaseRenew [DefaultLeaseDuration,
	// DefaultLeaseRenew].
	LeaseDuration, LeaseRenew time.Duration
	// ControllerLease names the controller's leader election Lease in LeaseNamespace; the agent
	// acknowledges each new leader (spec.acknowledgedLeader). Empty: it acknowledges none.
	ControllerLease string
	// RebuildHold bounds the unattributed hold after the journal was rebuilt from the pods.
	RebuildHold time.Duration
	// CRISocket is the container runtime's CRI endpoint, read-only: the node's own evidence of
	// its pod sandboxes for the rebuild and the hold (package cri). "" asks nothing.
	CRISocket string
	// ExhaustedTaint adds the NoSchedule taint ipwarden.io/addresses-exhausted with the Node
	// condition ipwarden.io/AddressesExhausted (the condition is always shown).
	ExhaustedTaint bool
	// ExhaustedClearFree: the signal clears when every pool has this many free addresses.
	ExhaustedClearFree int
	// DRA runs the DRA kubelet plugin of driver ipam.ipwarden.io (dra_shell.go).
	DRA DRAConfig
	Log logr.Logger
}

// Run runs the agent until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Log
	if cfg.Node == "" {
		return errors.New("the node name is empty: pass --node-name or set NODE_NAME")
	}
	if cfg.RebuildHold <= 0 {
		cfg.RebuildHold = 5 * time.Minute
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := NewMetrics(reg)

	j, st, start, err := openState(cfg.StateDir, cfg.Node, time.Now(), cfg.RebuildHold, metrics, log)
	if err != nil {
		return err
	}
	defer func() {
		if err := j.Close(); err != nil {
			log.Error(err, "close journal")
		}
	}()

	svc := NewService(st, j, ServiceOptions{Node: cfg.Node, AddressWait: cfg.AddressWait, GCGrace: cfg.GCGrace, GCDryRun: cfg.GCDryRun,
		LeaseNamespace: cfg.LeaseNamespace, Gated: true, ReadsPods: true, NetnsDirs: cfg.NetnsDirs, RebuildHold: cfg.RebuildHold, HoldDir: cfg.StateDir,
		Log: log.WithName("service"), Metrics: metrics})
	offline := start.offline
	svc.setServeOffline(offline)
	identity, err := Identity(cfg.StateDir)
	if err != nil {
		return err
	}
	if err := ServeHTTP(ctx, cfg.MetricsAddr, MetricsHandler(reg), log); err != nil {
		return fmt.Errorf("metrics endpoint: %w", err)
	}
	if err := ServeHTTP(ctx, cfg.ProbeAddr, HealthHandler(svc), log); err != nil {
		return fmt.Errorf("health endpoint: %w", err)
	}

	events, err := newEventBroadcaster(ctx, cfg.RestConfig)
	if err != nil {
		return err
	}
	defer events.Shutdown()

	// Serve from the journal first: DEL at once, ADD from the addresses the journal holds (see
	// gate), whether or not the API server answers.
	if err := waitSocketFree(ctx, cfg.Socket, log); err != nil {
		return err
	}
	l, err := Listen(cfg.Socket)
	if err != nil {
		return err
	}
	defer os.Remove(cfg.Socket)
	runtime, err := cri.New(cfg.CRISocket, 5*time.Second)
	if err != nil {
		return fmt.Errorf("--cri-socket: %w", err)
	}
	defer runtime.Close()
	svc.SetReady(true)
	log.Info("serving CNI requests from the journal", "socket", cfg.Socket, "addFromJournal", offline, "identity", identity)
	// A journal that breaks while serving (bbolt failed writing it) stops the agent: the next
	// start moves it aside and rebuilds from the pods, as for damage found at start.
	serveCtx, stopServing := context.WithCancel(ctx)
	defer stopServing()
	go func() {
		select {
		case <-j.Broken():
			log.Error(j.BrokenErr(), "the journal broke: stopping; the next start moves it aside and rebuilds from the pods")
			stopServing()
		case <-serveCtx.Done():
		}
	}()
	served := make(chan error, 1)
	go func() { served <- Serve(serveCtx, l, svc, cfg.AddressWait+30*time.Second, log.WithName("socket")) }()

	// Then reach the API server, in the background of the socket: informers, the node's Lease,
	// the NodeIPAllocation, reconciliation. Leak collection and spec publishing wait for it.
	gcCtx, stopGC := context.WithCancel(serveCtx)
	defer stopGC()
	collected := make(chan struct{})
	start.runtime = runtime
	go func() {
		defer close(collected)
		if err := catchUp(gcCtx, cfg, svc, events, identity, start, log); err != nil && gcCtx.Err() == nil {
			log.Error(err, "reconciliation with the API server failed")
		}
	}()
	err = <-served
	stopGC()
	<-collected                                // no free in flight when the journal closes
	_ = svc.WaitReleases(context.Background()) // nor a DEL or ADD already answered: it finishes (the journal is open)
	if berr := j.BrokenErr(); berr != nil {
		return berr
	}
	return err
}

// catchUp connects the agent to the API server, retrying while it is away: it starts the
// informers, takes the node's Lease (waiting while another agent holds it), waits for the
// NodeIPAllocation, reconciles, and then runs the pool monitor, the watch loop and the leak
// collector until ctx ends.
func catchUp(ctx context.Context, cfg Config, svc *Service, events record.EventBroadcaster, identity string, start startFacts, log logr.Logger) error {
	backoff := 500 * time.Millisecond
	var lastLog time.Time
	var kube *Kube
	var collector *Collector
	// The node's own evidence before any rebuild: the informers' first pushes rebuild from the
	// pods (Service.SetPods) as soon as they start, and a stale status must not be recorded for
	// a pod whose sandbox the runtime shows with another address. reconcileStart reads again.
	svc.SetSandboxes(readSandboxes(ctx, start.runtime, svc.Metrics(), log))
	for {
		var err error
		if kube == nil {
			// The informer cache needs the API server's discovery to be set up.
			ctrlLease := types.NamespacedName{Namespace: cfg.LeaseNamespace, Name: cfg.ControllerLease}
			if kube, err = NewKube(cfg.RestConfig, cfg.Scheme, cfg.Node, cfg.Pools, ctrlLease, svc, log.WithName("kube")); err == nil {
				kube.OnLeaderChange(svc.kick)
				svc.SetEvents(events.NewRecorder(eventScheme(cfg.Scheme), corev1.EventSource{Component: "ipwarden-agent", Host: cfg.Node}), kube.NodeRef)
				svc.SetPodLookup(kube.GetPod)
				svc.SetPodMeta(kube.PodMeta)
				if claims, err := newClaimReader(cfg.RestConfig, log.WithName("ipamclaims")); err == nil {
					svc.SetClaimReader(claims.Read)
					go claims.run(ctx)
				} else {
					log.Error(err, "cannot create the IPAMClaim client; ADDs of pods that reference an IPAMClaim fail")
				}
				svc.SetWhereaboutsLister(kube.ListWhereaboutsPools)
				svc.SetWhereaboutsEditor(kube.EditWhereaboutsPools)
				collector = NewCollector(svc, kube, CollectorOptions{Grace: cfg.GCGrace, FullCheckInterval: cfg.GCFullCheckInterval,
					SandboxGrace: cfg.GCSandboxGrace, NetnsDirs: cfg.NetnsDirs, QueueMetrics: svc.Metrics().Queue, Log: log.WithName("gc")})
				kube.OnPodDelete(collector.OnPodDelete)
			} else {
				kube = nil
			}
		}
		if kube != nil {
			if err = kube.Start(ctx); err == nil {
				break
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		svc.setAPIError(err)
		if time.Since(lastLog) > 10*time.Second {
			log.Info("waiting for the API server; serving from the journal meanwhile", "error", err.Error(), "retryIn", backoff.String())
			lastLog = time.Now()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 10*time.Second)
	}
	lease := NewNodeLease(kube.API(), cfg.LeaseNamespace, cfg.Node, identity, cfg.LeaseDuration, cfg.LeaseRenew, svc, log.WithName("lease"))
	leaseDone := make(chan struct{})
	go func() {
		defer close(leaseDone)
		lease.Run(ctx)
	}()
	defer func() { <-leaseDone }() // the Lease is given up before the journal closes
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-lease.Held():
	}
	svc.setStage("waiting for the controller to create NodeIPAllocation " + cfg.Node)
	if err := kube.WaitForAllocation(ctx); err != nil {
		return err
	}
	if start.recovered != nil {
		svc.nodeEvent(corev1.EventTypeWarning, ReasonJournalRecovered,
			fmt.Sprintf("the agent's journal was damaged (%s: %s); it was moved to %s and the node's attachments are rebuilt from what the node shows (the runtime's sandboxes, the pods' reports)",
				start.recovered.Reason, cniproto.Truncate(start.recovered.Problem, 300), start.recovered.MovedTo))
	}
	svc.setStage("reconciling with the API server")
	var pods []ipam.Pod
	for {
		var err error
		if pods, err = kube.Push(ctx); err == nil {
			break
		}
		log.Error(err, "start-up reconciliation failed; retrying")
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	// The node's own evidence, read again now that the pods are known: the sandboxes the runtime
	// shows, for the rebuild and the hold (docs/design.md, "The node forgets").
	ev := readSandboxes(ctx, start.runtime, svc.Metrics(), log)
	n, err := reconcileStart(svc, pods, ev, recoveryEvidence(ctx, cfg, svc, log.WithName("dra")), cfg.StateDir, start, cfg.RebuildHold, time.Now(), log)
	if err != nil {
		return err
	}
	if on, _ := svc.Hold(); on {
		go watchHold(ctx, svc, start.runtime, log)
	}
	svc.setSynced()
	served, attachments, unknown := svc.servedSummary(cfg.Pools)
	log.Info("reconciled with the API server", "pools", served, "attachments", attachments, "rebuiltFromPods", n)
	for _, want := range unknown {
		log.Error(nil, "--pools names a pool that does not exist", "pool", want)
	}
	mon := NewMonitor(svc, kube, cfg.Resync, log.WithName("monitor"))
	signal := NewNodeSignal(kube.API(), cfg.Node, cfg.ExhaustedTaint, nodesignal.Params{ClearFree: cfg.ExhaustedClearFree}, log.WithName("signal"))
	signal.SetReporting(events.NewRecorder(eventScheme(cfg.Scheme), corev1.EventSource{Component: "ipwarden-agent", Host: cfg.Node}),
		svc.Metrics().AddressesExhausted)
	mon.SetSignal(signal)
	mon.SetCoalesce(cfg.RequestCoalesce)
	svc.SetKick(mon.Kick, mon.KickNow)
	if err := mon.Round(ctx); err != nil {
		log.Error(err, "first pool monitor round failed; retrying in the background")
	}
	go mon.Run(ctx)
	go kube.Run(ctx)
	if cfg.DRA.Enabled {
		go runDRA(ctx, cfg, svc, log.WithName("dra"))
	}
	collector.Run(ctx)
	return nil
}

// readSandboxes reads the runtime's pod sandboxes; a runtime that is not configured or does not
// answer gives no evidence (Known false), and the rules fall back to the pods' own reports.
func readSandboxes(ctx context.Context, r *cri.Reader, metrics *Metrics, log logr.Logger) ipam.NodeSandboxes {
	if r == nil {
		metrics.RuntimeReads.WithLabelValues("off").Inc()
		return ipam.NodeSandboxes{}
	}
	ev, err := r.Read(ctx)
	if err != nil {
		metrics.RuntimeReads.WithLabelValues("error").Inc()
		log.Error(err, "cannot read the node's pod sandboxes from the container runtime: the rebuild rests on the pods' own reports, network by network, and nothing leaves the hold before its deadline until a reading succeeds",
			"criSocket", r.Endpoint())
		return ipam.NodeSandboxes{Unreadable: true}
	}
	metrics.RuntimeReads.WithLabelValues("ok").Inc()
	names := make([]string, 0, min(len(ev.Sandboxes), 20))
	for i, sb := range ev.Sandboxes {
		if i == 20 {
			names = append(names, fmt.Sprintf("and %d more", len(ev.Sandboxes)-20))
			break
		}
		state := "ready"
		if !sb.Ready {
			state = "notready"
		}
		names = append(names, fmt.Sprintf("%s %s (%s) %v", cniproto.Truncate(sb.ID, 13), sb.Pod.String(), state, sb.IPs))
	}
	log.V(1).Info("read the node's pod sandboxes from the container runtime", "criSocket", r.Endpoint(), "sandboxes", len(ev.Sandboxes), "read", names)
	return ev
}

// watchHold reads the runtime's sandboxes again every 2 s while the hold after a rebuild lasts,
// records what they show and evaluates the hold; once it ends the reading is dropped.
func watchHold(ctx context.Context, svc *Service, r *cri.Reader, log logr.Logger) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		if on, _ := svc.Hold(); !on {
			svc.SetSandboxes(ipam.NodeSandboxes{})
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if r != nil {
			svc.RefreshSandboxes(readSandboxes(ctx, r, svc.Metrics(), log))
		} else {
			svc.RefreshSandboxes(ipam.NodeSandboxes{})
		}
	}
}

// waitSocketFree waits while another agent answers on socket (a second agent for the node with
// another journal must not take the socket from the one serving); a stale socket file is replaced
// by Listen.
func waitSocketFree(ctx context.Context, socket string, log logr.Logger) error {
	for i := 0; ; i++ {
		c, err := net.DialTimeout("unix", socket, time.Second)
		if err != nil {
			return nil
		}
		c.Close()
		if i%15 == 0 {
			log.Error(nil, "another process answers on the agent's socket (a second agent for this node?); waiting for it to stop", "socket", socket)
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(2 * time.Second):
		}
	}
}

// newEventBroadcaster sends events to the API server (core/v1 Events).
func newEventBroadcaster(ctx context.Context, cfg *rest.Config) (record.EventBroadcaster, error) {
	cs, err := typedcorev1.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("create events client: %w", err)
	}
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.Events("")})
	return b, nil
}

func eventScheme(s *runtime.Scheme) *runtime.Scheme {
	if s == nil {
		return clientgoscheme.Scheme
	}
	return s
}
