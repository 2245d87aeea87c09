package controller

import (
	"context"
	"fmt"
	"time"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	claimclient "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned"
	claiminformers "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/informers/externalversions"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/ipwarden/ipwarden/internal/ipamclaim"
)

// ClaimAPI is the driver's access to IPAMClaims (k8s.cni.cncf.io/v1alpha1), a CRD ipwarden
// does not own and that may not be installed.
type ClaimAPI interface {
	// Watch runs until ctx ends: it delivers every claim to changed and every deletion to
	// deleted, and closes ready once the claims present are delivered, or at once when the CRD
	// is not installed (then it looks again every poll, and starts when it appears).
	Watch(ctx context.Context, changed func(*ipamclaimsv1.IPAMClaim), deleted func(namespace, name string), ready chan<- struct{})
	// List reads every claim from the API server (not a cache).
	List(ctx context.Context) ([]ipamclaimsv1.IPAMClaim, error)
	// UpdateStatus writes a claim's status subresource and returns the stored object.
	UpdateStatus(ctx context.Context, c *ipamclaimsv1.IPAMClaim) (*ipamclaimsv1.IPAMClaim, error)
}

// ClaimCRDPoll is how often a controller started without the IPAMClaim CRD looks for it.
const ClaimCRDPoll = 30 * time.Second

// clientClaimAPI is ClaimAPI over the ipamclaims module's typed client and informer.
type clientClaimAPI struct {
	cs   claimclient.Interface
	poll time.Duration
	log  func(msg string, kv ...any)
}

// NewClaimAPI returns the IPAMClaim access of a controller on cfg, looking for the CRD every poll
// while it is not installed [ClaimCRDPoll]. info logs.
func NewClaimAPI(cfg *rest.Config, poll time.Duration, info func(msg string, kv ...any)) (ClaimAPI, error) {
	cs, err := claimclient.NewForConfig(rest.CopyConfig(cfg))
	if err != nil {
		return nil, fmt.Errorf("IPAMClaim client: %w", err)
	}
	if poll <= 0 {
		poll = ClaimCRDPoll
	}
	return &clientClaimAPI{cs: cs, poll: poll, log: info}, nil
}

// installed asks discovery whether the API server serves ipamclaims.
func (a *clientClaimAPI) installed() bool {
	return ipamclaim.Served(a.cs.Discovery().ServerResourcesForGroupVersion(ipamclaim.GroupVersionResource.GroupVersion().String()))
}

func (a *clientClaimAPI) Watch(ctx context.Context, changed func(*ipamclaimsv1.IPAMClaim), deleted func(string, string), ready chan<- struct{}) {
	closed := false
	done := func() {
		if !closed {
			closed = true
			close(ready)
		}
	}
	for !a.installed() {
		if !closed {
			a.log("the IPAMClaim CRD (k8s.cni.cncf.io/v1alpha1 ipamclaims) is not installed: pods that reference a claim get no address; looking for it again periodically", "every", a.poll.String())
		}
		done()
		select {
		case <-ctx.Done():
			return
		case <-time.After(a.poll):
		}
	}
	f := claiminformers.NewSharedInformerFactory(a.cs, 0)
	inf := f.K8s().V1alpha1().IPAMClaims().Informer()
	reg, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if c, ok := obj.(*ipamclaimsv1.IPAMClaim); ok {
				changed(c)
			}
		},
		UpdateFunc: func(_, obj any) {
			if c, ok := obj.(*ipamclaimsv1.IPAMClaim); ok {
				changed(c)
			}
		},
		DeleteFunc: func(obj any) {
			if m := metaOf(obj); m != nil {
				deleted(m.GetNamespace(), m.GetName())
			}
		},
	})
	if err != nil {
		a.log("cannot watch IPAMClaims", "error", err.Error())
		done()
		return
	}
	f.Start(ctx.Done())
	// The handler's own sync: every claim present has reached changed.
	toolscache.WaitForCacheSync(ctx.Done(), reg.HasSynced)
	a.log("watching IPAMClaims")
	done()
	<-ctx.Done()
	f.Shutdown()
}

func (a *clientClaimAPI) List(ctx context.Context) ([]ipamclaimsv1.IPAMClaim, error) {
	l, err := a.cs.K8sV1alpha1().IPAMClaims(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

func (a *clientClaimAPI) UpdateStatus(ctx context.Context, c *ipamclaimsv1.IPAMClaim) (*ipamclaimsv1.IPAMClaim, error) {
	return a.cs.K8sV1alpha1().IPAMClaims(c.Namespace).UpdateStatus(ctx, c, metav1.UpdateOptions{FieldManager: FieldManager})
}

// performClaim carries out a claim operation; without a ClaimAPI (or the CRD) it fails, and a
// failed list releases nothing.
func (c *Controller) performClaim(ctx context.Context, op Op, r *OpResult) {
	if c.claims == nil {
		r.Err = apierrors.NewNotFound(ipamclaim.GroupVersionResource.GroupResource(), "")
		return
	}
	switch op.Kind {
	case OpClaimStatus:
		r.Claim, r.Err = c.claims.UpdateStatus(ctx, op.Claim)
		c.countWrite("ipamclaims/status", "update", r.Err)
	case OpListClaims:
		items, err := c.claims.List(ctx)
		if r.Err = err; err == nil {
			r.ClaimUIDs = make(map[string]bool, len(items))
			for _, it := range items {
				r.ClaimUIDs[string(it.UID)] = true
			}
		}
	}
}
