// Command ipwarden is the ipwarden controller, node agent and operator CLI in one binary.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
)

func main() {
	root := newRootCommand()
	pluginName(root, os.Args[0])
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, root.DisplayName()+":", err)
		var ee *exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "ipwarden",
		Short: "IP address management for Kubernetes pods",
		Long: `ipwarden hands every node a right-sized, self-adjusting set of addresses from
cluster pools and gives pods their address from that node-local set.

Subcommands:
  controller  run the cluster controller (probe: its exec probe)
  agent       run the node agent (agent list: the node's attachments)
  check       report inconsistencies (read-only)
  usage       address usage per pool, or per node (--nodes) (read-only)
  who         which node and pod hold an address (read-only)
  simulate    capacity planner: choose batch and buffer for your cluster
  version     print the build version`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newVersionCommand())
	root.AddCommand(newControllerCommand())
	root.AddCommand(newProbeCommand())
	root.AddCommand(newAgentCommand())
	root.AddCommand(newCheckCommand())
	root.AddCommand(newUsageCommand())
	root.AddCommand(newWhoCommand())
	root.AddCommand(newSimulateCommand())
	return root
}

// pluginName makes the binary a kubectl plugin: installed (or symlinked) as kubectl-ipwarden on
// the PATH, `kubectl ipwarden usage` runs it with the arguments after the plugin's name, and its
// help and errors name it "kubectl ipwarden".
func pluginName(root *cobra.Command, argv0 string) {
	if name := filepath.Base(argv0); strings.HasPrefix(name, "kubectl-") {
		if root.Annotations == nil {
			root.Annotations = map[string]string{}
		}
		root.Annotations[cobra.CommandDisplayNameAnnotation] = "kubectl " + strings.ReplaceAll(strings.TrimPrefix(name, "kubectl-"), "_", "-")
	}
}
