// Package localcluster runs ipwarden on this machine as a user would run it on a cluster: real
// `ipwarden controller` and `ipwarden agent` processes against a local control plane
// (internal/controlplane), and pods started through the real CNI plugin binary, in network
// namespaces with the bridge plugin when run as root. It is the one way to run local things:
// one binary builder (GoBuild, BuildOnce), one process runner (Start, Process), one condition
// poller (WaitFor) and one free-port helper (FreePorts, FreeAddr), used by the control plane,
// the integration, end-to-end, chaos and real-node tests, the plugin's tests, the demo and the
// bench.
package localcluster

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Binaries are the programs a local cluster runs.
type Binaries struct {
	// Ipwarden is the ipwarden binary (controller, agent, check).
	Ipwarden string
	// CNIDir is a CNI_PATH holding ipwarden (the ipwarden-cni binary under its CNI type name),
	// bridge and host-local.
	CNIDir string
}

// PluginsVersion is the containernetworking/plugins release whose bridge and host-local plugins
// the local cluster, the end-to-end tests and the bench run.
const PluginsVersion = "v1.9.1"

// Build compiles ipwarden and ipwarden-cni from the tree at root into binDir (once per process,
// with -race in a race-built program: GoBuild) and installs the bridge and host-local plugins
// (PluginsVersion) when they are missing.
func Build(root, binDir string, log io.Writer) (Binaries, error) {
	b := Binaries{Ipwarden: filepath.Join(binDir, "ipwarden"), CNIDir: filepath.Join(binDir, "cni")}
	if err := os.MkdirAll(b.CNIDir, 0o755); err != nil {
		return b, err
	}
	if err := BuildOnce(root, b.Ipwarden, "./cmd/ipwarden"); err != nil {
		return b, err
	}
	if err := BuildOnce(root, filepath.Join(b.CNIDir, "ipwarden"), "./cmd/ipwarden-cni"); err != nil {
		return b, err
	}
	return b, InstallPlugins(b.CNIDir, log, "main/bridge", "ipam/host-local")
}

// InstallPlugins installs the containernetworking plugins named (e.g. "main/bridge") at
// PluginsVersion into cniDir when they are missing.
func InstallPlugins(cniDir string, log io.Writer, plugins ...string) error {
	for _, plugin := range plugins {
		if _, err := os.Stat(filepath.Join(cniDir, filepath.Base(plugin))); err == nil {
			continue
		}
		pkg := "github.com/containernetworking/plugins/plugins/" + plugin + "@" + PluginsVersion
		fmt.Fprintln(log, "installing", pkg, "into", cniDir)
		if err := GoInstall(pkg, cniDir, nil); err != nil {
			return err
		}
	}
	return nil
}

// Process is a running ipwarden component.
type Process struct {
	Name string
	Log  string
	bin  string
	args []string
	env  []string // added to this process's environment

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	exitErr error // the last run's exit, once done is closed
}

// Start runs bin with args, logging to logPath. The process dies with this one (Pdeathsig).
func Start(name, bin, logPath string, args ...string) (*Process, error) {
	p := &Process{Name: name, Log: logPath, bin: bin, args: args}
	return p, p.start()
}

// StartEnv is Start with env added to the environment the process inherits (every run).
func StartEnv(name, bin, logPath string, env []string, args ...string) (*Process, error) {
	p := &Process{Name: name, Log: logPath, bin: bin, args: args, env: env}
	return p, p.start()
}

func (p *Process) start() error {
	f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	if len(p.env) > 0 {
		cmd.Env = append(os.Environ(), p.env...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	go func() {
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		p.exitErr = err
		p.mu.Unlock()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	return nil
}

// Pid is the current process id (for reading its /proc entries).
func (p *Process) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd.Process.Pid
}

// Cmd is the current run's command (its Process.Pid, for signals and /proc).
func (p *Process) Cmd() *exec.Cmd {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd
}

// Done is closed when the current run exits.
func (p *Process) Done() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// ExitErr is how the current run ended (nil while it runs or after a clean exit).
func (p *Process) ExitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitErr
}

// Running says whether the process has not exited.
func (p *Process) Running() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Kill sends SIGKILL, as a crash would, and waits for the exit.
func (p *Process) Kill() { p.signal(syscall.SIGKILL, 0) }

// Stop sends SIGTERM and waits up to 10 s before SIGKILL.
func (p *Process) Stop() { p.signal(syscall.SIGTERM, 10*time.Second) }

func (p *Process) signal(sig syscall.Signal, grace time.Duration) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	select {
	case <-done:
		return
	default:
	}
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	if grace > 0 {
		select {
		case <-done:
			return
		case <-time.After(grace):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
	}
	<-done
}

// Pause stops the process (SIGSTOP), as a long GC pause or a stalled VM would; Resume
// continues it (SIGCONT).
func (p *Process) Pause() { p.send(syscall.SIGSTOP) }

// Resume continues a paused process.
func (p *Process) Resume() { p.send(syscall.SIGCONT) }

func (p *Process) send(sig syscall.Signal) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	select {
	case <-done:
	default:
		_ = syscall.Kill(-cmd.Process.Pid, sig)
	}
}

// Restart starts the process again with the same arguments (after Kill or Stop).
func (p *Process) Restart() error {
	if p.Running() {
		p.Stop()
	}
	return p.start()
}

// LogTail is the end of the log, for error messages.
func (p *Process) LogTail(n int) string {
	b, _ := os.ReadFile(p.Log)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// DataRace returns the first data race report in the process's log, "" when there is none. A
// program built with -race (GoBuild in a race-built test) reports a race there and runs on.
func (p *Process) DataRace() string { return DataRaceIn(p.Log) }

// DataRaceIn returns the first data race report in the log file at path ("" when none).
func DataRaceIn(path string) string {
	b, _ := os.ReadFile(path)
	const mark = "WARNING: DATA RACE"
	i := strings.Index(string(b), mark)
	if i < 0 {
		return ""
	}
	b = b[i:]
	if j := strings.Index(string(b[len(mark):]), "=================="); j >= 0 {
		b = b[:len(mark)+j]
	}
	if len(b) > 6000 {
		b = b[:6000]
	}
	return string(b)
}

// scrapeClient bounds a scrape: a paused process accepts the connection and never answers.
var scrapeClient = &http.Client{Timeout: 2 * time.Second}

// ScrapeSum adds up the samples of one metric on a Prometheus text endpoint (0 when unreachable).
func ScrapeSum(url, metric string) float64 {
	resp, err := scrapeClient.Get(url)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, metric) {
			continue
		}
		if rest := line[len(metric):]; rest != "" && rest[0] != ' ' && rest[0] != '{' {
			continue // another metric with this name as a prefix
		}
		f := strings.Fields(line)
		if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
			sum += v
		}
	}
	return sum
}

// WaitFor polls cond every interval until it returns nil, ctx ends or timeout passes; the error
// then carries cond's last answer. A cond that returns Abort(err) ends the wait at once with err.
// Tests, the demo, the bench and the control plane wait on conditions with it, never on sleeps.
func WaitFor(ctx context.Context, timeout, interval time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		last := cond()
		if last == nil {
			return nil
		}
		if a, ok := last.(abortError); ok {
			return a.err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s: %w", timeout, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(interval):
		}
	}
}

// Abort makes WaitFor return err at once instead of polling on (the awaited thing cannot happen:
// the process exited).
func Abort(err error) error { return abortError{err} }

type abortError struct{ err error }

func (a abortError) Error() string { return a.err.Error() }
func (a abortError) Unwrap() error { return a.err }
