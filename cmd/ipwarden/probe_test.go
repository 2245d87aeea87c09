package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipwarden/ipwarden/internal/localcluster"
)

func TestProbeVerdict(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	cases := []struct {
		name      string
		content   string
		age       time.Duration
		wantReady bool
		wantErr   string
	}{
		{"alive passes liveness", "alive\n", time.Second, false, ""},
		{"alive fails readiness", "alive\n", time.Second, true, "not ready"},
		{"ready passes readiness", "ready\n", time.Second, true, ""},
		{"ready passes liveness", "ready", 0, false, ""},
		{"stale fails liveness", "ready\n", 31 * time.Second, false, "stuck or gone"},
		{"stale fails readiness", "ready\n", time.Minute, true, "stuck or gone"},
		{"exactly max age passes", "alive", 30 * time.Second, false, ""},
		{"garbage fails", "hello", time.Second, false, `holds "hello"`},
		{"empty fails", "", time.Second, false, `holds ""`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := probeVerdict(c.content, now.Add(-c.age), now, 30*time.Second, c.wantReady)
			if c.wantErr == "" && err != nil {
				t.Fatalf("want pass, got %v", err)
			}
			if c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)) {
				t.Fatalf("want error containing %q, got %v", c.wantErr, err)
			}
		})
	}
}

// Two controller replicas on one node (hostNetwork) share the metrics port: the second waits
// for it instead of failing, and takes over when the first goes away.
func TestServeMetricsWaitsForTakenPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "ipwarden_probe_test_total", Help: "test"}))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inUse := make(chan struct{})
	log := funcr.New(func(_, args string) {
		if strings.Contains(args, "address in use") {
			select {
			case <-inUse:
			default:
				close(inUse)
			}
		}
	}, funcr.Options{})
	done := make(chan struct{})
	go func() { defer close(done); serveMetrics(ctx, log, addr, reg, 20*time.Millisecond) }()
	select {
	case <-inUse:
	case <-time.After(10 * time.Second):
		t.Fatal("serveMetrics did not report the taken port")
	}
	select {
	case <-done:
		t.Fatal("serveMetrics gave up on a taken port")
	default:
	}
	ln.Close() // the other replica goes away
	err = localcluster.WaitFor(ctx, 10*time.Second, 10*time.Millisecond, func() error {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if !strings.Contains(string(b), "ipwarden_probe_test_total") {
			return io.ErrUnexpectedEOF
		}
		return nil
	})
	if err != nil {
		t.Fatalf("metrics not served after the port was freed: %v", err)
	}
	cancel()
	<-done
}
