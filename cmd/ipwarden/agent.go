package main

import (
	"context"
	"encoding/json"
	goflag "flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/buildinfo"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

type agentFlags struct {
	kubeconfig  string
	cfg         agent.Config
	pools       []string
	zap         zap.Options
	metricsAddr string
	probeAddr   string
}

func newAgentCommand() *cobra.Command {
	f := &agentFlags{}
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the node agent: serve pod addresses to ipwarden-cni from the node's warm set",
		Long: `The node agent runs on every node (DaemonSet). It answers ipwarden-cni over a root-only unix
socket from the addresses its node holds, records every assignment in a durable journal
(<state-dir>/journal.db) before it answers, and keeps the node's request in its NodeIPAllocation
right-sized: target = batch * ceil(buffer + demand/batch) per pool, clamped at maxPerNode.

On start it reloads the journal and serves at once from it: DEL, and ADD from the addresses the
journal holds, even while the API server is away. In the background it takes the node's Lease
(ipwarden-agent-<node> in --lease-namespace; while another agent holds it, this one refuses ADD
and names the holder), reconciles the journal with the NodeIPAllocation status and the pods bound
to the node (rebuilding attachments from their status.podIPs if the journal was lost; a new or
lost journal serves ADD only after that), and only then publishes its request and collects
leaks. The controller creates the NodeIPAllocation; the agent waits for it.

Leak collection: addresses of pods that are gone come back without a CNI DEL.
  - When a pod bound to the node is deleted, the attachments recorded for its UID are freed
    once its sandbox is gone too: the network namespace path passed at ADD no longer exists
    (a namespace that still exists keeps its address, whatever the Pod object says). When the
    agent cannot check the path it frees them --gc-sandbox-grace after the pod is gone; when
    no path was recorded (older journals), --gc-grace after. A new pod under the same name,
    as a StatefulSet makes, keeps its own.
  - Every --gc-full-check-interval the journal is compared with the node's pods; attachments
    older than --gc-grace whose pod is missing are freed.
  - The CNI GC verb frees attachments older than --gc-grace that the runtime no longer lists
    (a GC without cni.dev/valid-attachments frees nothing).
Before freeing, all three read the pod from the API server (not the informer cache) and keep
the attachment if that pod still exists (by UID; by name when the runtime passed no
K8S_POD_UID) or if the read fails. A free is a DEL: journal first, then the pool's
reuseCooldown. Events IPAddressGarbageCollected / IPAddressGarbageCollectionFailed go on the
pod, or on the node's NodeIPAllocation when the pod object is gone from the agent's view.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runAgent(cmd.Context(), f) },
	}
	fs := cmd.Flags()
	fs.StringVar(&f.cfg.Node, "node-name", os.Getenv("NODE_NAME"), "name of this node (default $NODE_NAME)")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; in-cluster configuration when empty")
	fs.StringVar(&f.cfg.Socket, "socket", cniproto.DefaultSocket, "unix socket ipwarden-cni connects to (directory 0700, socket 0600)")
	fs.StringVar(&f.cfg.StateDir, "state-dir", "/var/lib/ipwarden", "directory of the journal (journal.db); must survive agent restarts")
	fs.StringSliceVar(&f.pools, "pools", nil, "serve only these IPPools (default: every pool whose nodeSelector selects the node)")
	fs.DurationVar(&f.cfg.AddressWait, "address-wait", 10*time.Second, "how long an ADD waits for the controller when the node has no free address before it fails with CNI error 11")
	fs.StringVar(&f.metricsAddr, "metrics-bind-address", ":10372", `address of the Prometheus /metrics endpoint ("0" disables)`)
	fs.StringVar(&f.probeAddr, "health-probe-bind-address", ":10373", `address of /healthz and /readyz ("0" disables)`)
	fs.DurationVar(&f.cfg.Resync, "resync", 60*time.Second, "the pool monitor recomputes the request at least this often")
	fs.DurationVar(&f.cfg.LeaseDuration, "lease-duration", agent.DefaultLeaseDuration,
		"another agent for this node takes its Lease once it has not been renewed for this long; the holder re-checks it before an ADD once its last renewal is this old")
	fs.DurationVar(&f.cfg.LeaseRenew, "lease-renew-interval", agent.DefaultLeaseRenew,
		"how often the agent renews the node's Lease: its only periodic API write (at most a third of --lease-duration)")
	fs.DurationVar(&f.cfg.RequestCoalesce, "request-coalesce", 100*time.Millisecond,
		"after a change (a pod bound, an address freed) the pool monitor waits until no other change came for this long, at most ten times as long, before it recomputes and publishes the request, so a burst of pods raises it once; an ADD waiting for an address skips the wait; 0 disables")
	fs.DurationVar(&f.cfg.GCGrace, "gc-grace", time.Minute,
		"an attachment younger than this is never freed by the full check or by CNI GC (its pod may not be in the agent's cache yet); the deletion of its pod, matched by UID, makes it a candidate at any age; "+
			"an attachment recorded without a network namespace path (older journals) is freed this long after its pod is gone")
	fs.DurationVar(&f.cfg.GCFullCheckInterval, "gc-full-check-interval", 5*time.Minute,
		"how often the leak collector compares the whole journal with the node's pods (the backstop for missed pod deletions, e.g. while the agent was down)")
	fs.DurationVar(&f.cfg.GCSandboxGrace, "gc-sandbox-grace", 10*time.Minute,
		"a deleted pod's addresses are freed at once only when the network namespace its runtime passed at ADD (CNI_NETNS) no longer exists; "+
			"when the agent cannot check that path (see --netns-dirs) they are freed this long after the pod is gone, and a namespace that still exists this long after is reported (event IPAddressSandboxOutlivesPod) and kept")
	fs.StringSliceVar(&f.cfg.NetnsDirs, "netns-dirs", agent.DefaultNetnsDirs,
		"directories in which the agent sees pods' network namespaces (mount the host's read-only, with HostToContainer propagation)")
	fs.StringVar(&f.cfg.LeaseNamespace, "lease-namespace", namespaceDefault(),
		"namespace of the node's Lease ipwarden-agent-<node> (one agent per node; default $POD_NAMESPACE, else default)")
	fs.StringVar(&f.cfg.ControllerLease, "controller-lease", "ipwarden-controller",
		"name of the controller's leader election Lease in --lease-namespace: the agent acknowledges each new leader (spec.acknowledgedLeader) after writing its claims from a fresh read, and the controller fills no node until every node has (\"\" disables)")
	fs.BoolVar(&f.cfg.GCDryRun, "gc-dry-run", false,
		"leak collection and CNI GC only report what they would free (log, IPAddressGarbageCollectionDryRun events, ipwarden_agent_gc_dry_run_total) and free nothing")
	fs.BoolVar(&f.cfg.ExhaustedTaint, "exhausted-taint", false,
		"with the Node condition ipwarden.io/AddressesExhausted (shown while pods wait on a node that can get no more addresses), also set the NoSchedule taint ipwarden.io/addresses-exhausted so the scheduler places new pods elsewhere")
	fs.IntVar(&f.cfg.ExhaustedClearFree, "exhausted-clear-free", 2,
		"the AddressesExhausted condition (and taint) clear once every pool of the node has this many free addresses")
	// --reserve-ahead answered an ADD before its journal write; that was removed (docs/design.md,
	// invariant 7), and the flag stays only so a DaemonSet that still passes it starts.
	fs.Int("reserve-ahead", 0, "ignored: every ADD is answered after its journal write")
	_ = fs.MarkDeprecated("reserve-ahead", "it is ignored: every ADD is answered after its journal write; remove it")
	fs.DurationVar(&f.cfg.RebuildHold, "rebuild-hold", 5*time.Minute,
		"after the journal was lost or damaged and rebuilt, held addresses no attachment accounts for stay out of use until every pod that may run is accounted for on each pool's network (its sandbox shown by the runtime, its own report of that network, or an ADD here), at most this long")
	fs.StringVar(&f.cfg.CRISocket, "cri-socket", "",
		"the container runtime's CRI socket (containerd: unix:///run/containerd/containerd.sock, as the shipped DaemonSet sets; CRI-O: unix:///var/run/crio/crio.sock), read-only: "+
			"after a lost or damaged journal the rebuild and the hold rest on the sandboxes the runtime shows (ListPodSandbox, PodSandboxStatus) rather than on pod statuses; \"\" asks nothing and falls back to the pods' own reports, network by network")
	fs.BoolVar(&f.cfg.DRA.Enabled, "dra", false,
		"run the DRA kubelet plugin of driver ipam.ipwarden.io: publish the node's address slots per IPPool as a ResourceSlice, reserve an address when the kubelet prepares a claim allocated one, "+
			"write it into the claim's status.devices[].networkData, and hand exactly it to the claim's pod's ADD (docs/operations.md, \"Addresses the scheduler can see\"); needs the kubelet's plugin directories mounted")
	fs.StringVar(&f.cfg.DRA.Interface, "dra-interface", "eth0",
		"with --dra: the CNI interface (CNI_IFNAME) whose ADD gets a claim's address, unless the claim's opaque configuration names another (ifName)")
	fs.IntVar(&f.cfg.DRA.MaxSlots, "dra-max-slots", 128,
		"with --dra: the most slot devices published per IPPool (the count follows the node's headroom under the pool's maxPerNode, in bands of a sixteenth of this)")
	gofs := goflag.NewFlagSet("zap", goflag.ContinueOnError)
	f.zap.BindFlags(gofs)
	fs.AddGoFlagSet(gofs)
	cmd.AddCommand(newAgentListCommand(), newAgentHandbackCommand())
	return cmd
}

func runAgent(ctx context.Context, f *agentFlags) error {
	if f.cfg.Node == "" {
		return fmt.Errorf("--node-name is required (or set NODE_NAME, e.g. from the pod's spec.nodeName)")
	}
	if f.cfg.AddressWait <= 0 {
		return fmt.Errorf("--address-wait %s: must be positive", f.cfg.AddressWait)
	}
	if f.cfg.LeaseDuration < 3*time.Second || f.cfg.LeaseDuration%time.Second != 0 {
		return fmt.Errorf("--lease-duration %s: give whole seconds, at least 3s (the Lease stores whole seconds)", f.cfg.LeaseDuration)
	}
	if f.cfg.LeaseRenew <= 0 || 3*f.cfg.LeaseRenew > f.cfg.LeaseDuration {
		return fmt.Errorf("--lease-renew-interval %s: give more than 0 and at most a third of --lease-duration (%s), so a renewal that fails twice still keeps the Lease", f.cfg.LeaseRenew, f.cfg.LeaseDuration)
	}
	if f.cfg.RequestCoalesce < 0 || f.cfg.RequestCoalesce > 10*time.Second {
		return fmt.Errorf("--request-coalesce %s: give 0 (off) up to 10s", f.cfg.RequestCoalesce)
	}
	if f.cfg.Resync <= 0 {
		return fmt.Errorf("--resync %s: must be positive", f.cfg.Resync)
	}
	if f.cfg.GCGrace < 0 {
		return fmt.Errorf("--gc-grace %s: must not be negative", f.cfg.GCGrace)
	}
	if f.cfg.RebuildHold <= 0 {
		return fmt.Errorf("--rebuild-hold %s: must be positive", f.cfg.RebuildHold)
	}
	if f.cfg.GCSandboxGrace <= 0 {
		return fmt.Errorf("--gc-sandbox-grace %s: must be positive", f.cfg.GCSandboxGrace)
	}
	if f.cfg.ExhaustedClearFree < 1 {
		return fmt.Errorf("--exhausted-clear-free %d: must be at least 1", f.cfg.ExhaustedClearFree)
	}
	if f.cfg.GCFullCheckInterval <= 0 {
		return fmt.Errorf("--gc-full-check-interval %s: must be positive", f.cfg.GCFullCheckInterval)
	}
	logger := zap.New(zap.UseFlagOptions(&f.zap))
	ctrl.SetLogger(logger)
	klog.SetLogger(logger)
	log := logger.WithName("agent").WithValues("node", f.cfg.Node)
	log.Info("starting ipwarden agent", "version", buildinfo.Get().String())

	cfg, err := restConfig(f.kubeconfig)
	if err != nil {
		return err
	}
	cfg.UserAgent = "ipwarden-agent/" + buildinfo.Version
	scheme, err := newScheme()
	if err != nil {
		return err
	}
	f.cfg.RestConfig, f.cfg.Scheme, f.cfg.Log = cfg, scheme, log
	f.cfg.Pools = f.pools
	f.cfg.MetricsAddr, f.cfg.ProbeAddr = f.metricsAddr, f.probeAddr
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sig := ctrl.SetupSignalHandler()
	go func() {
		<-sig.Done()
		log.Info("signal received: finishing requests in flight and stopping")
		cancel()
	}()
	return agent.Run(ctx, f.cfg)
}

func newAgentListCommand() *cobra.Command {
	var socket, output string
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the node's attachments and pools, as the local agent holds them",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			resp, err := cniproto.Call(ctx, socket, cniproto.Request{Op: cniproto.OpList})
			if err != nil {
				return err
			}
			if err := resp.AsError(); err != nil {
				return err
			}
			switch output {
			case "json":
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(resp)
			case "table", "":
				return printList(cmd.OutOrStdout(), resp)
			}
			return fmt.Errorf("-o %q: use table or json", output)
		},
	}
	cmd.Flags().StringVar(&socket, "socket", cniproto.DefaultSocket, "the agent's unix socket")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	return cmd
}

func printList(w io.Writer, resp *cniproto.Response) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "NODE %s\n\n", resp.Node)
	if h := resp.Handback; h != nil && h.Marked {
		fmt.Fprintf(tw, "HANDED BACK to %s at %s (network %s, reservation files in %s): every ADD is refused; undo: ipwarden agent handback --undo\n\n",
			h.To, h.At.UTC().Format(time.RFC3339), h.Network, orDash(h.Dir))
	}
	fmt.Fprintln(tw, "POOL\tSERVED\tHELD\tIN USE\tADOPTED\tFREE\tCOOLING\tRELEASING\tREQUESTED\tCONFLICTS\tUNATTRIBUTED\tPREVIOUS\tEXHAUSTED")
	for _, p := range resp.Pools {
		fmt.Fprintf(tw, "%s\t%v\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%v\n", p.Pool, p.Served, p.Held, p.InUse, p.Adopted, p.Free, p.Cooling,
			p.Releasing, p.Requested, p.Conflicts, p.Unattributed, p.PreviousReserved, p.Exhausted)
	}
	fmt.Fprintln(tw)
	if h := resp.Hold; h != nil {
		fmt.Fprintf(tw, "HOLD %d addresses of unknown owner are out of use until every pod on the node has reported its addresses (at most until %s)\n",
			h.Addresses, h.Until.UTC().Format(time.RFC3339))
		if len(h.WaitingFor) > 0 {
			more := ""
			if h.MoreWaiting > 0 {
				more = fmt.Sprintf(" and %d more", h.MoreWaiting)
			}
			fmt.Fprintf(tw, "     waiting for %s%s\n", strings.Join(h.WaitingFor, ", "), more)
		}
		fmt.Fprintln(tw)
	}
	fmt.Fprintln(tw, "CONTAINER\tIFNAME\tNETWORK\tPOD\tADDRESSES\tAGE\tNOTE")
	for _, a := range resp.Attachments {
		var ips []string
		for _, ip := range a.IPs {
			ips = append(ips, ip.Address)
		}
		pod := a.Pod.Namespace + "/" + a.Pod.Name
		if a.Pod.Name == "" {
			pod = "-"
		}
		note := ""
		if a.Rebuilt {
			note = "rebuilt from pod status"
		}
		if a.Sandbox == "gone" {
			note = strings.TrimSpace(note + " sandbox gone (no DEL yet)")
		}
		if len(a.Conflicts) > 0 {
			note = strings.TrimSpace(note + " conflict: not held " + strings.Join(a.Conflicts, ","))
		}
		if c := a.Claim; c != nil {
			note = strings.TrimSpace(note + " IPAMClaim " + c.Namespace + "/" + c.Name)
			if c.MigrationTarget {
				note += " (migration target)"
			}
		}
		cid := a.ContainerID
		if len(cid) > 16 && !strings.Contains(cid, ":") {
			cid = cid[:16]
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", cid, a.IfName, orDash(a.Network), pod, strings.Join(ips, ","),
			time.Since(a.Created).Round(time.Second), note)
	}
	return tw.Flush()
}

// DefaultNamespace is where ipwarden's Leases live unless a flag or $POD_NAMESPACE says
// otherwise: the namespace deploy/ installs into and the fence policy's binding names. The
// controller's Lease, the agents' Leases and the controller's view of the agents' Leases share
// it, so the two binaries run with their defaults agree.
const DefaultNamespace = "ipwarden-system"

// namespaceDefault is $POD_NAMESPACE, else DefaultNamespace.
func namespaceDefault() string { return orDefault(os.Getenv("POD_NAMESPACE"), DefaultNamespace) }

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
