package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/usage"
)

// readFlags are the flags of the read-only views (usage, who).
type readFlags struct {
	kubeconfig string
	output     string
	agents     []string
	timeout    time.Duration
}

func (f *readFlags) bind(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; else $KUBECONFIG, ~/.kube/config, or the in-cluster configuration")
	cmd.Flags().StringVarP(&f.output, "output", "o", "text", "output format: text or json")
	cmd.Flags().DurationVar(&f.timeout, "timeout", time.Minute, "give up reading the cluster after this long")
	cmd.Flags().StringArrayVar(&f.agents, "agent", nil, "count in-use addresses from this agent's attachments instead of its pods' status: NODE=SOCKET (repeatable)")
}

// cliConfig loads the configuration the way kubectl does (so `kubectl ipwarden` talks to the
// cluster kubectl does): --kubeconfig, else $KUBECONFIG, else ~/.kube/config, else in-cluster.
func cliConfig(kubeconfig string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil && kubeconfig != "" {
		return nil, fmt.Errorf("load kubeconfig %s: %w", kubeconfig, err)
	}
	if err != nil {
		return nil, fmt.Errorf("load the cluster configuration: %w", err)
	}
	return cfg, nil
}

// snapshot reads the API objects (and the agents named by --agent) as check does.
func (f *readFlags) snapshot(ctx context.Context) (check.Input, error) {
	if f.output != "text" && f.output != "json" {
		return check.Input{}, fmt.Errorf("unknown output format %q: use text or json", f.output)
	}
	cfg, err := cliConfig(f.kubeconfig)
	if err != nil {
		return check.Input{}, err
	}
	scheme, err := newScheme()
	if err != nil {
		return check.Input{}, err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return check.Input{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	in, err := check.Collect(ctx, c)
	if err != nil {
		return in, fmt.Errorf("cannot read the cluster: %w", err)
	}
	for _, a := range f.agents {
		node, socket, ok := strings.Cut(a, "=")
		if !ok || node == "" || socket == "" {
			return in, fmt.Errorf("--agent %q: want NODE=SOCKET, e.g. node-1=/run/ipwarden/agent.sock", a)
		}
		atts, err := check.AskAgent(ctx, node, socket)
		if err != nil {
			return in, fmt.Errorf("cannot read the attachments of node %s: %w", node, err)
		}
		if in.Attachments == nil {
			in.Attachments = map[string][]check.Attachment{}
		}
		in.Attachments[node] = atts
	}
	return in, nil
}

func newUsageCommand() *cobra.Command {
	var f readFlags
	var nodes bool
	cmd := &cobra.Command{
		Use:   "usage",
		Short: "Show address usage per pool (or per node with --nodes)",
		Long: `usage reads IPPools, Pods, NodeIPAllocations and Nodes and shows, per pool:

  CAPACITY   addresses the pool can hand out (CIDRs minus exclusions and reserved addresses)
  ALLOCATED  held by nodes or cooling down
  IN USE     held addresses a running pod uses
  FREE       neither held nor cooling
  COOLING    released, inside the reuse cooldown
  RESERVED   never handed out: exclusions, network and broadcast, first IPv6 address, gateway
  EXHAUSTED  the controller's exhausted mark (hysteresis)

With --nodes, per node and pool: HELD (its status), IN USE, REQUESTED (its agent's target),
RELEASING (given back), RUNS (contiguous ranges the held addresses form: more is fragmentation).
In-use counts come from the pods' status.podIPs, or, for nodes named with --agent NODE=SOCKET,
from that agent's journal (SOURCE agent). It only lists objects; it needs read access only
(ClusterRole ipwarden-viewer).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			in, err := f.snapshot(cmd.Context())
			if err != nil {
				return &exitError{2, err.Error()}
			}
			if nodes {
				return writeNodes(cmd.OutOrStdout(), usage.Nodes(in), f.output)
			}
			return writePools(cmd.OutOrStdout(), usage.Pools(in), f.output)
		},
	}
	f.bind(cmd)
	cmd.Flags().BoolVar(&nodes, "nodes", false, "show each node's share of each pool")
	return cmd
}

func newWhoCommand() *cobra.Command {
	var f readFlags
	cmd := &cobra.Command{
		Use:   "who ADDRESS",
		Short: "Show which node and pod hold an address, or why nobody does",
		Long: `who says which node holds an address (its NodeIPAllocation status) and which pod uses
it; otherwise whether it is free, cooling down (until when), excluded, reserved, or in no pool.
With --agent NODE=SOCKET that node's pods are read from its agent's journal.`,
		Example: "  ipwarden who 10.244.1.17\n  kubectl ipwarden who 10.244.1.17 -o json",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			a, err := netip.ParseAddr(args[0])
			if err != nil || a.Zone() != "" {
				return &exitError{2, fmt.Sprintf("%q is not an IP address (write e.g. 10.244.1.17 or fd00::5)", args[0])}
			}
			in, err := f.snapshot(cmd.Context())
			if err != nil {
				return &exitError{2, err.Error()}
			}
			return writeWho(cmd.OutOrStdout(), usage.WhoHolds(in, a), f.output)
		},
	}
	f.bind(cmd)
	return cmd
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func writePools(w io.Writer, rows []usage.Pool, output string) error {
	if output == "json" {
		return writeJSON(w, struct {
			Pools []usage.Pool `json:"pools"`
		}{append([]usage.Pool{}, rows...)})
	}
	if len(rows) == 0 {
		_, err := fmt.Fprintln(w, "No IPPools found.")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	fmt.Fprintln(tw, "POOL\tCAPACITY\tALLOCATED\tIN USE\tFREE\tCOOLING\tRESERVED\tEXHAUSTED\tNODES")
	for _, r := range rows {
		name := r.Name
		if r.Invalid != "" {
			name += " (invalid: " + r.Invalid + ")"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%t\t%d\n", name, r.Capacity, r.Allocated, r.InUse, r.Free, r.Cooling, r.Reserved, r.Exhausted, r.Nodes)
	}
	return tw.Flush()
}

func writeNodes(w io.Writer, rows []usage.Node, output string) error {
	if output == "json" {
		return writeJSON(w, struct {
			Nodes []usage.Node `json:"nodes"`
		}{append([]usage.Node{}, rows...)})
	}
	if len(rows) == 0 {
		_, err := fmt.Fprintln(w, "No NodeIPAllocations found.")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	fmt.Fprintln(tw, "NODE\tPOOL\tHELD\tIN USE\tREQUESTED\tRELEASING\tRUNS\tSOURCE")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\n", r.Node, r.Pool, r.Held, r.InUse, r.Requested, r.Releasing, r.Runs, r.Source)
	}
	return tw.Flush()
}

func writeWho(w io.Writer, who usage.Who, output string) error {
	if output == "json" {
		return writeJSON(w, who)
	}
	var pods []string
	for _, h := range who.Holders {
		if h.Pod != "" {
			pods = append(pods, h.Pod)
		} else {
			pods = append(pods, "container:"+h.ContainerID)
		}
	}
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	fmt.Fprintln(tw, "ADDRESS\tPOOL\tSTATE\tNODE\tPOD\tDETAIL")
	fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", who.Address, dash(who.Pool), who.State, dash(strings.Join(who.Nodes, ",")),
		dash(strings.Join(pods, ",")), who.Detail)
	return tw.Flush()
}
