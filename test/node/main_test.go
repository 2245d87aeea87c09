// Package node is the real-node suite: a real kubelet, kube-controller-manager and
// kube-scheduler (built from the pinned Kubernetes module, hack/tools) and Debian's containerd
// and runc run ipwarden from its own manifests (deploy/kustomize plus a thin test overlay), and
// real pods prove it. The runtime, not a test driver, calls the CNI plugin.
//
// It needs root and fails, never skips, without it (CI runs it as root). The test binary re-executes itself in a new network and mount namespace, so
// the node's address (on a dummy interface), the pods' bridge, iptables rules and mounts exist
// only there and nothing is ever sent off the machine. Everything that needs the network
// (module downloads, apt) happens before, in the parent.
package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// childEnv carries the prepared inputs from the parent to the re-executed test binary.
const childEnv = "IPWARDEN_NODE_SUITE"

// prepared is what the parent builds and installs for the child.
type prepared struct {
	Root     string
	BinDir   string
	Kubectl  string
	Ipwarden string // for `ipwarden agent list` and `ipwarden check` on the node
	Node     controlplane.NodeBinaries
	CNIDir   string // bridge, host-local, loopback, portmap (the node's own plugins)
	Images   []string
	// Whereabouts is the previous IPAM of TestRealNodeTakeoverFromWhereabouts and one the
	// pod-startup bench compares: built once, cached in BinDir.
	Whereabouts localcluster.Whereabouts
	Scratch     string // the suite's scratch directory (removed by the parent)
	Prepared    time.Duration
}

var prep prepared

func TestMain(m *testing.M) {
	if s := os.Getenv(childEnv); s != "" {
		if err := json.Unmarshal([]byte(s), &prep); err != nil {
			fmt.Fprintln(os.Stderr, "node: bad", childEnv, err)
			os.Exit(2)
		}
		os.Exit(m.Run())
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "node: FAIL: the real-node suite runs containerd and a kubelet in namespaces it creates: run it as root, as CI does")
		os.Exit(1)
	}
	os.Exit(parent())
}

// parent prepares everything that needs the network, runs the tests in new network and mount
// namespaces, then checks that nothing the suite started outlived it.
func parent() int {
	start := time.Now()
	p, err := prepare()
	if p.Scratch != "" {
		defer os.RemoveAll(p.Scratch)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "node: prepare:", err)
		return 1
	}
	p.Prepared = time.Since(start)
	hostBefore := hostNetworkState()
	b, _ := json.Marshal(p)
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Env = append(os.Environ(), childEnv+"="+string(b))
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Unshareflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWNS, // Go makes the new mount namespace private
		Pdeathsig:    syscall.SIGKILL,
	}
	code := 0
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "node: suite:", err)
		code = 1
	}
	// Nothing the suite started may outlive it: a process that names the scratch directory
	// (containerd, its shims, the kubelet, ...) is a leak.
	if left := processesMentioning(p.Scratch); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "node: FAIL: processes left running after the suite: %v; killing them\n", left)
		for pid := range left {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		code = 1
	}
	// Container processes live in the kubelets' cgroup roots, named for the scratch directory: a
	// shim killed above leaves its containers running there.
	if p.Scratch != "" {
		var roots []string
		for _, name := range []string{filepath.Base(p.Scratch), filepath.Base(p.Scratch) + secondNodeCgroupSuffix} {
			m, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", name))
			roots = append(roots, m...)
		}
		if left := cgroupProcesses(roots); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "node: FAIL: %d container processes left in the suite's cgroups; killing them\n", len(left))
			for _, pid := range left {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			code = 1
		}
		for _, r := range roots {
			_ = localcluster.WaitFor(context.Background(), 10*time.Second, 100*time.Millisecond, func() error { return removeCgroupTree(r) })
		}
	}
	// The node's bridge, the kubelet's and the CNI plugins' iptables chains lived in the suite's
	// network namespace, which is gone: none may appear in the host's.
	for k := range hostNetworkState() {
		if !hostBefore[k] {
			fmt.Fprintf(os.Stderr, "node: FAIL: the host network namespace gained %s\n", k)
			code = 1
		}
	}
	fmt.Fprintf(os.Stderr, "node: prepared in %s, whole suite %s\n", p.Prepared.Round(time.Second), time.Since(start).Round(time.Second))
	return code
}

// hostNetworkState is what the suite could leave in a network namespace: the bridge cni0 and
// iptables chains named KUBE-* or CNI-*.
func hostNetworkState() map[string]bool {
	out := map[string]bool{}
	if _, err := os.Stat("/sys/class/net/cni0"); err == nil {
		out["link cni0"] = true
	}
	for _, table := range []string{"filter", "nat", "mangle"} {
		b, _ := exec.Command("iptables-save", "-t", table).Output()
		for _, line := range strings.Split(string(b), "\n") {
			if name, ok := strings.CutPrefix(line, ":"); ok {
				name, _, _ = strings.Cut(name, " ")
				if strings.HasPrefix(name, "KUBE-") || strings.HasPrefix(name, "CNI-") {
					out["iptables chain "+table+"/"+name] = true
				}
			}
		}
	}
	return out
}

// cgroupProcesses lists the processes in the cgroup trees below roots.
func cgroupProcesses(roots []string) []int {
	seen := map[int]bool{}
	var out []int
	for _, r := range roots {
		_ = filepath.WalkDir(r, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(path)
			for _, f := range strings.Fields(string(b)) {
				var pid int
				if _, err := fmt.Sscanf(f, "%d", &pid); err == nil && !seen[pid] {
					seen[pid] = true
					out = append(out, pid)
				}
			}
			return nil
		})
	}
	return out
}

// processesMentioning returns pid -> command line of processes whose command line contains s.
func processesMentioning(s string) map[int]string {
	out := map[int]string{}
	if s == "" {
		return out
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		cl := strings.ReplaceAll(string(b), "\x00", " ")
		if strings.Contains(cl, s) {
			out[pid] = cl
		}
	}
	return out
}

// prepare installs containerd and runc if missing, builds the Kubernetes components, ipwarden,
// the CNI plugins and the images.
func prepare() (prepared, error) {
	var p prepared
	var err error
	if p.Scratch, err = os.MkdirTemp("", "ipwn-"); err != nil {
		return p, err
	}
	if err := os.Chmod(p.Scratch, 0o755); err != nil {
		return p, err
	}
	if err := installPackages(); err != nil {
		return p, err
	}
	if p.Root, err = controlplane.RepoRoot(); err != nil {
		return p, err
	}
	p.BinDir = controlplane.BinDir(p.Root)
	if _, err := controlplane.EnsureBinaries(p.Root, p.BinDir, os.Stderr); err != nil {
		return p, err
	}
	if p.Kubectl, err = controlplane.EnsureKubectl(p.Root, p.BinDir, os.Stderr); err != nil {
		return p, err
	}
	if p.Node, err = controlplane.EnsureNodeBinaries(p.Root, p.BinDir, os.Stderr); err != nil {
		return p, err
	}
	lc, err := localcluster.Build(p.Root, filepath.Join(p.BinDir, "node"), os.Stderr)
	if err != nil {
		return p, err
	}
	p.CNIDir, p.Ipwarden = lc.CNIDir, lc.Ipwarden
	// Downloaded and built here: the tests run without a network.
	if p.Whereabouts, err = localcluster.EnsureWhereabouts(p.BinDir, os.Stderr); err != nil {
		return p, err
	}
	if err := localcluster.InstallPlugins(p.CNIDir, os.Stderr, "main/loopback", "meta/portmap"); err != nil {
		return p, err
	}
	// The images' binaries are static, like the Dockerfile's.
	img := filepath.Join(p.Scratch, "images")
	if err := os.MkdirAll(img, 0o755); err != nil {
		return p, err
	}
	static := func(out, pkg string) error {
		return localcluster.GoBuild{Dir: p.Root, Out: out, Pkgs: []string{pkg}, Static: true}.Run()
	}
	for _, b := range [][2]string{{"ipwarden", "./cmd/ipwarden"}, {"ipwarden-cni", "./cmd/ipwarden-cni"}, {"sleeper", "./test/node/testdata/sleeper"}} {
		if err := static(filepath.Join(img, b[0]), b[1]); err != nil {
			return p, err
		}
	}
	p.Images, err = buildImages(img, filepath.Join(img, "sleeper"), filepath.Join(img, "ipwarden"), filepath.Join(img, "ipwarden-cni"), "/bin/busybox")
	return p, err
}

// installPackages installs what the node needs from Debian packages when it is missing:
// containerd (1.6 on bookworm), runc, iptables (bridge's ipMasq, portmap, the kubelet),
// busybox-static (the ipwarden image's shell, as in the Dockerfile).
func installPackages() error {
	var need []string
	for tool, pkg := range map[string]string{"containerd": "containerd", "runc": "runc", "iptables": "iptables", "ip": "iproute2", "ping": "iputils-ping"} {
		if _, err := exec.LookPath(tool); err != nil {
			need = append(need, pkg)
		}
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		need = append(need, "busybox-static")
	}
	if len(need) == 0 {
		return nil
	}
	fmt.Fprintln(os.Stderr, "node: installing", need)
	env := append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	for _, args := range [][]string{{"update", "-qq"}, append([]string{"install", "-y", "-qq"}, need...)} {
		cmd := exec.Command("apt-get", args...)
		cmd.Env = env
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("apt-get %v: %v\n%s", args, err, out)
		}
	}
	return nil
}
