package buildinfo

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The image's binaries both carry the build's version: every `go build` in the Dockerfile links
// Version from the VERSION build argument (the plugin once reported "dev").
func TestDockerfileStampsEveryBinary(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	stamp := "-X github.com/ipwarden/ipwarden/internal/buildinfo.Version=${VERSION}"
	builds := 0
	for _, run := range runInstructions(string(b)) {
		// Shell variables assigned in the same RUN (LDFLAGS="...") are expanded first.
		vars := map[string]string{}
		for _, m := range regexp.MustCompile(`(\w+)="([^"]*)"`).FindAllStringSubmatch(run, -1) {
			vars[m[1]] = m[2]
		}
		for _, cmd := range strings.Split(run, "&&") {
			if !strings.Contains(cmd, "go build") {
				continue
			}
			builds++
			for k, v := range vars {
				cmd = strings.ReplaceAll(cmd, "$"+k, v)
			}
			if !strings.Contains(cmd, stamp) {
				t.Errorf("Dockerfile builds without the version stamp %q:\n%s", stamp, strings.TrimSpace(cmd))
			}
		}
	}
	if builds != 2 {
		t.Errorf("Dockerfile runs go build %d times, want 2 (ipwarden and ipwarden-cni)", builds)
	}
}

// The build context leaves out the tools (_bin holds kube-apiserver, etcd, kubelet...) and .git.
func TestDockerignoreExcludesToolsAndVCS(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			have[strings.TrimSuffix(strings.TrimPrefix(l, "/"), "/")] = true
		}
	}
	for _, want := range []string{"_bin", ".git", "_out", "**/*.test"} {
		if !have[want] {
			t.Errorf(".dockerignore does not exclude %s", want)
		}
	}
}

// runInstructions returns the Dockerfile's RUN instructions, continuation lines joined.
func runInstructions(dockerfile string) []string {
	var out []string
	var cur strings.Builder
	cont := false
	for _, line := range strings.Split(dockerfile, "\n") {
		trimmed := strings.TrimSpace(line)
		if !cont {
			if !strings.HasPrefix(trimmed, "RUN ") {
				continue
			}
			trimmed = strings.TrimPrefix(trimmed, "RUN ")
		}
		cont = strings.HasSuffix(trimmed, `\`)
		cur.WriteString(strings.TrimSuffix(trimmed, `\`) + " ")
		if !cont {
			out = append(out, cur.String())
			cur.Reset()
		}
	}
	return out
}
