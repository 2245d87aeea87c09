// Command ipwarden-cni is ipwarden's CNI IPAM plugin. The container runtime (or a main plugin
// such as bridge) execs it once per verb; it is a thin client of the node agent's unix socket.
//
// It must stay light: it imports no client-go or k8s.io/api package, whose init cost would land
// on every pod start. TestPluginImportsNoKubernetesClient enforces this.
package main

import (
	"fmt"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ipwarden/ipwarden/internal/buildinfo"
)

// supportedVersions are the CNI spec versions whose results the plugin can produce.
var supportedVersions = version.PluginSupports("0.4.0", "1.0.0", "1.1.0")

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add:    notYet,
		Del:    notYet,
		Check:  notYet,
		GC:     notYet,
		Status: notYet,
	}, supportedVersions, fmt.Sprintf("ipwarden-cni %s: IPAM plugin of ipwarden", buildinfo.Get()))
}

// notYet answers verbs that need the node agent, which this build does not include yet.
func notYet(*skel.CmdArgs) error {
	return types.NewError(types.ErrTryAgainLater, "the ipwarden node agent protocol is not part of this build yet",
		"this ipwarden-cni build only answers VERSION; install a release that includes the node agent")
}
