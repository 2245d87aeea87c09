package node

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"time"
)

// imageFile is one file of a single-layer image: a copy of a host file, or a symlink.
type imageFile struct {
	path    string // inside the image, no leading slash
	src     string // host file to copy ("" for a symlink)
	symlink string // link target
}

// writeImage writes a docker-archive tarball (what `docker save` writes and `ctr images import`
// reads) of one layer holding files, tagged ref, with entrypoint. No registry is involved.
func writeImage(out, ref string, entrypoint []string, files []imageFile) error {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	epoch := time.Unix(0, 0)
	dirs := map[string]bool{}
	sort.Slice(files, func(i, j int) bool { return files[i].path < files[j].path })
	for _, f := range files {
		for d := parentDir(f.path); d != ""; d = parentDir(d) {
			dirs[d] = true
		}
	}
	var dirList []string
	for d := range dirs {
		dirList = append(dirList, d)
	}
	sort.Strings(dirList)
	for _, d := range dirList {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch}); err != nil {
			return err
		}
	}
	for _, f := range files {
		if f.src == "" {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: f.path, Linkname: f.symlink, Mode: 0o777, ModTime: epoch}); err != nil {
				return err
			}
			continue
		}
		b, err := os.ReadFile(f.src)
		if err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.path, Mode: 0o755, Size: int64(len(b)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := tw.Write(b); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	layerSum := sha256.Sum256(layer.Bytes())
	layerID := hex.EncodeToString(layerSum[:])
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"created":      epoch.UTC().Format(time.RFC3339),
		"config": map[string]any{
			"Entrypoint": entrypoint,
			"Env":        []string{"PATH=/usr/local/bin:/bin"},
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + layerID}},
	})
	if err != nil {
		return err
	}
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	manifest, err := json.Marshal([]map[string]any{{
		"Config":   configName,
		"RepoTags": []string{ref},
		"Layers":   []string{layerID + "/layer.tar"},
	}})
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	ow := tar.NewWriter(f)
	for _, e := range []struct {
		name string
		data []byte
	}{{configName, config}, {layerID + "/layer.tar", layer.Bytes()}, {"manifest.json", manifest}} {
		if err := ow.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := ow.Write(e.data); err != nil {
			return err
		}
	}
	if err := ow.Close(); err != nil {
		return err
	}
	return f.Close()
}

func parentDir(p string) string {
	for i := len(p) - 1; i >= 0; i-- {
		if p[i] == '/' {
			return p[:i]
		}
	}
	return ""
}

// The images the suite loads into containerd.
const (
	pauseImage    = "ipwarden.test/pause:1"
	workloadImage = "ipwarden.test/sleeper:1"
	ipwardenImage = "ipwarden.test/ipwarden:1"
)

// buildImages writes the suite's image tarballs into dir: pause and workload (the sleeper), and
// ipwarden as the Dockerfile builds it (busybox for the init container's shell, ipwarden and
// ipwarden-cni in /usr/local/bin).
func buildImages(dir, sleeper, ipwarden, ipwardenCNI, busybox string) ([]string, error) {
	var tars []string
	add := func(name, ref string, entry []string, files []imageFile) error {
		p := dir + "/" + name + ".tar"
		if err := writeImage(p, ref, entry, files); err != nil {
			return fmt.Errorf("image %s: %w", ref, err)
		}
		tars = append(tars, p)
		return nil
	}
	if err := add("pause", pauseImage, []string{"/pause"}, []imageFile{{path: "pause", src: sleeper}}); err != nil {
		return nil, err
	}
	if err := add("sleeper", workloadImage, []string{"/sleeper"}, []imageFile{{path: "sleeper", src: sleeper}}); err != nil {
		return nil, err
	}
	files := []imageFile{
		{path: "usr/local/bin/ipwarden", src: ipwarden},
		{path: "usr/local/bin/ipwarden-cni", src: ipwardenCNI},
		{path: "bin/busybox", src: busybox},
		{path: "tmp/.keep", src: os.DevNull},
	}
	for _, applet := range []string{"sh", "cp", "mv", "cat", "ls", "rm", "mkdir"} {
		files = append(files, imageFile{path: "bin/" + applet, symlink: "busybox"})
	}
	if err := add("ipwarden", ipwardenImage, []string{"/usr/local/bin/ipwarden"}, files); err != nil {
		return nil, err
	}
	return tars, nil
}
