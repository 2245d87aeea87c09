package main

import (
	"context"
	"errors"
	goflag "flag"
	"fmt"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	"github.com/spf13/cobra"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/buildinfo"
	"github.com/ipwarden/ipwarden/internal/controller"
)

type controllerFlags struct {
	kubeconfig       string
	qps              float32
	burst            int
	metricsAddr      string
	probeAddr        string
	healthFile       string
	leaderElect      bool
	leaderElectionNS string
	leaderElectionID string
	leaseDuration    time.Duration
	renewDeadline    time.Duration
	retryPeriod      time.Duration
	skipLocalFence   bool
	requireFence     bool
	opts             controller.Options
	ipamClaims       bool
	claimCRDPoll     time.Duration
	zap              zap.Options
}

func newControllerCommand() *cobra.Command {
	f := &controllerFlags{}
	cmd := &cobra.Command{
		Use:   "controller",
		Short: "Run the cluster controller: hand nodes their addresses and take back what they release",
		Long: `The controller keeps one NodeIPAllocation per Node that an IPPool selects, fills each node's
request from its pools, takes back the addresses nodes release, returns a deleted node's addresses
to their pools, and reports pool usage in IPPool status. Run two replicas; one leads (Lease).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runController(f) },
	}
	fs := cmd.Flags()
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; in-cluster configuration when empty")
	fs.Float32Var(&f.qps, "kube-api-qps", 100, "sustained rate of requests to the API server")
	fs.IntVar(&f.burst, "kube-api-burst", 200, "burst of requests to the API server")
	fs.StringVar(&f.metricsAddr, "metrics-bind-address", ":10370", `address of the Prometheus /metrics endpoint ("0" disables); while another replica on the node holds it, retried every 10s`)
	fs.StringVar(&f.probeAddr, "health-probe-bind-address", ":10371", `address of /healthz and /readyz ("0" disables)`)
	fs.StringVar(&f.healthFile, "health-file", "", "file rewritten every 5s with \"alive\" or \"ready\", for the exec probe `ipwarden probe` (hostNetwork replicas sharing a node cannot share a probe port)")
	fs.BoolVar(&f.leaderElect, "leader-elect", true, "elect one active replica with a Lease")
	fs.StringVar(&f.leaderElectionNS, "leader-election-namespace", namespaceDefault(), "namespace of the Lease (the fence policy's binding must name it)")
	fs.BoolVar(&f.requireFence, "require-fence-policy", true, "with --leader-elect, take and renew the Lease only while the fence policy ipwarden-controller-fence and its binding deny a stale leader's writes to this controller's Lease (checked at every lease operation): refuse to lead, or stop writing and step down, saying why (log, event, ipwarden_controller_fence_policy_ok 0)")
	fs.StringVar(&f.leaderElectionID, "leader-election-id", "ipwarden-controller", "name of the Lease")
	fs.DurationVar(&f.leaseDuration, "leader-election-lease-duration", 15*time.Second, "how long a standby waits before taking over a Lease that was not renewed")
	fs.DurationVar(&f.renewDeadline, "leader-election-renew-deadline", 10*time.Second, "how long the leader keeps trying to renew before it steps down")
	fs.DurationVar(&f.retryPeriod, "leader-election-retry-period", 2*time.Second, "interval of Lease acquire and renew attempts")
	fs.DurationVar(&f.opts.ClaimSettle, "claim-settle", 60*time.Second, "after it starts leading, the controller serves only claims (addresses nodes' pods use that their status lost) and take-backs until every node's agent has acknowledged it (spec.acknowledgedLeader), at most this long; without leader election, exactly this long")
	fs.DurationVar(&f.opts.PoolSettle, "pool-settle", 60*time.Second, "a pool created, or given more addresses, while the controller leads hands out none of its free addresses until every node's agent has reported the addresses its running pods use in it (spec.observedPools: pods of the IPAM the node ran before, say), at most this long (a node still silent 2 s after the last report has its pods read instead and is waited for only if one uses an address the pool gained); the Warning event PoolSettleTimedOut names the nodes that did not; negative: not at all")
	fs.BoolVar(&f.skipLocalFence, "unsafe-skip-local-lease-check", false, "testing only: do not check the lease's expiry before each write, leaving only the API server's fence policy")
	_ = fs.MarkHidden("unsafe-skip-local-lease-check")
	fs.StringVar(&f.opts.AgentLeaseNamespace, "agent-lease-namespace", namespaceDefault(),
		`namespace of the agents' Leases ipwarden-agent-<node> (the agents' --lease-namespace): a deleted Node's addresses return to their pools only once its agent has stopped renewing its Lease, since a Node object can be deleted and re-created while its pods run ("" returns them at once)`)
	fs.BoolVar(&f.opts.PerNodeMetrics, "per-node-metrics", false, "also export the node x pool gauges ipwarden_controller_node_{held,requested,deficit}_addresses (each agent exports its node's figures: ipwarden_agent_pool_held_addresses, _requested_addresses)")
	fs.IntVar(&f.opts.Workers, "workers", 4, "node syncs run in parallel")
	fs.DurationVar(&f.opts.MinSyncInterval, "min-sync-interval", 100*time.Millisecond, "least time between two syncs of one node; events in between coalesce")
	fs.DurationVar(&f.opts.ResyncPeriod, "resync-period", time.Minute, "period of the full pass that repairs anything an event missed")
	fs.DurationVar(&f.opts.BackoffBase, "backoff-base", 250*time.Millisecond, "first retry delay of a failing node sync (doubles, with jitter)")
	fs.DurationVar(&f.opts.BackoffMax, "backoff-max", 2*time.Minute, "longest retry delay of a failing node sync")
	fs.BoolVar(&f.ipamClaims, "ipamclaims", true, "serve IPAMClaims (k8s.cni.cncf.io/v1alpha1, KubeVirt VMs keeping their addresses): watch them once their CRD is installed and write their status; false: every pod that references a claim gets no address")
	fs.DurationVar(&f.claimCRDPoll, "ipamclaim-crd-poll", controller.ClaimCRDPoll, "while the IPAMClaim CRD is not installed, look for it this often")
	fs.DurationVar(&f.opts.AuditPeriod, "audit-period", 10*time.Minute, "period of the audit that compares the controller's record with every NodeIPAllocation status (leaked allocations, addresses held twice)")
	fs.DurationVar(&f.opts.PoolStatusInterval, "pool-status-interval", time.Second, "coalescing interval of IPPool status writes")
	fs.Float64Var(&f.opts.Exhaustion.LowPercent, "exhausted-below-percent", controller.DefaultExhaustionMarks.LowPercent, "a pool is marked exhausted when free addresses fall below this share of capacity (or one batch, whichever is more)")
	fs.Float64Var(&f.opts.Exhaustion.HighPercent, "exhausted-clear-percent", controller.DefaultExhaustionMarks.HighPercent, "the mark is cleared when free addresses rise above this share of capacity (or two batches, whichever is more)")
	f.opts.Exhaustion.LowBatches = controller.DefaultExhaustionMarks.LowBatches
	f.opts.Exhaustion.HighBatches = controller.DefaultExhaustionMarks.HighBatches
	gofs := goflag.NewFlagSet("zap", goflag.ContinueOnError)
	f.zap.BindFlags(gofs)
	fs.AddGoFlagSet(gofs)
	return cmd
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("load kubeconfig %s: %w", kubeconfig, err)
		}
		return cfg, nil
	}
	cfg, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("no --kubeconfig given and not running in a cluster: %w", err)
	}
	return cfg, nil
}

func newScheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := ipwardenv1.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := ipamclaimsv1.AddToScheme(s); err != nil { // events on IPAMClaims
		return nil, err
	}
	return s, nil
}

func runController(f *controllerFlags) error {
	if f.opts.Exhaustion.HighPercent < f.opts.Exhaustion.LowPercent {
		return fmt.Errorf("--exhausted-clear-percent %v must not be below --exhausted-below-percent %v", f.opts.Exhaustion.HighPercent, f.opts.Exhaustion.LowPercent)
	}
	if f.opts.Workers < 1 {
		return fmt.Errorf("--workers %d: must be at least 1", f.opts.Workers)
	}
	logger := zap.New(zap.UseFlagOptions(&f.zap))
	ctrl.SetLogger(logger)
	klog.SetLogger(logger)
	log := logger.WithName("controller")
	log.Info("starting ipwarden controller", "version", buildinfo.Get().String())

	cfg, err := restConfig(f.kubeconfig)
	if err != nil {
		return err
	}
	cfg.UserAgent = "ipwarden-controller/" + buildinfo.Version
	cfg.QPS, cfg.Burst = f.qps, f.burst
	scheme, err := newScheme()
	if err != nil {
		return err
	}
	ns := f.leaderElectionNS
	if ns == "" {
		ns = namespaceDefault()
	}
	if f.leaderElect && f.leaseDuration < time.Second {
		return fmt.Errorf("--leader-election-lease-duration %s: must be at least 1s (the Lease stores whole seconds)", f.leaseDuration)
	}
	metrics := controller.NewMetrics(ctrlmetrics.Registry)
	ctx := ctrl.SetupSignalHandler()
	var synced atomic.Bool // the first campaign's caches synced
	if f.metricsAddr != "0" && f.metricsAddr != "" {
		go serveMetrics(ctx, log, f.metricsAddr, ctrlmetrics.Registry, 10*time.Second)
	}
	if f.healthFile != "" {
		if err := ensureDir(f.healthFile); err != nil {
			return fmt.Errorf("--health-file: %w", err)
		}
		go writeHealthFile(ctx, log, f.healthFile, 5*time.Second, synced.Load)
	}
	var gate *controller.FenceGate
	if f.leaderElect && f.requireFence {
		if gate, err = newFenceGate(cfg, scheme, log, metrics, ns, f.leaderElectionID); err != nil {
			return err
		}
	}
	// A leader whose fence stopped holding steps down (controller.ErrFenceLost): its manager stops
	// and releases the Lease, and the process campaigns again with a new identity, taking the
	// Lease only once the fence holds (docs/design.md, "Fencing").
	for {
		err := campaign(ctx, f, cfg, scheme, ns, log, metrics, gate, &synced)
		if errors.Is(err, controller.ErrFenceLost) && ctx.Err() == nil {
			log.Info("stepped down: campaigning again, taking the Lease once the fence policy fences this controller's writes",
				"lease", ns+"/"+f.leaderElectionID)
			continue
		}
		return err
	}
}

// campaign runs one manager: it campaigns for the Lease ns/--leader-election-id (with leader
// election) and runs the controller while it leads, until ctx ends or the controller stops.
func campaign(ctx context.Context, f *controllerFlags, cfg *rest.Config, scheme *runtime.Scheme, ns string, log logr.Logger,
	metrics *controller.Metrics, gate *controller.FenceGate, synced *atomic.Bool) error {
	// The leader election lock reports every renewal to the fence, which stamps each status
	// write with the holder and epoch the fence policy checks (docs/design.md, "Fencing"); with
	// the gate it takes and renews the Lease only while the fence policy holds.
	var lock resourcelock.Interface
	opts := f.opts
	opts.Fence = controller.NoFence()
	if f.leaderElect {
		id, err := leaderIdentity()
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(rest.CopyConfig(cfg))
		if err != nil {
			return fmt.Errorf("leader election client: %w", err)
		}
		inner, err := resourcelock.New(resourcelock.LeasesResourceLock, ns, f.leaderElectionID, cs.CoreV1(), cs.CoordinationV1(),
			resourcelock.ResourceLockConfig{Identity: id})
		if err != nil {
			return fmt.Errorf("leader election lock: %w", err)
		}
		opts.Fence = controller.NewFence(f.leaseDuration, time.Now)
		if f.skipLocalFence {
			opts.Fence.SkipLocalCheck()
		}
		lock = &controller.LeaseObserver{Interface: inner, Fence: opts.Fence, Now: time.Now, Gate: gate}
		if gate != nil {
			opts.Lease = &corev1.ObjectReference{APIVersion: "coordination.k8s.io/v1", Kind: "Lease", Namespace: ns, Name: f.leaderElectionID}
		}
		log.Info("leader election", "identity", id, "lease", ns+"/"+f.leaderElectionID, "fenceChecked", gate != nil)
	}
	leaseDuration, renewDeadline, retryPeriod := f.leaseDuration, f.renewDeadline, f.retryPeriod
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                              scheme,
		Metrics:                             metricsserver.Options{BindAddress: "0"}, // serveMetrics
		HealthProbeBindAddress:              f.probeAddr,
		LeaderElection:                      f.leaderElect,
		LeaderElectionID:                    f.leaderElectionID,
		LeaderElectionNamespace:             ns,
		LeaderElectionResourceLockInterface: lock,
		LeaderElectionReleaseOnCancel:       true,
		LeaseDuration:                       &leaseDuration,
		RenewDeadline:                       &renewDeadline,
		RetryPeriod:                         &retryPeriod,
	})
	if err != nil {
		return fmt.Errorf("create manager: %w", err)
	}
	c := controller.New(mgr.GetCache(), mgr.GetAPIReader(), mgr.GetClient(),
		mgr.GetEventRecorderFor("ipwarden-controller"), metrics, log, opts)
	if f.ipamClaims {
		claims, err := controller.NewClaimAPI(cfg, f.claimCRDPoll, func(msg string, kv ...any) { log.Info(msg, kv...) })
		if err != nil {
			return err
		}
		c.WithClaims(claims)
	}
	if err := mgr.Add(c); err != nil {
		return err
	}
	syncCtx, stopSync := context.WithCancel(ctx) // ends with this campaign
	defer stopSync()
	go func() {
		if mgr.GetCache().WaitForCacheSync(syncCtx) {
			synced.Store(true)
		}
	}()
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return err
	}
	if err := mgr.AddReadyzCheck("caches", func(*http.Request) error {
		if !synced.Load() {
			return fmt.Errorf("informer caches not synced yet")
		}
		return nil
	}); err != nil {
		return err
	}
	return mgr.Start(ctx)
}

// newFenceGate is the fence check of every lease operation (controller.FenceGate): it reads the
// policy and binding with an uncached client and raises its events on the Lease synchronously,
// so a leader's FenceLost event is sent before it steps down.
func newFenceGate(cfg *rest.Config, scheme *runtime.Scheme, log logr.Logger, m *controller.Metrics, ns, name string) (*controller.FenceGate, error) {
	r, err := client.New(rest.CopyConfig(cfg), client.Options{Scheme: scheme})
	if err != nil {
		return nil, fmt.Errorf("fence policy client: %w", err)
	}
	cs, err := kubernetes.NewForConfig(rest.CopyConfig(cfg))
	if err != nil {
		return nil, fmt.Errorf("event client: %w", err)
	}
	lease := corev1.ObjectReference{APIVersion: "coordination.k8s.io/v1", Kind: "Lease", Namespace: ns, Name: name}
	return &controller.FenceGate{
		Read: func(ctx context.Context) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding, error) {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			return controller.ReadFence(ctx, r)
		},
		LeaseNamespace: ns, LeaseName: name, Metrics: m, Log: log,
		Event: func(reason, message string) {
			if err := warnNow(cs, lease, reason, message); err != nil {
				log.Error(err, "cannot raise an event on the Lease", "reason", reason)
			}
		},
	}, nil
}

// warnNow creates a Warning event on obj and returns once the API server answered (an event
// recorder sends in the background, and may not before the manager stops).
func warnNow(cs kubernetes.Interface, obj corev1.ObjectReference, reason, message string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	now := metav1.Now()
	host, _ := os.Hostname()
	if pod := os.Getenv("POD_NAME"); pod != "" {
		host = pod
	}
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{Name: fmt.Sprintf("%s.%x", obj.Name, now.UnixNano()), Namespace: obj.Namespace},
		InvolvedObject: obj, Reason: reason, Message: message, Type: corev1.EventTypeWarning,
		Source:         corev1.EventSource{Component: "ipwarden-controller", Host: host},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
	}
	_, err := cs.CoreV1().Events(obj.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	return err
}

// leaderIdentity is this process's Lease holder identity: the pod (or host) name and a random
// suffix, so a restarted process never passes for the one before it.
func leaderIdentity() (string, error) {
	name := os.Getenv("POD_NAME")
	if name == "" {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("leader election identity: %w", err)
		}
		name = h
	}
	return name + "_" + string(uuid.NewUUID()), nil
}
