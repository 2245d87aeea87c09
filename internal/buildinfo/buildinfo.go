// Package buildinfo reports the version of the running ipwarden binary.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Version is set at link time with -ldflags "-X github.com/ipwarden/ipwarden/internal/buildinfo.Version=v0.1.0".
var Version = "dev"

// Info describes a build.
type Info struct {
	Version   string `json:"version"`
	Commit    string `json:"commit,omitempty"`
	Modified  bool   `json:"modified,omitempty"`
	GoVersion string `json:"goVersion"`
	Platform  string `json:"platform"`
}

// Get returns the running binary's build information.
func Get() Info {
	info := Info{Version: Version, GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				info.Commit = s.Value
			case "vcs.modified":
				info.Modified = s.Value == "true"
			}
		}
	}
	return info
}

// String renders the information on one line.
func (i Info) String() string {
	s := fmt.Sprintf("%s (%s, %s)", i.Version, i.GoVersion, i.Platform)
	if i.Commit != "" {
		c := i.Commit
		if len(c) > 12 {
			c = c[:12]
		}
		if i.Modified {
			c += "-dirty"
		}
		s = fmt.Sprintf("%s commit %s (%s, %s)", i.Version, c, i.GoVersion, i.Platform)
	}
	return s
}
