package agent

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
)

// TestDecideClaim: what an ADD's claim read becomes: the claim to serve, or the reason the ADD
// fails (CNI code 11). Nothing lets a claim's pod through without its claim.
func TestDecideClaim(t *testing.T) {
	obj := ClaimObject{UID: "u1", Network: "net", IPs: []string{"10.1.0.9/16"}}
	for _, tc := range []struct {
		name    string
		ref     string
		refErr  error
		obj     ClaimObject
		err     error
		want    string // the claim's UID, or "" for none
		problem string
	}{
		{name: "no reference: no claim", obj: obj},
		{name: "the claim", ref: "vm-a", obj: obj, want: "u1"},
		{name: "malformed annotation", ref: "", refErr: errors.New("annotation x is not a list"), problem: "the pod's IPAMClaim reference cannot be read"},
		{name: "no CRD", ref: "vm-a", err: errClaimCRDMissing, problem: "the pod references IPAMClaim ns/vm-a, but the IPAMClaim CRD (k8s.cni.cncf.io/v1alpha1 ipamclaims) is not installed"},
		{name: "no such claim", ref: "vm-a", err: errClaimNotFound, problem: "IPAMClaim ns/vm-a does not exist"},
		{name: "API away", ref: "vm-a", err: errors.New("connection refused"), problem: "cannot read IPAMClaim ns/vm-a: connection refused"},
		{name: "no reader", ref: "vm-a", err: errNoClaimReader, problem: "cannot read IPAMClaim ns/vm-a"},
		{name: "another network", ref: "vm-a", obj: ClaimObject{UID: "u1", Network: "storage"},
			problem: `IPAMClaim ns/vm-a is for network "storage" (spec.network), not for this attachment's network "net"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, problem := decideClaim("ns", tc.ref, tc.refErr, "net", true, tc.obj, tc.err)
			got := ""
			if c != nil {
				got = c.UID
				if c.Namespace != "ns" || c.Name != tc.ref || !c.MigrationTarget {
					t.Fatalf("claim %+v", c)
				}
			}
			if got != tc.want || !strings.Contains(problem, tc.problem) || (tc.problem == "" && problem != "") {
				t.Fatalf("decideClaim = %q, %q; want %q, %q", got, problem, tc.want, tc.problem)
			}
		})
	}
}

// TestClaimMeta: the driver reads the reference from the pod's annotations (the configuration's
// args.cni first), the claim from the pod's namespace, and its status.ips.
func TestClaimMeta(t *testing.T) {
	var asked []string
	read := func(_ context.Context, ns, name string) (ClaimObject, error) {
		asked = append(asked, ns+"/"+name)
		if name == "vm-a" {
			return ClaimObject{UID: "u1", Network: "net", IPs: []string{"10.1.0.9"}}, nil
		}
		return ClaimObject{}, errClaimNotFound
	}
	meta := ipam.PodMeta{NetworkAnnotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: "vm-a"}, MigrationTarget: true}
	got := claimMeta(context.Background(), PodRead{Namespace: "ns", IfName: "eth0", Network: "net"}, meta, read)
	if got.Claim == nil || got.Claim.UID != "u1" || !got.Claim.MigrationTarget || len(got.ClaimIPs) != 1 || got.ClaimIPs[0] != netip.MustParseAddr("10.1.0.9") {
		t.Fatalf("claimMeta = %+v", got)
	}
	got = claimMeta(context.Background(), PodRead{Namespace: "ns", IfName: "eth0", Network: "net", ClaimArg: "vm-b"}, meta, read)
	if got.Claim != nil || !strings.Contains(got.ClaimProblem, "IPAMClaim ns/vm-b does not exist") {
		t.Fatalf("claimMeta with args.cni = %+v", got)
	}
	asked = nil
	got = claimMeta(context.Background(), PodRead{Namespace: "ns", IfName: "net1", Network: "net"}, meta, read)
	if got.Claim != nil || got.ClaimProblem != "" || len(asked) != 0 {
		t.Fatalf("a secondary interface without a reference: %+v, read %v", got, asked)
	}
}

// TestSpecPoolsCarryClaims: the node's claim uses survive the spec's form and its reading back.
func TestSpecPoolsCarryClaims(t *testing.T) {
	uses := []ipam.ClaimUse{
		{Claim: ipam.ClaimRef{Namespace: "ns", Name: "vm-a", UID: "u1"}, Pod: "p1", Addr: netip.MustParseAddr("10.1.0.9"), Attached: true},
		{Claim: ipam.ClaimRef{Namespace: "ns", Name: "vm-a", UID: "u1", MigrationTarget: true}, Pod: "p2"},
	}
	reqs := []ipam.PoolRequest{{Pool: "v4", Requested: 4, Claims: uses}}
	back := requestsOf(specPools(reqs))
	if len(back) != 1 || len(back[0].Claims) != 2 || back[0].Claims[0] != uses[0] || back[0].Claims[1] != uses[1] {
		t.Fatalf("read back %+v, want %+v", back, uses)
	}
	if ipam.SpecWorthWriting(back, []ipam.PoolRequest{{Pool: "v4", Requested: 4, Claims: uses[:1]}}) == false {
		t.Fatal("a claim use gone is not worth a write")
	}
}
