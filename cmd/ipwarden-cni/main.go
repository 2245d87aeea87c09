// Command ipwarden-cni is ipwarden's CNI IPAM plugin. The container runtime (or a main plugin
// such as bridge) execs it once per verb; it is a thin client of the node agent's unix socket.
//
// Network configuration: the plugin reads its keys from the "ipam" section (the usual place for
// an IPAM plugin), or from the top level when it is the network's plugin itself:
//
//	{"type": "ipwarden", "pools": ["pods-v4", "pods-v6"], "socket": "/run/ipwarden/agent.sock"}
//
// Both keys are optional: without "pools" the agent hands out one address from every pool that
// selects the node; "socket" defaults to /run/ipwarden/agent.sock.
//
// On a node taken over from another IPAM plugin while its pods run, the optional "previous" object
// is that plugin's "ipam" object, e.g. {"type": "host-local", "ranges": [...], "dataDir": "..."}.
// ADD never runs it, but forwards it to the agent, which keeps what that IPAM has reserved out of
// use (host-local's files, Whereabouts' IPPools); DEL is delegated to it after the agent's, CHECK when the agent has no
// attachment for the container, GC after the agent's (skipped when the plugin has no GC). The
// delegate runs from CNI_PATH with the network configuration whose "ipam" is "previous".
//
// It must stay light: it imports no client-go or k8s.io/api package, whose init cost would land
// on every pod start. TestPluginImportsNoKubernetesClient enforces this.
package main

import (
	"fmt"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ipwarden/ipwarden/internal/buildinfo"
)

// supportedVersions are the CNI spec versions whose results the plugin can produce.
var supportedVersions = version.PluginSupports("0.4.0", "1.0.0", "1.1.0")

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add:    cmdAdd,
		Del:    cmdDel,
		Check:  cmdCheck,
		GC:     cmdGC,
		Status: cmdStatus,
	}, supportedVersions, fmt.Sprintf("ipwarden-cni %s: IPAM plugin of ipwarden", buildinfo.Get()))
}
