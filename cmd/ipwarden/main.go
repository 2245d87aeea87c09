// Command ipwarden is the ipwarden controller, node agent and operator CLI in one binary.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	if err := newRootCommand().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "ipwarden:", err)
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
	root.AddCommand(newSimulateCommand())
	return root
}
