package localcluster

import (
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// WhereaboutsVersion is the Whereabouts release the real-node bench compares ipwarden with.
const WhereaboutsVersion = "v0.9.4"

// Whereabouts is the Whereabouts CNI IPAM plugin and the CRD manifests it needs.
type Whereabouts struct {
	Plugin string // the plugin binary, named for its CNI type (whereabouts)
	CRDs   []string
}

// CRDDir is the directory of the CRD manifests (with the plugin; controlplane.InstallCRDs reads
// only its YAML files).
func (w Whereabouts) CRDDir() string { return filepath.Dir(w.Plugin) }

// WhereaboutsCRDs are the names of the CRDs Whereabouts needs in the API server: its
// reservations per range (IPPool) and per address across ranges (OverlappingRangeIPReservation,
// one per address while enable_overlapping_ranges is on, its default).
var WhereaboutsCRDs = []string{"ippools.whereabouts.cni.cncf.io", "overlappingrangeipreservations.whereabouts.cni.cncf.io"}

// WhereaboutsFlatConfig is the content of Whereabouts' flat configuration file (its default
// place is /etc/cni/net.d/whereabouts.d/whereabouts.conf, or the ipam object's
// configuration_path): the kubernetes datastore, reached with kubeconfig, which the plugin reads
// as it runs (as root, on the node), and its log.
func WhereaboutsFlatConfig(kubeconfig, logFile, logLevel string) []byte {
	b, _ := json.Marshal(map[string]any{
		"datastore":  "kubernetes",
		"kubernetes": map[string]string{"kubeconfig": kubeconfig},
		"log_file":   logFile,
		"log_level":  logLevel,
	})
	return b
}

// WhereaboutsReservation is one address Whereabouts holds: an allocation in an IPPool object
// or an OverlappingRangeIPReservation.
type WhereaboutsReservation struct {
	IP          netip.Addr
	ContainerID string
	PodRef      string // namespace/name
}

func (r WhereaboutsReservation) String() string {
	return r.IP.String() + "=" + r.PodRef + "/" + r.ContainerID
}

// WhereaboutsPoolReservations reads the allocations of a Whereabouts IPPool object (its JSON
// form, as an unstructured object holds it): spec.allocations maps the offset of each address
// from spec.range's address to its owner. Sorted by address.
func WhereaboutsPoolReservations(obj map[string]any) ([]WhereaboutsReservation, error) {
	spec, _ := obj["spec"].(map[string]any)
	rng, _ := spec["range"].(string)
	prefix, err := netip.ParsePrefix(rng)
	if err != nil {
		return nil, fmt.Errorf("Whereabouts IPPool range %q: %v", rng, err)
	}
	allocs, _ := spec["allocations"].(map[string]any)
	var out []WhereaboutsReservation
	for off, a := range allocs {
		n, err := strconv.ParseUint(off, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("Whereabouts IPPool allocation offset %q: %v", off, err)
		}
		base := new(big.Int).SetBytes(prefix.Addr().AsSlice())
		ip, ok := netip.AddrFromSlice(base.Add(base, new(big.Int).SetUint64(n)).FillBytes(make([]byte, len(prefix.Addr().AsSlice()))))
		if !ok {
			return nil, fmt.Errorf("Whereabouts IPPool allocation offset %d of %s", n, rng)
		}
		m, _ := a.(map[string]any)
		id, _ := m["id"].(string)
		ref, _ := m["podref"].(string)
		out = append(out, WhereaboutsReservation{IP: ip, ContainerID: id, PodRef: ref})
	}
	sortReservations(out)
	return out, nil
}

// WhereaboutsOverlappingReservation reads an OverlappingRangeIPReservation object: named for
// its address (IPv6 with ':' as '-'), its owner in spec.
func WhereaboutsOverlappingReservation(obj map[string]any) (WhereaboutsReservation, error) {
	meta, _ := obj["metadata"].(map[string]any)
	name, _ := meta["name"].(string)
	ip, err := netip.ParseAddr(strings.ReplaceAll(name, "-", ":"))
	if err != nil {
		if ip, err = netip.ParseAddr(name); err != nil {
			return WhereaboutsReservation{}, fmt.Errorf("OverlappingRangeIPReservation %q: not named for an address", name)
		}
	}
	spec, _ := obj["spec"].(map[string]any)
	id, _ := spec["containerid"].(string)
	ref, _ := spec["podref"].(string)
	return WhereaboutsReservation{IP: ip, ContainerID: id, PodRef: ref}, nil
}

func sortReservations(r []WhereaboutsReservation) {
	sort.Slice(r, func(i, j int) bool { return r[i].IP.Less(r[j].IP) })
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
