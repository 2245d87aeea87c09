// Package agent is ipwarden's node agent: it serves the CNI plugin's requests over a unix socket
// from the node's warm set of addresses, records every assignment in a durable journal before
// answering, and keeps the node's NodeIPAllocation request right-sized (the pool monitor).
//
// The decisions live in the pure state machine of package ipam; the journal in package journal.
// This package is the imperative shell: Service (requests, journal, waiting), Kube (informers
// and the spec write), Monitor (scaling rounds), and Run, which wires them in this order:
//
//  1. open and load the journal (bbolt, <state-dir>/journal.db) and restore the state;
//  2. start the informers and wait for the controller to create the node's NodeIPAllocation;
//  3. reconcile: push pools, holdings and pods into the state (conflicts are logged and counted,
//     never dropped), and rebuild attachments for running pods whose addresses the journal lacks;
//  4. only then listen on the socket and serve; the monitor and the watch loop run from here on.
//
// # A lost journal
//
// If the journal is missing or empty, the addresses of running pods are known only from their
// status.podIPs. Each such pod (bound to the node, not host-network, not Succeeded/Failed) whose
// address lies in one of the node's pools gets an attachment keyed by its pod UID
// (ipam.RebuiltKey), because its container ID is unknown. Those addresses are never handed out
// while the record exists. CNI GC never frees a rebuilt record (no runtime can list its
// container ID); the pod-deletion collector frees it by pod UID (ipam.State.PodAttachments lists
// a pod's attachments; the collector is not part of this package yet). When an ADD later arrives for
// that pod UID, it is the pod's new sandbox: kubelet has stopped the old one (and its DEL, for a
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
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"

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
	GCGrace     time.Duration
	Log         logr.Logger
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

	svc := NewService(st, j, ServiceOptions{Node: cfg.Node, AddressWait: cfg.AddressWait, GCGrace: cfg.GCGrace, Log: log.WithName("service"), Metrics: metrics})
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
	return Serve(ctx, l, svc, cfg.AddressWait+30*time.Second, log.WithName("socket"))
}
