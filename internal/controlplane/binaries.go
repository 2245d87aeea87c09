package controlplane

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"syscall"
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

// EnsureBinaries returns kube-apiserver and etcd, building them from hack/tools into binDir when
// they are missing or older than hack/tools' sources. Builds are serialized with a file lock so
// test packages running in parallel build once. Progress goes to log.
func EnsureBinaries(root, binDir string, log io.Writer) (Binaries, error) {
	bins := Binaries{
		KubeAPIServer: filepath.Join(binDir, "kube-apiserver"),
		Etcd:          filepath.Join(binDir, "etcd"),
	}
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return bins, err
	}
	toolsDir := filepath.Join(root, "hack", "tools")
	want, err := sourcesHash(toolsDir)
	if err != nil {
		return bins, fmt.Errorf("hash %s: %w", toolsDir, err)
	}
	lock, err := os.OpenFile(filepath.Join(binDir, ".build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return bins, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return bins, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer func() { _ = syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) }()

	stampPath := filepath.Join(binDir, ".controlplane-sources")
	stamp, _ := os.ReadFile(stampPath)
	if string(stamp) == want && fileExists(bins.KubeAPIServer) && fileExists(bins.Etcd) {
		return bins, nil
	}
	fmt.Fprintf(log, "controlplane: building kube-apiserver and etcd into %s (a few minutes the first time)\n", binDir)
	cmd := exec.Command("go", "build", "-o", binDir+string(filepath.Separator), "./cmd/kube-apiserver", "./cmd/etcd")
	cmd.Dir = toolsDir
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		return bins, fmt.Errorf("build control plane in %s: %w", toolsDir, err)
	}
	return bins, os.WriteFile(stampPath, []byte(want), 0o644)
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
