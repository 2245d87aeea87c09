package controlplane

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// Binaries are the paths of the control plane programs.
type Binaries struct {
	KubeAPIServer string
	Etcd          string
}

// RepoRoot finds the ipwarden module root by walking up from the working directory to the
// go.mod that sits next to hack/tools.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if fileExists(filepath.Join(dir, "go.mod")) && fileExists(filepath.Join(dir, "hack", "tools", "go.mod")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("cannot find the ipwarden repository root (a go.mod next to hack/tools) above the working directory")
		}
		dir = parent
	}
}

// BinDir is where the built tools live: $IPWARDEN_BIN_DIR, or _bin under the repository root.
func BinDir(root string) string {
	if d := os.Getenv("IPWARDEN_BIN_DIR"); d != "" {
		return d
	}
	return filepath.Join(root, "_bin")
}

// A toolSet is a group of mains of one tool module under hack/ (hack/tools unless module says
// otherwise) built by one `go build` into binDir and stamped with the hash of that module's
// sources, so a change there rebuilds them.
type toolSet struct {
	what  string   // for the progress line
	stamp string   // file in binDir holding the sources hash the set was built from
	mains []string // directories under hack/<module>/cmd; each builds the binary of that name
	// module is the directory under hack/ holding the tool module ("" is tools); pkgs, when
	// set, are the packages to build instead of ./cmd/<main> (one per main, same order).
	module string
	pkgs   []string
}

var (
	controlPlaneTools = toolSet{"kube-apiserver and etcd", ".controlplane-sources", []string{"kube-apiserver", "etcd"}, "", nil}
	kubectlTool       = toolSet{"kubectl", ".kubectl-sources", []string{"kubectl"}, "", nil}
	nodeTools         = toolSet{"kubelet, kube-controller-manager and kube-scheduler", ".node-sources",
		[]string{"kubelet", "kube-controller-manager", "kube-scheduler"}, "", nil}
	// helm in its own module (hack/helm): its dependencies never move hack/tools' pins.
	helmTool = toolSet{"helm", ".helm-sources", []string{"helm"}, "helm", []string{"helm.sh/helm/v3/cmd/helm"}}
	// promcheck (hack/promcheck): Prometheus' rule and PromQL parsers, in their own module.
	promcheckTool = toolSet{"promcheck", ".promcheck-sources", []string{"promcheck"}, "promcheck", nil}
)

// EnsureBinaries returns kube-apiserver and etcd, building them from hack/tools into binDir when
// they are missing or older than hack/tools' sources. Builds are serialized with a file lock so
// test packages running in parallel build once. Progress goes to log.
func EnsureBinaries(root, binDir string, log io.Writer) (Binaries, error) {
	paths, err := ensureTools(root, binDir, log, controlPlaneTools)
	return Binaries{KubeAPIServer: paths[0], Etcd: paths[1]}, err
}

// EnsureKubectl returns kubectl (with its built-in kustomize), built like EnsureBinaries.
func EnsureKubectl(root, binDir string, log io.Writer) (string, error) {
	paths, err := ensureTools(root, binDir, log, kubectlTool)
	return paths[0], err
}

// EnsureHelm returns helm, built from its Go module pinned in hack/helm, like EnsureBinaries.
func EnsureHelm(root, binDir string, log io.Writer) (string, error) {
	paths, err := ensureTools(root, binDir, log, helmTool)
	return paths[0], err
}

// EnsurePromcheck returns promcheck (hack/promcheck: parses rule files and dashboards with
// Prometheus' own parsers and lists the metrics they use), built like EnsureBinaries.
func EnsurePromcheck(root, binDir string, log io.Writer) (string, error) {
	paths, err := ensureTools(root, binDir, log, promcheckTool)
	return paths[0], err
}

// NodeBinaries are the node and cluster components the real-node suite runs besides the
// control plane.
type NodeBinaries struct {
	Kubelet, KubeControllerManager, KubeScheduler string
}

// EnsureNodeBinaries returns kubelet, kube-controller-manager and kube-scheduler, built like
// EnsureBinaries (about 6 minutes the first time on 2 cores).
func EnsureNodeBinaries(root, binDir string, log io.Writer) (NodeBinaries, error) {
	paths, err := ensureTools(root, binDir, log, nodeTools)
	return NodeBinaries{Kubelet: paths[0], KubeControllerManager: paths[1], KubeScheduler: paths[2]}, err
}

// ensureTools returns the paths of set's binaries in binDir, building them first when they are
// missing or the set's stamp does not match hack/tools' sources.
func ensureTools(root, binDir string, log io.Writer, set toolSet) ([]string, error) {
	paths := make([]string, len(set.mains))
	pkgs := make([]string, len(set.mains))
	for i, m := range set.mains {
		paths[i] = filepath.Join(binDir, m)
		pkgs[i] = "./cmd/" + m
		if set.pkgs != nil {
			pkgs[i] = set.pkgs[i]
		}
	}
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return paths, err
	}
	module := set.module
	if module == "" {
		module = "tools"
	}
	toolsDir := filepath.Join(root, "hack", module)
	want, err := sourcesHash(toolsDir)
	if err != nil {
		return paths, fmt.Errorf("hash %s: %w", toolsDir, err)
	}
	lock, err := os.OpenFile(filepath.Join(binDir, ".build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return paths, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return paths, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer func() { _ = syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) }()

	stampPath := filepath.Join(binDir, set.stamp)
	stamp, _ := os.ReadFile(stampPath)
	fresh := string(stamp) == want
	for _, p := range paths {
		fresh = fresh && fileExists(p)
	}
	if fresh {
		return paths, nil
	}
	fmt.Fprintf(log, "tools: building %s into %s (minutes the first time)\n", set.what, binDir)
	build := localcluster.GoBuild{Dir: toolsDir, Out: binDir + string(filepath.Separator), Pkgs: pkgs, NoRace: true, Log: log}
	if err := build.Run(); err != nil {
		return paths, fmt.Errorf("build %s in %s: %w", set.what, toolsDir, err)
	}
	return paths, os.WriteFile(stampPath, []byte(want), 0o644)
}

// sourcesHash digests the tool module's go.mod, go.sum and main packages.
func sourcesHash(toolsDir string) (string, error) {
	files := []string{filepath.Join(toolsDir, "go.mod"), filepath.Join(toolsDir, "go.sum")}
	mains, err := filepath.Glob(filepath.Join(toolsDir, "cmd", "*", "*.go"))
	if err != nil {
		return "", err
	}
	files = append(files, mains...)
	sort.Strings(files)
	h := sha256.New()
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s %d\n", filepath.Base(f), len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
