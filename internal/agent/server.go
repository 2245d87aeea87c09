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

// Bounds of the agent socket. A plugin connects, writes one request of at most
// cniproto.MaxRequest bytes at once and half-closes, so a connection that has not sent its
// request within requestReadTimeout is idle and is closed. Reading a request and handling it are
// bounded separately, so idle or slow clients, which only ever read, never hold a slot an ADD
// needs, and the accept loop never waits: with 1,000 idle connections open an ADD is answered as
// fast as without (it once waited 21 s behind them).
var (
	// maxReaders bounds the connections whose request is being read (memory: each buffers at
	// most cniproto.MaxRequest bytes); one beyond it is answered "busy" at once.
	maxReaders = 1024
	// maxConns bounds the requests handled at once.
	maxConns = 128
	// busyWait is how long a read request waits for a handling slot before it is answered "busy".
	busyWait           = 2 * time.Second
	requestReadTimeout = 3 * time.Second
)

const (
	responseTimeout = 10 * time.Second
	// logIDBytes bounds a container ID in a log line.
	logIDBytes = 80
)

// errPluginGone cancels a request whose plugin closed its connection before the answer.
var errPluginGone = errors.New("the plugin closed its connection before the agent answered (the runtime gave up on the request)")

// Serve answers plugin connections on l until ctx ends, then waits for requests in flight. The
// accept loop never blocks: each connection's request is read in its own goroutine (at most
// maxReaders at once, within requestReadTimeout), then handled when one of maxConns slots is free
// within busyWait; a connection beyond either bound is answered with CNI error 11 "busy".
func Serve(ctx context.Context, l net.Listener, svc *Service, requestTimeout time.Duration, log logr.Logger) error {
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	defer wg.Wait()
	readers := make(chan struct{}, maxReaders)
	slots := make(chan struct{}, maxConns)
	var backoff time.Duration
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// As net/http's Serve: back off from 5 ms doubling to 1 s (out of file descriptors,
			// say), so a failing accept does not spin.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			log.Error(err, "accept on the agent socket", "retryIn", backoff.String())
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		if !acquire(ctx, readers, 0) {
			svc.Metrics().Busy.Inc()
			go busy(conn)
			continue
		}
		svc.Metrics().Conns.Inc()
		wg.Go(func() {
			defer svc.Metrics().Conns.Dec()
			serveConn(ctx, conn, svc, requestTimeout, log, func() { <-readers }, slots)
		})
	}
}

func acquire(ctx context.Context, slots chan struct{}, wait time.Duration) bool {
	select {
	case slots <- struct{}{}:
		return true
	default:
	}
	if wait <= 0 {
		return false
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case slots <- struct{}{}:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// busy answers a connection beyond maxConns without reading its request.
func busy(conn net.Conn) {
	defer conn.Close()
	_ = conn.SetWriteDeadline(time.Now().Add(time.Second))
	_ = cniproto.WriteResponse(conn, errResp(cniproto.CodeTryAgainLater,
		fmt.Sprintf("the ipwarden agent is busy: %d requests in progress", maxConns), "the runtime retries"))
}

// serveConn reads one request (then calls doneReading), waits for a handling slot, handles the
// request with heartbeats to the plugin (cniproto.WriteHeartbeats), and answers.
func serveConn(ctx context.Context, conn net.Conn, svc *Service, timeout time.Duration, log logr.Logger, doneReading func(), slots chan struct{}) {
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(requestReadTimeout))
	req, err := cniproto.ReadRequest(conn)
	doneReading()
	var resp *cniproto.Response
	var undo func()
	if err == nil {
		if !acquire(ctx, slots, busyWait) {
			svc.Metrics().Busy.Inc()
			busy(conn)
			return
		}
		defer func() { <-slots }()
	}
	if err != nil {
		var pe *cniproto.Error
		if !errors.As(err, &pe) {
			pe = &cniproto.Error{Code: cniproto.CodeIOFailure, Msg: "ipwarden agent: cannot read the request: " + cniproto.Truncate(err.Error(), 200)}
		}
		resp = &cniproto.Response{Error: pe}
		svc.Metrics().BadRequests.Inc()
		log.V(1).Info("bad request", "op", cniproto.Truncate(string(req.Op), 16), "error", pe.Msg)
	} else {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		rctx, cancelCause := context.WithCancelCause(rctx)
		stopWatch := watchHangup(conn, func() { cancelCause(errPluginGone) })
		_ = conn.SetWriteDeadline(time.Now().Add(timeout + responseTimeout))
		stopBeats := cniproto.WriteHeartbeats(conn)
		resp, undo = svc.HandleRequest(rctx, req)
		stopBeats()
		stopWatch()
		if undo != nil && context.Cause(rctx) == errPluginGone {
			undo() // the plugin is gone: nobody will configure these addresses
			undo = nil
			resp = nil
		}
		cancelCause(nil)
		cancel()
	}
	if resp == nil {
		return
	}
	_ = conn.SetWriteDeadline(time.Now().Add(responseTimeout))
	if err := cniproto.WriteResponse(conn, resp); err != nil {
		log.Error(err, "cannot answer the plugin; it will see a broken connection and the runtime retries", "op", req.Op,
			"containerID", cniproto.Truncate(req.ContainerID, logIDBytes))
		if undo != nil {
			undo()
		}
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
