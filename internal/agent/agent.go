// Package agent is ipwarden's node agent: it serves the CNI plugin's requests over a unix socket
// from the node's warm set of addresses, records every assignment in a durable journal before
// answering, and keeps the node's NodeIPAllocation request right-sized (the pool monitor).
//
// The decisions live in the pure state machine of package ipam; the journal in package journal.
// This package is the imperative shell: Service (requests, journal, waiting), Kube (informers
// and the spec write), Monitor (scaling rounds), Collector (leak collection), and Run, which
// wires them in this order:
//
//  1. open and load the journal (bbolt, <state-dir>/journal.db) and restore the state;
//  2. start the informers and wait for the controller to create the node's NodeIPAllocation;
//  3. reconcile: push pools, holdings and pods into the state (conflicts are logged and counted,
//     never dropped), and rebuild attachments for running pods whose addresses the journal lacks;
//  4. only then listen on the socket and serve; the monitor, the watch loop and the leak
//     collector run from here on.
//
// # Leak collection
//
// Addresses of pods that are gone come back without a CNI DEL in three ways (package gc holds the
// decisions and the safety argument): the deletion of a pod bound to the node frees the
// attachments recorded for its UID (event path); a full check every --gc-full-check-interval
// frees attachments older than --gc-grace whose pod the informer cache does not show; and the
// CNI GC verb frees attachments the runtime no longer lists. The first two re-read the pod from
// the API server (not the cache) just before freeing and keep the attachment when that pod still
// exists or the read fails. A free goes through the DEL path: journal first, then the pool's
// reuse cooldown. --gc-dry-run reports (log, IPAddressGarbageCollectionDryRun events, metrics)
// what would be freed and frees nothing. Events IPAddressGarbageCollected and
// IPAddressGarbageCollectionFailed go on the pod when the agent saw its deletion, else on the
// node's NodeIPAllocation.
//
// # A lost journal
//
// If the journal is missing or empty, the addresses of running pods are known only from their
// status.podIPs. Each such pod (bound to the node, not host-network, not Succeeded/Failed) whose
// address lies in one of the node's pools gets an attachment keyed by its pod UID
// (ipam.RebuiltKey), because its container ID is unknown. Those addresses are never handed out
// while the record exists. CNI GC never frees a rebuilt record (no runtime can list its
// container ID); the leak collector frees it by pod UID once the pod is gone. When an ADD later
// arrives for that pod UID, it is the pod's new sandbox: kubelet has stopped the old one (and its DEL, for a
// container ID the agent does not know, was a no-op success), so the ADD adopts the recorded
// addresses of the pools it asks for and the pod keeps its address. The DEL of the old container
// ID can never free the adopted addresses, since it names a different attachment.
//
// # Needs the API server to start
//
// The agent serves only after it has reconciled with the API server once. While it runs, an
// API server or etcd outage does not stop it: it serves ADD and DEL from the addresses it holds
// and catches up when the API returns. The journal already keeps the last holdings and pool
// settings, which a later version can use to start without the API server.
package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
)

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
	Log       logr.Logger
}

// Run runs the agent until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Log
	if cfg.Node == "" {
		return errors.New("the node name is empty: pass --node-name or set NODE_NAME")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := NewMetrics(reg)

	j, err := journal.Open(cfg.StateDir, journal.Options{Node: cfg.Node, ObserveWrite: func(d time.Duration) {
		metrics.JournalWrite.Observe(d.Seconds())
	}})
	if err != nil {
		return err
	}
	defer func() {
		if err := j.Close(); err != nil {
			log.Error(err, "close journal")
		}
	}()
	snap, err := j.Load()
	if err != nil {
		return fmt.Errorf("%w (move the file away to rebuild it from the pods' status)", err)
	}
	st := ipam.New(cfg.Node)
	for _, p := range st.Restore(snap) {
		log.Error(nil, "journal: "+p)
	}
	if snap.IsEmpty() {
		log.Info("the journal is empty (new node, or the journal was lost): attachments will be rebuilt from the pods' status.podIPs", "journal", j.Path())
	} else {
		log.Info("journal loaded", "journal", j.Path(), "attachments", len(snap.Attachments), "cooling", len(snap.Cooling),
			"releasing", len(snap.Releasing))
	}

	svc := NewService(st, j, ServiceOptions{Node: cfg.Node, AddressWait: cfg.AddressWait, GCGrace: cfg.GCGrace, GCDryRun: cfg.GCDryRun,
		Log: log.WithName("service"), Metrics: metrics})
	if err := ServeHTTP(ctx, cfg.MetricsAddr, MetricsHandler(reg), log); err != nil {
		return fmt.Errorf("metrics endpoint: %w", err)
	}
	if err := ServeHTTP(ctx, cfg.ProbeAddr, HealthHandler(svc), log); err != nil {
		return fmt.Errorf("health endpoint: %w", err)
	}

	kube, err := NewKube(cfg.RestConfig, cfg.Scheme, cfg.Node, cfg.Pools, svc, log.WithName("kube"))
	if err != nil {
		return err
	}
	events, err := newEventBroadcaster(ctx, cfg.RestConfig)
	if err != nil {
		return err
	}
	defer events.Shutdown()
	svc.SetEvents(events.NewRecorder(eventScheme(cfg.Scheme), corev1.EventSource{Component: "ipwarden-agent", Host: cfg.Node}), kube.NodeRef)
	collector := NewCollector(svc, kube, CollectorOptions{Grace: cfg.GCGrace, FullCheckInterval: cfg.GCFullCheckInterval,
		SandboxGrace: cfg.GCSandboxGrace, NetnsDirs: cfg.NetnsDirs, Log: log.WithName("gc")})
	kube.OnPodDelete(collector.OnPodDelete)
	if err := kube.Start(ctx); err != nil {
		return err
	}
	if err := kube.WaitForAllocation(ctx); err != nil {
		return err
	}
	pods, err := kube.Push(ctx)
	if err != nil {
		return fmt.Errorf("start-up reconciliation: %w", err)
	}
	n, err := svc.Rebuild(pods)
	if err != nil {
		return err
	}
	svc.With(func(st *ipam.State) {
		log.Info("reconciled with the API server", "pools", st.Served(), "attachments", st.NumAttachments(), "rebuiltFromPods", n)
		for _, want := range cfg.Pools {
			if _, ok := st.PoolConfig(want); !ok {
				log.Error(nil, "--pools names a pool that does not exist", "pool", want)
			}
		}
	})

	mon := NewMonitor(svc, kube, cfg.Resync, log.WithName("monitor"))
	svc.SetKick(mon.Kick)
	if err := mon.Round(ctx); err != nil {
		log.Error(err, "first pool monitor round failed; retrying in the background")
	}
	l, err := Listen(cfg.Socket)
	if err != nil {
		return err
	}
	defer os.Remove(cfg.Socket)
	svc.SetReady(true)
	log.Info("serving CNI requests", "socket", cfg.Socket)
	go mon.Run(ctx)
	go kube.Run(ctx)
	gcCtx, stopGC := context.WithCancel(ctx)
	collected := make(chan struct{})
	go func() {
		defer close(collected)
		collector.Run(gcCtx)
	}()
	err = Serve(ctx, l, svc, cfg.AddressWait+30*time.Second, log.WithName("socket"))
	stopGC()
	<-collected // no free in flight when the journal closes
	return err
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
