package integration

// VM addresses through IPAMClaim (issue 36; docs/design.md, "VM addresses (IPAMClaim)"): real
// agents on two nodes, the controller and the plugin as processes, the IPAMClaim CRD from the
// ipamclaims module's artifacts on the real API server.

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	ipamclaimsv1alpha1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	claimclient "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// claimClient installs the IPAMClaim CRD (once per run; creating it again is a no-op) and
// returns a client for claims.
func claimClient(t *testing.T) claimclient.Interface {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if err := controlplane.InstallCRDs(context.Background(), restConfig, filepath.Join(root, "config", "ipamclaim")); err != nil {
		t.Fatal(err)
	}
	c, err := claimclient.NewForConfig(restConfig)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func createClaim(t *testing.T, cc claimclient.Interface, ns, name, network string) *ipamclaimsv1alpha1.IPAMClaim {
	t.Helper()
	c, err := cc.K8sV1alpha1().IPAMClaims(ns).Create(context.Background(), &ipamclaimsv1alpha1.IPAMClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       ipamclaimsv1alpha1.IPAMClaimSpec{Network: network}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.K8sV1alpha1().IPAMClaims(ns).Delete(context.Background(), name, metav1.DeleteOptions{}) })
	return c
}

// createLauncher creates a pod on node that references claim on the pod network as
// ipam-extensions' webhook does, a live migration's target when target.
func createLauncher(t *testing.T, name, node, claim string, target bool) *corev1.Pod {
	t.Helper()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name,
		Annotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: claim}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
	if target {
		p.Labels = map[string]string{ipamclaim.LabelMigrationTarget: "job-" + name}
	}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)) })
	return p
}

// addUntil runs ADD until it succeeds (a claim's ADD fails with code 11 while its binding and
// grant land) and returns the result.
func addUntil(t *testing.T, conf, cid, ifname string, p *corev1.Pod) *cniResult {
	t.Helper()
	var r *cniResult
	eventually(t, 30*time.Second, "ADD "+cid+" of "+p.Name, func() error {
		res, e := cniIf(t, "ADD", conf, cid, ifname, podArgs(p.Namespace, p.Name, string(p.UID)))
		if e != nil {
			return fmt.Errorf("code %d: %s", e.Code, e.Msg)
		}
		r = res
		return nil
	})
	return r
}

// bindings is the pool's record: claim UID -> address.
func bindings(t *testing.T, pool string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, b := range getPool(t, pool).Status.IPAMClaims {
		out[b.UID] = string(b.Address)
	}
	return out
}

func getClaim(t *testing.T, cc claimclient.Interface, ns, name string) *ipamclaimsv1alpha1.IPAMClaim {
	t.Helper()
	c, err := cc.K8sV1alpha1().IPAMClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// claimAllocated checks that a claim's status shows ips (CIDR form), ownerPod and
// IPsAllocated=True.
func claimAllocated(c *ipamclaimsv1alpha1.IPAMClaim, ips []string, owner string) error {
	if !slices.Equal(c.Status.IPs, ips) {
		return fmt.Errorf("claim %s: ips %v, want %v", c.Name, c.Status.IPs, ips)
	}
	if c.Status.OwnerPod == nil || c.Status.OwnerPod.Name != owner {
		return fmt.Errorf("claim %s: ownerPod %+v, want %s", c.Name, c.Status.OwnerPod, owner)
	}
	for _, cond := range c.Status.Conditions {
		if cond.Type == ipwardenv1.ClaimConditionIPsAllocated && cond.Status == metav1.ConditionTrue && cond.Reason == ipwardenv1.ClaimReasonAllocated {
			return nil
		}
	}
	return fmt.Errorf("claim %s: conditions %+v", c.Name, c.Status.Conditions)
}

// A VM migrates from node a to node b: the target pod (migration label) on b gets the claim's
// address while a's source still holds it (the pool's status records the shared grant, and
// ipwarden check is clean); the controller is killed, the source's DEL comes and a gives its copy
// back while no controller runs; the next controller takes it from a without cooling it, and b
// keeps it. A static-address annotation naming the claim's address is refused, naming the
// claim, and no ordinary pod on a gets it.
func TestClaimCrossNodeMigration(t *testing.T) {
	cc := claimClient(t)
	n := startTwoNodes(t, "vmx", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.158.0.0/24"}, ReuseCooldown: cooldown(time.Minute),
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}})
	claim := createClaim(t, cc, "default", "vm-x", "podnet")
	uid := string(claim.UID)

	src := createLauncher(t, "virt-launcher-vm-x-src", "vmx-a", "vm-x", false)
	a := addUntil(t, n.confA, "vmx-src", "eth0", src).IPs[0].Address
	ip := addrOf(t, a)
	if got := bindings(t, "vmx")[uid]; got != ip.String() {
		t.Fatalf("the pool binds claim vm-x to %q, want %s (before the ADD answered)", got, ip)
	}
	eventually(t, 20*time.Second, "the claim's status", func() error {
		return claimAllocated(getClaim(t, cc, "default", "vm-x"), []string{a}, src.Name)
	})

	tgt := createLauncher(t, "virt-launcher-vm-x-tgt", "vmx-b", "vm-x", true)
	if got := addUntil(t, n.confB, "vmx-tgt", "eth0", tgt).IPs[0].Address; got != a {
		t.Fatalf("the migration target got %s, want the claim's %s", got, a)
	}
	shared := func() []ipwardenv1.SharedClaimAddress { return getPool(t, "vmx").Status.Shared }
	if s := shared(); len(s) != 1 || string(s[0].Address) != ip.String() || s[0].UID != uid {
		t.Fatalf("pool status.shared %+v, want %s for %s", s, ip, uid)
	}
	if !held(t, "vmx-a", "vmx").Contains(ip) || !held(t, "vmx-b", "vmx").Contains(ip) {
		t.Fatalf("during the migration both nodes must hold %s", ip)
	}
	if r, code, out := runCheck(t); code != 0 {
		t.Fatalf("ipwarden check during the migration: exit %d %+v\n%s", code, r, out)
	}

	// The controller dies; the source's DEL comes and its pod goes.
	n.ctrl.kill()
	if _, e := cni(t, "DEL", n.confA, "vmx-src", podArgs(src.Namespace, src.Name, string(src.UID))); e != nil {
		t.Fatal(e)
	}
	if err := k8s.Delete(context.Background(), src, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "node a to give its copy back", func() error {
		for _, p := range nipa(t, "vmx-a").Spec.Pools {
			if p.Pool == "vmx" {
				rel, _ := addr.ParseSet(blocksOf(p.Releasing))
				if rel.Contains(ip) {
					return nil
				}
			}
		}
		return fmt.Errorf("vmx-a does not list %s in releasing", ip)
	})
	startController(t)
	eventually(t, 30*time.Second, "the shared grant to end with b", func() error {
		if held(t, "vmx-a", "vmx").Contains(ip) {
			return fmt.Errorf("vmx-a still holds %s", ip)
		}
		if s := shared(); len(s) != 0 {
			return fmt.Errorf("status.shared %+v", s)
		}
		return nil
	})
	if !held(t, "vmx-b", "vmx").Contains(ip) {
		t.Fatalf("vmx-b lost %s", ip)
	}
	for _, c := range getPool(t, "vmx").Status.Cooling {
		set, _ := addr.ParseSet(c.Addresses)
		if set.Contains(ip) {
			t.Fatalf("%s, still held by vmx-b, is cooling in the pool: %+v", ip, c)
		}
	}
	if got := bindings(t, "vmx")[uid]; got != ip.String() {
		t.Fatalf("binding after the migration %q, want %s", got, ip)
	}
	eventually(t, 20*time.Second, "the claim's owner to be the target", func() error {
		return claimAllocated(getClaim(t, cc, "default", "vm-x"), []string{a}, tgt.Name)
	})

	// A static address naming the claim's address is refused, naming the claim.
	static := createAnnotatedPod(t, "default", "static-vm-x", "vmx-a", map[string]string{podinfo.AnnotationIPAddresses: ip.String()})
	_, e := cni(t, "ADD", n.confA, "vmx-static", podArgs(static.Namespace, static.Name, string(static.UID)))
	if e == nil || !strings.Contains(e.Msg, "vm-x") {
		t.Fatalf("a static address naming claim vm-x's address: %v, want a refusal naming the claim", e)
	}
	for i := range 6 {
		if got := mustAdd(t, n.confA, fmt.Sprintf("vmx-other-%d", i)).IPs[0].Address; got == a {
			t.Fatalf("an ordinary pod got claim vm-x's address %s", got)
		}
	}
	if r, code, out := runCheck(t); code != 0 {
		t.Fatalf("ipwarden check after the migration: exit %d %+v\n%s", code, r, out)
	}
}

func blocksOf(bs []ipwardenv1.AddressBlock) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = string(b)
	}
	return out
}

// A pod with two claims on a secondary network: net1 and net2 each get the address of the
// claim their networks element names, recorded for it; a claim made for another network is
// refused, naming the mismatch, and gets no address.
func TestClaimsOnASecondaryNetwork(t *testing.T) {
	cc := claimClient(t)
	const node = "vmnet"
	agentPool(t, "vmnet-blue", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.159.0.0/24"}, Network: "tenantblue",
		ReuseCooldown: cooldown(0), Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}})
	agentNode(t, node, node)
	startController(t)
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := networkConf(ag.socket, "tenantblue", "tenantblue")
	c1 := createClaim(t, cc, "default", "vm-n.blue1", "tenantblue")
	c2 := createClaim(t, cc, "default", "vm-n.blue2", "tenantblue")
	createClaim(t, cc, "default", "vm-n.red", "tenantred")

	pod := createAnnotatedPod(t, "default", "virt-launcher-vm-n", node, map[string]string{ipamclaim.AnnotationNetworks: `[
		{"name":"tenantblue","interface":"net1","ipam-claim-reference":"vm-n.blue1"},
		{"name":"tenantblue","interface":"net2","ipam-claim-reference":"vm-n.blue2"}]`})
	n1 := addUntil(t, conf, "vmn", "net1", pod).IPs[0].Address
	n2 := addUntil(t, conf, "vmn", "net2", pod).IPs[0].Address
	if n1 == n2 {
		t.Fatalf("net1 and net2 both got %s", n1)
	}
	b := bindings(t, "vmnet-blue")
	if b[string(c1.UID)]+"/24" != n1 || b[string(c2.UID)]+"/24" != n2 {
		t.Fatalf("bindings %v, want %s for vm-n.blue1 and %s for vm-n.blue2", b, n1, n2)
	}
	eventually(t, 20*time.Second, "both claims' status", func() error {
		if err := claimAllocated(getClaim(t, cc, "default", "vm-n.blue1"), []string{n1}, pod.Name); err != nil {
			return err
		}
		return claimAllocated(getClaim(t, cc, "default", "vm-n.blue2"), []string{n2}, pod.Name)
	})

	red := createAnnotatedPod(t, "default", "virt-launcher-vm-r", node, map[string]string{ipamclaim.AnnotationNetworks: `[
		{"name":"tenantblue","interface":"net1","ipam-claim-reference":"vm-n.red"}]`})
	_, e := cniIf(t, "ADD", conf, "vmr", "net1", podArgs(red.Namespace, red.Name, string(red.UID)))
	if e == nil || !strings.Contains(e.Msg, "tenantred") {
		t.Fatalf("ADD with a claim of network tenantred on tenantblue: %v, want a refusal naming the mismatch", e)
	}
	// net1's DEL leaves its claim's binding: the claim lives, the address waits for it.
	if _, e := cniIf(t, "DEL", conf, "vmn", "net1", podArgs(pod.Namespace, pod.Name, string(pod.UID))); e != nil {
		t.Fatal(e)
	}
	if got := bindings(t, "vmnet-blue")[string(c1.UID)]; got+"/24" != n1 {
		t.Fatalf("after net1's DEL the binding of vm-n.blue1 is %q, want %s", got, n1)
	}
}
