package localcluster

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

// Race is true in a program built with -race. GoBuild then builds the processes it starts with
// -race too, so a race in a real controller or agent fails the test that ran it (DataRace).
const Race = raceEnabled

// RaceEnv is the environment entry that keeps a race-built program from sleeping at exit (the
// race runtime's atexit_sleep_ms, 1000 ms by default): a test that runs the race-built plugin for
// every CNI call would otherwise wait a second per call. Races are still reported, and a program
// that found one still exits with status 66.
const RaceEnv = "GORACE=atexit_sleep_ms=0"

// QuickRaceExit puts RaceEnv into this process's environment, which the programs it starts
// inherit, unless GORACE is set already.
func QuickRaceExit() {
	if _, set := os.LookupEnv("GORACE"); !set {
		os.Setenv("GORACE", strings.TrimPrefix(RaceEnv, "GORACE="))
	}
}

// GoBuild is one `go build`: the one way tests, the demo and the bench compile a program.
type GoBuild struct {
	// Dir is the directory the build runs in (the module's root for "./cmd/..." packages).
	Dir string
	// Out is the output file, or a directory ending in a path separator for several packages.
	Out string
	// Pkgs are the packages to build.
	Pkgs []string
	// Static builds without cgo and with -trimpath (the container images' binaries). It never
	// adds -race (which needs cgo).
	Static bool
	// NoRace never adds -race (tools the tests use, not programs under test).
	NoRace bool
	// Tags are build tags, passed as -tags a,b (the integration tests' agent is built with
	// "failpoints"). A Static build (a release or image binary) refuses them.
	Tags []string
	// Log receives the build's output as it runs; nil keeps it for the error.
	Log io.Writer
}

// Run builds, with -race when this program has it (Race) unless Static, and with Tags.
func (b GoBuild) Run() error {
	if b.Static && len(b.Tags) > 0 {
		return fmt.Errorf("go build %s: a static (release or image) build takes no build tags, got %s", b.Out, strings.Join(b.Tags, ","))
	}
	args := []string{"build", "-o", b.Out}
	switch {
	case b.Static:
		args = append(args, "-trimpath")
	case Race && !b.NoRace:
		args = append(args, "-race")
	}
	if len(b.Tags) > 0 {
		args = append(args, "-tags", strings.Join(b.Tags, ","))
	}
	return goCmd(b.Dir, b.Log, b.env(), append(args, b.Pkgs...)...)
}

func (b GoBuild) env() []string {
	if b.Static {
		return []string{"CGO_ENABLED=0"}
	}
	return nil
}

// GoInstall installs pkg@version into gobin (outside any module).
func GoInstall(pkgAtVersion, gobin string, log io.Writer) error {
	return goCmd(os.TempDir(), log, []string{"GOBIN=" + gobin}, "install", pkgAtVersion)
}

func goCmd(dir string, log io.Writer, env []string, args ...string) error {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	var out bytes.Buffer
	if log != nil {
		cmd.Stdout, cmd.Stderr = log, log
	} else {
		cmd.Stdout, cmd.Stderr = &out, &out
	}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out.Bytes())
	}
	return nil
}

var (
	onceMu sync.Mutex
	built  = map[string]*buildResult{}
)

type buildResult struct {
	once sync.Once
	err  error
}

// BuildOnce builds pkg (relative to root, e.g. "./cmd/ipwarden") into out the first time this
// process asks for out, and returns the first build's error after that: a test binary builds
// each program once however many tests run it.
func BuildOnce(root, out, pkg string) error {
	return GoBuild{Dir: root, Out: out, Pkgs: []string{pkg}}.Once()
}

// Once runs the build the first time this process asks for b.Out (see BuildOnce).
func (b GoBuild) Once() error {
	onceMu.Lock()
	r, ok := built[b.Out]
	if !ok {
		r = &buildResult{}
		built[b.Out] = r
	}
	onceMu.Unlock()
	r.once.Do(func() {
		if r.err = os.MkdirAll(filepath.Dir(b.Out), 0o755); r.err != nil {
			return
		}
		r.err = b.Run()
	})
	return r.err
}

// FreePorts reserves n distinct free loopback TCP ports and releases them before it returns,
// for a program that must be told its port: another process could take one in between, which
// the caller sees as that program failing to listen.
func FreePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free loopback port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// FreeAddr is one free loopback address, host:port (see FreePorts).
func FreeAddr() (string, error) {
	ports, err := FreePorts(1)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("127.0.0.1:%d", ports[0]), nil
}
