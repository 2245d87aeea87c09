package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	"github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned"
	"github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/informers/externalversions"
	claimlisters "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/listers/ipamclaims/v1alpha1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
)

// VM addresses (docs/design.md, "VM addresses (IPAMClaim)"): at an ADD the driver reads which
// IPAMClaim the attachment references (ipamclaim.Reference over the pod's annotations and the
// configuration's args.cni) and the claim itself, from the pod's namespace only (an informer once
// the CRD is installed; a miss reads it once from the API server). decideClaim turns what it
// read into the claim the machine serves, or the reason the ADD fails (CNI code 11); the machine
// and ipam.State do the rest (ipam/claim.go).

// ClaimObject is what the agent reads of an IPAMClaim.
type ClaimObject struct {
	UID     string
	Network string   // spec.network
	IPs     []string // status.ips
}

// Errors of a claim's read.
var (
	// errClaimCRDMissing: the API server does not serve k8s.cni.cncf.io/v1alpha1 ipamclaims.
	errClaimCRDMissing = errors.New("the IPAMClaim CRD (k8s.cni.cncf.io/v1alpha1 ipamclaims) is not installed")
	// errClaimNotFound: no claim of that name in the pod's namespace.
	errClaimNotFound = errors.New("no such IPAMClaim")
	// errNoClaimReader: the agent reads no claims (no API server configured).
	errNoClaimReader = errors.New("the agent cannot read IPAMClaims")
)

// decideClaim decides an ADD's claim from what was read: the pod's reference ref (refErr: its
// annotation is malformed) in namespace ns, the claim's read (obj, err) and the CNI network's
// name. It returns the claim to serve and its status.ips, or the reason the ADD fails; a pod
// that references no claim gets neither. Nothing here ever lets a claim's pod fall back to an
// ordinary address.
func decideClaim(ns, ref string, refErr error, network string, target bool, obj ClaimObject, err error) (*ipam.ClaimRef, []string, string) {
	if refErr != nil {
		return nil, nil, fmt.Sprintf("the pod's IPAMClaim reference cannot be read: %v", refErr)
	}
	if ref == "" {
		return nil, nil, ""
	}
	name := ns + "/" + ref
	switch {
	case errors.Is(err, errClaimCRDMissing):
		return nil, nil, fmt.Sprintf("the pod references IPAMClaim %s, but %v: install it (config/ipamclaim) or remove the reference", name, errClaimCRDMissing)
	case errors.Is(err, errClaimNotFound):
		return nil, nil, fmt.Sprintf("IPAMClaim %s does not exist (the pod references it; it is read from the pod's namespace only)", name)
	case err != nil:
		return nil, nil, fmt.Sprintf("cannot read IPAMClaim %s: %s", name, trunc(err.Error(), 200))
	case obj.UID == "":
		return nil, nil, fmt.Sprintf("IPAMClaim %s has no uid", name)
	case obj.Network != network:
		return nil, nil, fmt.Sprintf("IPAMClaim %s is for network %q (spec.network), not for this attachment's network %q", name, obj.Network, network)
	}
	return &ipam.ClaimRef{Namespace: ns, Name: ref, UID: obj.UID, MigrationTarget: target}, obj.IPs, ""
}

func trunc(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// claimMeta completes an ADD's pod read with its claim (decideClaim), reading the claim through
// read when the pod references one.
func claimMeta(ctx context.Context, r PodRead, meta ipam.PodMeta, read func(ctx context.Context, ns, name string) (ClaimObject, error)) ipam.PodMeta {
	ref, refErr := ipamclaim.Reference(meta.NetworkAnnotations, r.IfName, r.Network, r.ClaimArg)
	var obj ClaimObject
	var err error
	if refErr == nil && ref != "" {
		if read == nil {
			err = errNoClaimReader
		} else {
			obj, err = read(ctx, r.Namespace, ref)
		}
	}
	var ips []string
	meta.Claim, ips, meta.ClaimProblem = decideClaim(r.Namespace, ref, refErr, r.Network, meta.MigrationTarget, obj, err)
	if meta.Claim != nil {
		as, perr := ipamclaim.ParseIPs(ips)
		if perr != nil {
			meta.Claim, meta.ClaimProblem = nil, fmt.Sprintf("IPAMClaim %s/%s: %v", r.Namespace, ref, perr)
		}
		meta.ClaimIPs = as
	}
	return meta
}

// claimAnnotations keeps the annotations that may reference an IPAMClaim.
func claimAnnotations(a map[string]string) map[string]string {
	var out map[string]string
	for _, k := range []string{ipamclaim.AnnotationNetworks, ipamclaim.AnnotationDefaultNetwork, ipamclaim.AnnotationPrimaryClaim} {
		if v, ok := a[k]; ok {
			if out == nil {
				out = map[string]string{}
			}
			out[k] = v
		}
	}
	return out
}

// claimReader reads IPAMClaims for ADDs: from an informer once the API server serves the CRD
// (looked for at start and every claimCRDRecheck after, so an agent of a cluster without it
// starts and serves ordinary pods), else, and on a miss, with one GET.
type claimReader struct {
	get   versioned.Interface // unlimited client (metadataConfig): an ADD's GET
	watch versioned.Interface // the agent's client: the informer
	log   logr.Logger

	mu     sync.Mutex
	lister claimlisters.IPAMClaimLister // nil until the informer synced
}

// claimCRDRecheck is how often an agent whose API server lacks the CRD looks for it again.
const claimCRDRecheck = time.Minute

func newClaimReader(cfg *rest.Config, log logr.Logger) (*claimReader, error) {
	get, err := versioned.NewForConfig(metadataConfig(cfg))
	if err != nil {
		return nil, err
	}
	watch, err := versioned.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &claimReader{get: get, watch: watch, log: log}, nil
}

// installed reports whether the API server serves ipamclaims.
func (c *claimReader) installed() bool {
	return ipamclaim.Served(c.watch.Discovery().ServerResourcesForGroupVersion(ipamclaim.GroupVersionResource.GroupVersion().String()))
}

// run starts the informer once the CRD is there; it returns when ctx ends or the informer synced.
func (c *claimReader) run(ctx context.Context) {
	for {
		if c.installed() {
			f := externalversions.NewSharedInformerFactory(c.watch, 0)
			inf := f.K8s().V1alpha1().IPAMClaims()
			lister, informer := inf.Lister(), inf.Informer()
			f.Start(ctx.Done())
			if toolscache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
				c.mu.Lock()
				c.lister = lister
				c.mu.Unlock()
				c.log.Info("watching IPAMClaims (k8s.cni.cncf.io/v1alpha1)")
			}
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(claimCRDRecheck):
		}
	}
}

// Read reads the claim ns/name: from the informer, else with one GET.
func (c *claimReader) Read(ctx context.Context, ns, name string) (ClaimObject, error) {
	c.mu.Lock()
	lister := c.lister
	c.mu.Unlock()
	if lister != nil {
		if o, err := lister.IPAMClaims(ns).Get(name); err == nil {
			return claimObjectOf(o), nil
		}
	}
	o, err := c.get.K8sV1alpha1().IPAMClaims(ns).Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		return claimObjectOf(o), nil
	case claimNotFound(err, name):
		return ClaimObject{}, errClaimNotFound
	case apierrors.IsNotFound(err):
		// A 404 that names no claim: the API server does not serve the resource.
		return ClaimObject{}, errClaimCRDMissing
	}
	return ClaimObject{}, err
}

// claimNotFound reports whether err is the API server's "ipamclaims name not found".
func claimNotFound(err error, name string) bool {
	var st apierrors.APIStatus
	if !apierrors.IsNotFound(err) || !errors.As(err, &st) {
		return false
	}
	d := st.Status().Details
	return d != nil && d.Kind == ipamclaim.GroupVersionResource.Resource && d.Name == name
}

func claimObjectOf(o *ipamclaimsv1.IPAMClaim) ClaimObject {
	return ClaimObject{UID: string(o.UID), Network: o.Spec.Network, IPs: o.Status.IPs}
}
