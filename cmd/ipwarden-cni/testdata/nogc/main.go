// Command nogc is a CNI IPAM plugin of the kind a node may have used before ipwarden: built on the
// CNI library's skel, it supports spec versions up to 1.0.0 and so has no GC. ADD, CHECK and DEL
// succeed without doing anything. The plugin's tests run it as a "previous" IPAM to see a GC it
// cannot do skipped.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
)

func main() {
	noop := func(*skel.CmdArgs) error { return nil }
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add: func(args *skel.CmdArgs) error {
			return types.PrintResult(&current.Result{CNIVersion: current.ImplementedSpecVersion}, "1.0.0")
		},
		Check: noop,
		Del:   noop,
	}, version.PluginSupports("0.3.1", "0.4.0", "1.0.0"), "nogc: a CNI IPAM plugin without GC (ipwarden-cni tests)")
}
