package integration

// VM addresses, the controller's half (docs/design.md, "VM addresses (IPAMClaim)"): the
// controller process on the real API server, nodes' specs written by hand as their agents would.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	claimclient "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// setClaimUses writes a node's spec for pool: the claim uses, what it requests and releases.
func setClaimUses(t *testing.T, node, pool string, requested int, releasing []string, uses ...ipwardenv1.ClaimUse) {
	t.Helper()
	writePoolRequest(t, node, ipwardenv1.NodePoolRequest{Pool: pool, Requested: int32(requested), Releasing: blocks(releasing), IPAMClaims: uses})
}

func nodePoolStatus(t *testing.T, node, pool string) ipwardenv1.NodePoolStatus {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
		t.Fatal(err)
	}
	for _, p := range a.Status.Pools {
		if p.Pool == pool {
			return p
		}
	}
	return ipwardenv1.NodePoolStatus{}
}

// The controller: refuses a claim use before the CRD exists, picks it up once installed, records
// the claim's address before granting it, writes the claim's status, shares the address with a
// migration target and keeps it with the target after the source gives it back, keeps the
// record while a node uses a deleted claim, and releases it once none does.
func TestIPAMClaimController(t *testing.T) {
	const pool = "vmc"
	createPool(t, pool, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.156.0.0/28"}, ReuseCooldown: cooldown(0)})
	createNode(t, "vm-a", nil)
	createNode(t, "vm-b", nil)
	startController(t, "--ipamclaim-crd-poll=500ms", "--audit-period=2s")
	waitAllocation(t, "vm-a")
	waitAllocation(t, "vm-b")

	// Before the CRD: refused, and no address.
	use := func(uid, pod string, attached, target bool, address string) ipwardenv1.ClaimUse {
		return ipwardenv1.ClaimUse{Namespace: "default", Name: "vm1.net", UID: uid, Pod: pod, Attached: attached, MigrationTarget: target,
			Address: ipwardenv1.IPAddress(address)}
	}
	setClaimUses(t, "vm-a", pool, 0, nil, use("not-yet", "virt-launcher-vm1-a", false, false, ""))
	eventually(t, 20*time.Second, "the use to be refused", func() error {
		if r := nodePoolStatus(t, "vm-a", pool).ClaimRefused; len(r) != 1 || r[0].UID != "not-yet" {
			return fmt.Errorf("refused %+v", r)
		}
		return nil
	})
	if !held(t, "vm-a", pool).IsEmpty() {
		t.Fatal("an unknown claim got an address")
	}

	// The CRD and the claim arrive.
	if err := controlplane.InstallCRDs(context.Background(), restConfig, "../../config/ipamclaim"); err != nil {
		t.Fatal(err)
	}
	cs, err := claimclient.NewForConfig(restConfig)
	if err != nil {
		t.Fatal(err)
	}
	claims := cs.K8sV1alpha1().IPAMClaims("default")
	var claim *ipamclaimsv1.IPAMClaim
	eventually(t, 20*time.Second, "the IPAMClaim to be created", func() error {
		claim, err = claims.Create(context.Background(), &ipamclaimsv1.IPAMClaim{ObjectMeta: metav1.ObjectMeta{Name: "vm1.net"},
			Spec: ipamclaimsv1.IPAMClaimSpec{Network: "vmnet"}}, metav1.CreateOptions{})
		return err
	})
	t.Cleanup(func() { _ = claims.Delete(context.Background(), "vm1.net", metav1.DeleteOptions{}) })
	uid := string(claim.UID)
	setClaimUses(t, "vm-a", pool, 0, nil, use(uid, "virt-launcher-vm1-a", false, false, ""))
	var address string
	eventually(t, 30*time.Second, "vm-a to get the claim's address", func() error {
		h := held(t, "vm-a", pool)
		if size(h) != 1 {
			return fmt.Errorf("vm-a holds %v, refused %+v", h, nodePoolStatus(t, "vm-a", pool).ClaimRefused)
		}
		address = h.String()
		b := getPool(t, pool).Status.IPAMClaims
		if len(b) != 1 || b[0].UID != uid || string(b[0].Address) != address {
			return fmt.Errorf("bindings %+v", b)
		}
		return nil
	})
	eventually(t, 20*time.Second, "the claim's status", func() error {
		c, err := claims.Get(context.Background(), "vm1.net", metav1.GetOptions{})
		if err != nil {
			return err
		}
		cond := meta.FindStatusCondition(c.Status.Conditions, ipwardenv1.ClaimConditionIPsAllocated)
		if !slices.Equal(c.Status.IPs, []string{address + "/28"}) || c.Status.OwnerPod == nil || c.Status.OwnerPod.Name != "virt-launcher-vm1-a" ||
			cond == nil || cond.Status != metav1.ConditionTrue {
			return fmt.Errorf("status %+v", c.Status)
		}
		return nil
	})

	// A live migration to vm-b.
	setClaimUses(t, "vm-a", pool, 1, nil, use(uid, "virt-launcher-vm1-a", true, false, address))
	setClaimUses(t, "vm-b", pool, 0, nil, use(uid, "virt-launcher-vm1-b", false, true, ""))
	eventually(t, 20*time.Second, "the shared grant", func() error {
		if h := held(t, "vm-b", pool).String(); h != address {
			return fmt.Errorf("vm-b holds %q", h)
		}
		sh := getPool(t, pool).Status.Shared
		if len(sh) != 1 || !slices.Equal(sh[0].Nodes, []string{"vm-a", "vm-b"}) {
			return fmt.Errorf("shared %+v", sh)
		}
		if we := nodePoolStatus(t, "vm-a", pool).WantedElsewhere; len(we) != 1 || string(we[0]) != address {
			return fmt.Errorf("vm-a wantedElsewhere %v", we)
		}
		return nil
	})
	// The source's DEL: vm-a gives its copy back.
	setClaimUses(t, "vm-b", pool, 1, nil, use(uid, "virt-launcher-vm1-b", true, true, address))
	setClaimUses(t, "vm-a", pool, 0, []string{address})
	eventually(t, 20*time.Second, "the address to stay with vm-b alone", func() error {
		if h := held(t, "vm-a", pool); !h.IsEmpty() {
			return fmt.Errorf("vm-a holds %v", h)
		}
		if h := held(t, "vm-b", pool).String(); h != address {
			return fmt.Errorf("vm-b holds %q", h)
		}
		st := getPool(t, pool).Status
		if len(st.Shared) != 0 || len(st.Cooling) != 0 || len(st.IPAMClaims) != 1 {
			return fmt.Errorf("pool status shared %+v cooling %+v bindings %+v", st.Shared, st.Cooling, st.IPAMClaims)
		}
		return nil
	})

	// The claim is deleted while vm-b's pod uses it: the record stays.
	if err := claims.Delete(context.Background(), "vm1.net", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // a list of the claims (--audit-period) has run
	if b := getPool(t, pool).Status.IPAMClaims; len(b) != 1 {
		t.Fatalf("the record went while a node uses the claim: %+v", b)
	}
	// The VM's pod goes: the record goes, the address with it back to the pool.
	setClaimUses(t, "vm-b", pool, 0, []string{address})
	eventually(t, 20*time.Second, "the record to be released", func() error {
		if b := getPool(t, pool).Status.IPAMClaims; len(b) != 0 {
			return fmt.Errorf("bindings %+v", b)
		}
		if h := held(t, "vm-b", pool); !h.IsEmpty() {
			return fmt.Errorf("vm-b holds %v", h)
		}
		return nil
	})
}
