package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
)

// The controller runs with hostNetwork (it must work before pod networking does), so two
// replicas on one node share the node's ports. Its probes therefore go through a file in the
// pod's own emptyDir (an exec probe runs `ipwarden probe`), and its metrics listener treats a
// port already taken by the other replica on the node as "retry later", not as fatal.

// Health file contents.
const (
	healthAlive = "alive"
	healthReady = "ready"
)

// probeVerdict decides an exec probe from the health file: fresh (written within maxAge) and,
// for readiness, saying "ready". A nil error means the probe passes.
func probeVerdict(content string, written, now time.Time, maxAge time.Duration, wantReady bool) error {
	if age := now.Sub(written); age > maxAge {
		return fmt.Errorf("health file last written %s ago (more than %s): the controller is stuck or gone", age.Round(time.Second), maxAge)
	}
	switch state := strings.TrimSpace(content); state {
	case healthReady:
		return nil
	case healthAlive:
		if wantReady {
			return errors.New("not ready: informer caches not synced yet")
		}
		return nil
	default:
		return fmt.Errorf("health file holds %q, want %q or %q", state, healthAlive, healthReady)
	}
}

func newProbeCommand() *cobra.Command {
	var file string
	var maxAge time.Duration
	var ready bool
	cmd := &cobra.Command{
		Use:   "probe",
		Short: "Exec probe of the controller: check its health file (exit 0 when healthy)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			fi, err := os.Stat(file)
			if err != nil {
				return fmt.Errorf("health file: %w", err)
			}
			f, err := os.Open(file)
			if err != nil {
				return fmt.Errorf("health file: %w", err)
			}
			defer f.Close()
			buf := make([]byte, 64) // bounded: the file holds one word
			n, _ := f.Read(buf)
			return probeVerdict(string(buf[:n]), fi.ModTime(), time.Now(), maxAge, ready)
		},
	}
	cmd.Flags().StringVar(&file, "file", "/run/ipwarden-controller/health", "the controller's --health-file")
	cmd.Flags().DurationVar(&maxAge, "max-age", 30*time.Second, "fail when the file is older than this")
	cmd.Flags().BoolVar(&ready, "ready", false, "readiness: also require the controller's caches to be synced")
	return cmd
}

// writeHealthFile rewrites path every interval with "ready" once ready() holds, else "alive",
// until ctx ends. Each write is a rename, so a probe never reads half a file.
func writeHealthFile(ctx context.Context, log logr.Logger, path string, interval time.Duration, ready func() bool) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		state := healthAlive
		if ready() {
			state = healthReady
		}
		tmp := path + ".tmp"
		err := os.WriteFile(tmp, []byte(state+"\n"), 0o644)
		if err == nil {
			err = os.Rename(tmp, path)
		}
		if err != nil {
			log.Error(err, "cannot write the health file", "path", path)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// serveMetrics serves reg on addr until ctx ends. While the address is in use (the other
// controller replica on this node serves it) it retries every retry interval.
func serveMetrics(ctx context.Context, log logr.Logger, addr string, reg prometheus.Gatherer, retry time.Duration) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	logged := false
	for ctx.Err() == nil {
		ln, err := net.Listen("tcp", addr)
		if errors.Is(err, syscall.EADDRINUSE) {
			if !logged {
				log.Info("metrics address in use, probably by the other controller replica on this node; retrying", "address", addr, "interval", retry)
				logged = true
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(retry):
			}
			continue
		}
		if err != nil {
			log.Error(err, "cannot serve metrics", "address", addr)
			return
		}
		log.Info("serving metrics", "address", ln.Addr().String())
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error(err, "metrics server stopped", "address", addr)
		}
		return
	}
}

// ensureDir makes the health file's directory (an emptyDir in the Deployment).
func ensureDir(path string) error {
	return os.MkdirAll(filepath.Dir(path), 0o755)
}
