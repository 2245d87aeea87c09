package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// Listen creates the agent's unix socket: its directory mode 0700 and the socket mode 0600, so
// only root reaches the agent. The directory must be the agent's own (it is made 0700), so shared
// directories such as /run or /tmp are refused. A stale socket file from an earlier run is
// replaced (the journal's file lock already guarantees that no other agent runs).
func Listen(path string) (net.Listener, error) {
	dir := filepath.Dir(path)
	if err := ownDirectory(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create socket directory %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("restrict socket directory %s to root: %w", dir, err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket: remove it or choose another --socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("restrict socket %s to root: %w", path, err)
	}
	return l, nil
}

// sharedDirs are directories the agent must never restrict to root.
var sharedDirs = map[string]bool{"/": true, "/run": true, "/var/run": true, "/tmp": true, "/var": true, "/var/lib": true,
	"/etc": true, "/opt": true, "/opt/cni": true, "/opt/cni/bin": true, "/dev/shm": true}

// ownDirectory refuses socket directories shared with others: well-known system directories and
// sticky (world-writable) ones.
func ownDirectory(dir string) error {
	dir = filepath.Clean(dir)
	shared := sharedDirs[dir]
	if fi, err := os.Stat(dir); err == nil && fi.Mode()&os.ModeSticky != 0 {
		shared = true
	}
	if shared {
		return fmt.Errorf("socket directory %s is shared: put the socket in a directory of its own, such as %s (the agent makes it 0700)",
			dir, filepath.Dir(cniproto.DefaultSocket))
	}
	return nil
}

// Serve answers plugin connections on l until ctx ends, then waits for requests in flight.
func Serve(ctx context.Context, l net.Listener, svc *Service, requestTimeout time.Duration, log logr.Logger) error {
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	defer wg.Wait()
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			log.Error(err, "accept on the agent socket")
			time.Sleep(50 * time.Millisecond)
			continue
		}
		wg.Go(func() { serveConn(ctx, conn, svc, requestTimeout, log) })
	}
}

func serveConn(ctx context.Context, conn net.Conn, svc *Service, timeout time.Duration, log logr.Logger) {
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	req, err := cniproto.ReadRequest(conn)
	var resp *cniproto.Response
	if err != nil {
		var pe *cniproto.Error
		if errors.As(err, &pe) {
			resp = &cniproto.Response{Error: pe}
		} else {
			resp = errResp(cniproto.CodeInternal, "ipwarden agent: "+err.Error(), "")
		}
	} else {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		resp = svc.Handle(rctx, req)
		cancel()
	}
	_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if err := cniproto.WriteResponse(conn, resp); err != nil {
		log.Error(err, "cannot answer the plugin; it will see a broken connection and the runtime retries", "op", req.Op,
			"containerID", req.ContainerID)
	}
}

// ServeHTTP serves handler on addr until ctx ends; addr "0" or "" disables it.
func ServeHTTP(ctx context.Context, addr string, handler http.Handler, log logr.Logger) error {
	if addr == "" || addr == "0" {
		return nil
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error(err, "HTTP server stopped", "address", addr)
		}
	}()
	return nil
}

// MetricsHandler serves reg's metrics.
func MetricsHandler(reg *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

// HealthHandler serves /healthz (the process answers) and /readyz (the socket serves).
func HealthHandler(svc *Service) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !svc.Ready() {
			http.Error(w, "not serving yet: reconciling the journal with the API server", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}
