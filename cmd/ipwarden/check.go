package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/ipwarden/ipwarden/internal/check"
)

// exitError carries a process exit code through cobra.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

func newCheckCommand() *cobra.Command {
	var kubeconfig, output string
	var agents []string
	var timeout, grace time.Duration
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Report inconsistencies: addresses held twice, outside their pools, not held, or leaked",
		Long: `check reads IPPools, Pods, NodeIPAllocations and Nodes (in that order, so objects created
meanwhile cannot look inconsistent) and reports every violation of ipwarden's invariants:

  HeldTwice          an address in two nodes' NodeIPAllocation status
  AttachedTwice      an address used by two running pods
  OutsidePool        a node holds addresses outside its pool (a shrunk pool drains as nodes release)
  UnknownPool        a node holds addresses of a pool that no longer exists
  PodAddressNotHeld  a running pod's address is not held by its node
  OrphanAllocation   a NodeIPAllocation whose Node is gone

With --agent NODE=SOCKET (repeatable; on a node, or through a forwarded socket) it also reads
those agents' attachment lists and reports:

  AttachedTwice      an address on two attachments
  PodAddressNotHeld  an attachment's address not held by its node
  LeakedAttachment   an attachment (older than --grace) whose pod no longer exists
  SandboxGone        an attachment (older than --grace) whose network namespace is gone
                     (the runtime never called DEL; the agent checks the path itself)
  PodAddressNotAttached  a running pod on that node whose address has no attachment there
                     (the agent would hand it to another pod: what comes before a duplicate)

It only lists objects: it takes no lock and blocks nothing. Exit status: 0 consistent,
1 problems found, 2 could not check.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "text" && output != "json" {
				return &exitError{2, fmt.Sprintf("unknown output format %q: use text or json", output)}
			}
			cfg, err := cliConfig(kubeconfig)
			if err != nil {
				return &exitError{2, err.Error()}
			}
			scheme, err := newScheme()
			if err != nil {
				return &exitError{2, err.Error()}
			}
			c, err := client.New(cfg, client.Options{Scheme: scheme})
			if err != nil {
				return &exitError{2, err.Error()}
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			in, err := check.Collect(ctx, c)
			if err != nil {
				return &exitError{2, fmt.Sprintf("cannot read the cluster: %v", err)}
			}
			in.Grace = grace
			for _, a := range agents {
				node, socket, ok := strings.Cut(a, "=")
				if !ok || node == "" || socket == "" {
					return &exitError{2, fmt.Sprintf("--agent %q: want NODE=SOCKET, e.g. node-1=/run/ipwarden/agent.sock", a)}
				}
				atts, err := check.AskAgent(ctx, node, socket)
				if err != nil {
					return &exitError{2, fmt.Sprintf("cannot read the attachments of node %s: %v", node, err)}
				}
				if in.Attachments == nil {
					in.Attachments = map[string][]check.Attachment{}
				}
				in.Attachments[node] = atts
			}
			r := check.Check(in)
			if err := writeReport(cmd.OutOrStdout(), r, output); err != nil {
				return &exitError{2, err.Error()}
			}
			if !r.OK() {
				return &exitError{1, fmt.Sprintf("%d problems found", len(r.Findings))}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file; else $KUBECONFIG, ~/.kube/config, or the in-cluster configuration")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	cmd.Flags().DurationVar(&timeout, "timeout", 2*time.Minute, "give up reading the cluster after this long")
	cmd.Flags().StringArrayVar(&agents, "agent", nil, "also check this agent's attachments: NODE=SOCKET (repeatable)")
	cmd.Flags().DurationVar(&grace, "grace", time.Minute, "an attachment younger than this is never reported as leaked (its pod may be too new)")
	return cmd
}

func writeReport(w io.Writer, r check.Report, output string) error {
	if output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	fmt.Fprintf(w, "checked %d pools, %d nodes holding %d addresses, %d running pods", r.Pools, r.Nodes, r.Held, r.RunningPods)
	if r.AgentsAsked > 0 {
		fmt.Fprintf(w, ", %d attachments from %d agents", r.Attachments, r.AgentsAsked)
	}
	fmt.Fprintln(w)
	if r.OutsidePools > 0 {
		fmt.Fprintf(w, "%d running pods have an address outside every pool (another IPAM's, not checked), e.g. %s\n", r.OutsidePools, r.OutsidePoolsExample)
	}
	for _, s := range r.Sticky {
		fmt.Fprintf(w, "sticky: pool %s reserves %s for %s\n", s.Pool, s.Address, s.Identity)
	}
	if r.OK() {
		fmt.Fprintln(w, "no problems found")
		return nil
	}
	kinds := make([]string, 0, len(r.CountsByKind))
	for k, n := range r.CountsByKind {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
	}
	sort.Strings(kinds)
	fmt.Fprintf(w, "%d problems: %s\n\n", len(r.Findings), strings.Join(kinds, ", "))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KIND\tADDRESSES\tNODES\tPOOL\tPOD\tDETAIL")
	for _, f := range r.Findings {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", f.Kind, f.Addresses, strings.Join(f.Nodes, ","), dash(f.Pool), dash(f.Pod), f.Detail)
	}
	return tw.Flush()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
