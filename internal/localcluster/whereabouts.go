package localcluster

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// WhereaboutsVersion is the Whereabouts release the real-node bench compares ipwarden with.
const WhereaboutsVersion = "v0.9.4"

// Whereabouts is the Whereabouts CNI IPAM plugin and the CRD manifests it needs.
type Whereabouts struct {
	Plugin string // the plugin binary, named for its CNI type (whereabouts)
	CRDs   []string
}

// EnsureWhereabouts returns Whereabouts (WhereaboutsVersion) cached in binDir, building it when
// missing. Its go.mod has a replace directive, so `go install module@version` refuses it: the
// module is downloaded, copied out of the read-only module cache and built in the copy with
// its own go.mod. The CRD manifests (doc/crds) are copied next to the binary.
func EnsureWhereabouts(binDir string, log io.Writer) (Whereabouts, error) {
	dir := filepath.Join(binDir, "whereabouts-"+WhereaboutsVersion)
	w := Whereabouts{Plugin: filepath.Join(dir, "whereabouts")}
	crdNames := []string{"whereabouts.cni.cncf.io_ippools.yaml", "whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml"}
	for _, c := range crdNames {
		w.CRDs = append(w.CRDs, filepath.Join(dir, c))
	}
	fresh := fileExists(w.Plugin)
	for _, c := range w.CRDs {
		fresh = fresh && fileExists(c)
	}
	if fresh {
		return w, nil
	}
	mod := "github.com/k8snetworkplumbingwg/whereabouts@" + WhereaboutsVersion
	fmt.Fprintln(log, "building", mod, "into", dir)
	dl := exec.Command("go", "mod", "download", "-json", mod)
	dl.Dir = os.TempDir()
	out, err := dl.Output()
	if err != nil {
		return w, fmt.Errorf("go mod download %s: %v", mod, err)
	}
	var info struct{ Dir, Error string }
	if err := json.Unmarshal(out, &info); err != nil || info.Dir == "" {
		return w, fmt.Errorf("go mod download %s: %v %s", mod, err, info.Error)
	}
	src, err := os.MkdirTemp("", "whereabouts-src-")
	if err != nil {
		return w, err
	}
	defer os.RemoveAll(src)
	if b, err := exec.Command("cp", "-r", info.Dir+"/.", src).CombinedOutput(); err != nil {
		return w, fmt.Errorf("copy %s: %v: %s", info.Dir, err, b)
	}
	if b, err := exec.Command("chmod", "-R", "u+w", src).CombinedOutput(); err != nil {
		return w, fmt.Errorf("chmod %s: %v: %s", src, err, b)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return w, err
	}
	build := exec.Command("go", "build", "-trimpath", "-o", w.Plugin, "./cmd")
	build.Dir = src
	build.Env = append(withoutEnv(os.Environ(), "GOFLAGS", "GOWORK"), "GOFLAGS=-mod=mod", "GOWORK=off", "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		return w, fmt.Errorf("build %s: %v\n%s", mod, err, b)
	}
	for i, c := range crdNames {
		b, err := os.ReadFile(filepath.Join(src, "doc", "crds", c))
		if err != nil {
			return w, err
		}
		if err := os.WriteFile(w.CRDs[i], b, 0o644); err != nil {
			return w, err
		}
	}
	return w, nil
}

func withoutEnv(env []string, names ...string) []string {
	var out []string
	for _, kv := range env {
		keep := true
		for _, n := range names {
			if strings.HasPrefix(kv, n+"=") {
				keep = false
			}
		}
		if keep {
			out = append(out, kv)
		}
	}
	return out
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
