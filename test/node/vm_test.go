package node

// VM addresses through IPAMClaim (issue 36; docs/design.md, "VM addresses (IPAMClaim)") on the
// real node: launcher-like pods (no KubeVirt: plain pods carrying the annotations and labels
// ipam-extensions and KubeVirt set) on a real kubelet and containerd, ipwarden deployed from its
// own manifests, the IPAMClaim CRD from the ipamclaims module's artifacts.

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	ipamclaimsv1alpha1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	claimclient "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// vmNetwork is the CNI network name of the suite's ipwarden configuration
// (deploy/kustomize/agent.yaml): what ipam-extensions writes in a claim's spec.network.
const vmNetwork = "ipwarden"

// vmPoolCIDR is the suite's /24 (the bridge cni0 keeps its gateway address 10.244.0.1/24 from
// the tests before), cut to 13 addresses (.2 to .14) by vmPoolExclude, so a Deployment of 12
// fills the pool beside one VM.
var (
	vmPoolCIDR    = netip.MustParsePrefix("10.244.0.0/24")
	vmPoolExclude = []ipwardenv1.IPOrCIDR{"10.244.0.15", "10.244.0.16/28", "10.244.0.32/27", "10.244.0.64/26", "10.244.0.128/25"}
)

type vmNode struct {
	*realNode
	ctx    context.Context
	claims claimclient.Interface
	// shared are the addresses allowed on two pod network namespaces at this moment (a live
	// migration's source and target); any other duplicate fails the test.
	shared map[netip.Addr]bool
}

func TestRealNodeVMAddresses(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	began := time.Now()
	n := startNodeIn(t, ctx, "vm", "vm-fs")
	n.pool = ipwardenv1.IPPoolSpec{
		CIDRs:   []ipwardenv1.CIDR{ipwardenv1.CIDR(vmPoolCIDR.String())},
		Exclude: vmPoolExclude,
		Gateway: "10.244.0.1",
		// Addresses a scale-down leaves unused go back to the pool within seconds, so the
		// controller has free ones to bind to new claims.
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 16, ReleaseSlackPercent: ptr.To(int32(0)), ReleaseDelay: &metav1.Duration{Duration: time.Second}},
		ReuseCooldown: metav1.Duration{Duration: 0},
	}
	if err := controlplane.InstallCRDs(ctx, n.cp.Config, filepath.Join(prep.Root, "config", "ipamclaim")); err != nil {
		t.Fatal(err)
	}
	cc, err := claimclient.NewForConfig(n.cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	v := &vmNode{realNode: n, ctx: ctx, claims: cc, shared: map[netip.Addr]bool{}}
	n.deployIpwarden(ctx)
	if _, err := n.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx, sleeperDeployment("filler", 0, map[string]string{"app": "filler"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// 1. First start: the claim gets its address, ownerPod and IPsAllocated=True.
	claimA := v.createClaim("vm-a", nil)
	v.launcher("a1", "vm-a", false)
	a, _ := v.waitRunning("a1")
	v.waitAllocated("vm-a", a, "a1")
	v.waitBinding(string(claimA.UID), a, true)
	n.logf("vm: first start: vm-a has %s", a)

	// 2. Restart with the pool filled in between: a1 is deleted, 13 filler pods ask for the
	// pool's 13 addresses; 12 run, none with vm-a's, the 13th waits. A new launcher gets it.
	v.deletePod("a1")
	n.kubectl("scale", "-n", testNamespace, "deployment/filler", "--replicas=13")
	v.waitFillers(12, a)
	v.launcher("a2", "vm-a", false)
	if got, _ := v.waitRunning("a2"); got != a {
		t.Fatalf("vm: the restarted VM got %s, want its claim's %s", got, a)
	}
	v.waitAllocated("vm-a", a, "a2")
	n.logf("vm: restart with the pool full kept %s", a)

	// 3. Exhaustion: a new claim in the full pool says SubnetExhausted.
	v.createClaim("vm-c", nil)
	v.launcher("c1", "vm-c", false)
	v.waitClaim("vm-c", func(c *ipamclaimsv1alpha1.IPAMClaim) error {
		return claimCondition(c, metav1.ConditionFalse, ipwardenv1.ClaimReasonSubnetExhausted)
	})
	v.deletePod("c1")
	v.deleteClaim("vm-c")
	n.kubectl("scale", "-n", testNamespace, "deployment/filler", "--replicas=4")
	v.waitFillers(4, a)
	n.logf("vm: a claim in the full pool got SubnetExhausted")

	// 4. Conflict: a claim whose status.ips is pre-set (bare, as Whereabouts writes it) to
	// vm-a's address gets IPAddressConflict; vm-a's pod is untouched.
	_, netnsA2 := v.waitRunning("a2")
	v.createClaim("vm-b", []string{a.String()})
	v.launcher("b1", "vm-b", false)
	v.waitClaim("vm-b", func(c *ipamclaimsv1alpha1.IPAMClaim) error {
		return claimCondition(c, metav1.ConditionFalse, ipwardenv1.ClaimReasonAddressConflict)
	})
	v.notRunning("b1")
	v.untouched("a2", a, netnsA2)
	v.deletePod("b1")
	v.deleteClaim("vm-b")
	n.logf("vm: a claim pre-set to vm-a's address got IPAddressConflict")

	// 5. A claim created after its pod: the pod waits (its sandbox fails naming the claim),
	// then runs with a recorded address.
	d1 := v.launcher("d1", "vm-d", false)
	v.waitSandboxFailure(d1, "vm-d")
	claimD := v.createClaim("vm-d", nil)
	d, _ := v.waitRunning("d1")
	v.waitAllocated("vm-d", d, "d1")
	v.waitBinding(string(claimD.UID), d, true)
	n.logf("vm: a late claim gave its waiting pod %s", d)

	// 6. The claim deleted while its pod runs: the binding stays until the pod is gone. A claim
	// created after the deletion and bound shows the controller has seen the deletion.
	v.deleteClaim("vm-d")
	claimE := v.createClaim("vm-e", nil)
	v.launcher("e1", "vm-e", false)
	e, _ := v.waitRunning("e1")
	v.waitAllocated("vm-e", e, "e1")
	v.waitBinding(string(claimD.UID), d, true)
	if got, _ := v.waitRunning("d1"); got != d {
		t.Fatalf("vm: d1 has %s, want %s", got, d)
	}
	v.deletePod("d1")
	v.waitBinding(string(claimD.UID), d, false)
	v.deletePod("e1")
	v.deleteClaim("vm-e")
	// Until the controller has listed the claims again, ipwarden check reports vm-e's binding as
	// an orphan (a CI run once checked in between).
	v.waitBinding(string(claimE.UID), e, false)
	n.logf("vm: a deleted claim's binding stayed while its pod ran and went with it")

	// 7. Live migration on one node: the target (migration label) runs beside the source with
	// the same address, and ipwarden check is clean.
	v.shared[a] = true
	v.launcher("a3", "vm-a", true)
	if got, _ := v.waitRunning("a3"); got != a {
		t.Fatalf("vm: the migration target got %s, want %s", got, a)
	}
	v.untouched("a2", a, netnsA2)
	n.checkClean(ctx)
	n.logf("vm: the migration target shares %s with its source", a)

	// 8. A third holder waits, naming the claim.
	a4 := v.launcher("a4", "vm-a", true)
	v.waitSandboxFailure(a4, "vm-a")
	v.notRunning("a4")

	// 9. A failed migration: the target is deleted, the source is untouched, and the waiting
	// third pod becomes the new target.
	v.deletePod("a3")
	v.untouched("a2", a, netnsA2)
	if got, _ := v.waitRunning("a4"); got != a {
		t.Fatalf("vm: the next target got %s, want %s", got, a)
	}
	n.logf("vm: a failed migration left the source alone")

	// 10. The agent, the controller and the API server restart between the target's ADD and
	// the source's DEL; then the source goes and the target keeps the address.
	n.replaceAgentPod(ctx, func() { v.scan() })
	n.kubectl("rollout", "restart", "-n", "ipwarden-system", "deployment/ipwarden-controller")
	n.kubectl("rollout", "status", "-n", "ipwarden-system", "deployment/ipwarden-controller", "--timeout=3m")
	if err := n.cp.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	if err := n.cp.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	n.waitNodeReady(ctx)
	_, netnsA4 := v.waitRunning("a4")
	v.untouched("a2", a, netnsA2)
	v.deletePod("a2")
	delete(v.shared, a)
	v.untouched("a4", a, netnsA4)
	v.waitAllocated("vm-a", a, "a4")
	n.checkClean(ctx)
	n.logf("vm: restarts of the agent, the controller and the API server mid-migration kept %s", a)

	// 11. The VM deleted: the claim goes, then its pod; the binding goes with them.
	v.deleteClaim("vm-a")
	v.deletePod("a4")
	v.waitBinding(string(claimA.UID), a, false)
	n.logf("vm: suite body took %s", time.Since(began).Round(time.Second))
}

// claimShows checks a claim's status: ips is exactly ip in CIDR form with the pool's prefix,
// ownerPod is pod and IPsAllocated has the status and reason.
func claimShows(c *ipamclaimsv1alpha1.IPAMClaim, ip netip.Addr, pod string, status metav1.ConditionStatus, reason string) error {
	want := ipamclaim.FormatIP(ip, vmPoolCIDR.Bits())
	if !slices.Equal(c.Status.IPs, []string{want}) {
		return fmt.Errorf("claim %s: status.ips %v, want [%s]", c.Name, c.Status.IPs, want)
	}
	if c.Status.OwnerPod == nil || c.Status.OwnerPod.Name != pod {
		return fmt.Errorf("claim %s: ownerPod %+v, want %s", c.Name, c.Status.OwnerPod, pod)
	}
	return claimCondition(c, status, reason)
}

func claimCondition(c *ipamclaimsv1alpha1.IPAMClaim, status metav1.ConditionStatus, reason string) error {
	for _, cond := range c.Status.Conditions {
		if cond.Type == ipwardenv1.ClaimConditionIPsAllocated {
			if cond.Status != status || cond.Reason != reason {
				return fmt.Errorf("claim %s: %s is %s/%s (%s), want %s/%s", c.Name, cond.Type, cond.Status, cond.Reason, cond.Message, status, reason)
			}
			return nil
		}
	}
	return fmt.Errorf("claim %s has no %s condition yet: %+v", c.Name, ipwardenv1.ClaimConditionIPsAllocated, c.Status)
}

func (v *vmNode) createClaim(name string, ips []string) *ipamclaimsv1alpha1.IPAMClaim {
	v.t.Helper()
	api := v.claims.K8sV1alpha1().IPAMClaims(testNamespace)
	c, err := api.Create(v.ctx, &ipamclaimsv1alpha1.IPAMClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name},
		Spec:       ipamclaimsv1alpha1.IPAMClaimSpec{Network: vmNetwork}}, metav1.CreateOptions{})
	if err != nil {
		v.t.Fatal(err)
	}
	if ips != nil {
		c.Status.IPs = ips
		if c, err = api.UpdateStatus(v.ctx, c, metav1.UpdateOptions{}); err != nil {
			v.t.Fatal(err)
		}
	}
	return c
}

func (v *vmNode) deleteClaim(name string) {
	v.t.Helper()
	if err := v.claims.K8sV1alpha1().IPAMClaims(testNamespace).Delete(v.ctx, name, metav1.DeleteOptions{}); err != nil {
		v.t.Fatal(err)
	}
}

// launcher creates a pod bound to the node that references claim on the pod network the way
// ipam-extensions' webhook does (k8s.ovn.org/primary-udn-ipamclaim), a migration target when
// target (KubeVirt's label).
func (v *vmNode) launcher(name, claim string, target bool) string {
	v.t.Helper()
	labels := map[string]string{"app": "launcher"}
	if target {
		labels[ipamclaim.LabelMigrationTarget] = "migration-" + name
	}
	spec := sleeperPodSpec()
	spec.NodeName = nodeName
	p, err := v.kube.CoreV1().Pods(testNamespace).Create(v.ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name, Labels: labels,
			Annotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: claim}},
		Spec: spec}, metav1.CreateOptions{})
	if err != nil {
		v.t.Fatal(err)
	}
	return string(p.UID)
}

func (v *vmNode) deletePod(name string) {
	v.t.Helper()
	if err := v.kube.CoreV1().Pods(testNamespace).Delete(v.ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To(int64(1))}); err != nil {
		v.t.Fatal(err)
	}
	v.wait(2*time.Minute, "pod "+name+" to be gone", func() error {
		_, err := v.kube.CoreV1().Pods(testNamespace).Get(v.ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		return fmt.Errorf("still there")
	})
}

// wait polls cond with a deadline, scanning every pod network namespace for a duplicate
// address the moment allows on each poll.
func (v *vmNode) wait(timeout time.Duration, what string, cond func() error) {
	v.t.Helper()
	if err := localcluster.WaitFor(v.ctx, timeout, 250*time.Millisecond, func() error {
		v.scan()
		return cond()
	}); err != nil {
		v.dumpState(v.ctx)
		v.t.Fatalf("vm: waiting for %s: %v", what, err)
	}
}

// scan fails the test when an address is on two pod network namespaces, other than a shared
// claim address on exactly two.
func (v *vmNode) scan() map[netip.Addr][]string {
	v.t.Helper()
	addrs, err := podAddresses()
	if err != nil {
		v.t.Fatal(err)
	}
	for a, ns := range addrs {
		if len(ns) > 2 || (len(ns) == 2 && !v.shared[a]) {
			v.t.Fatalf("vm: %s is on %d pod network namespaces %v", a, len(ns), ns)
		}
	}
	return addrs
}

// waitRunning waits until pod name runs with a pool address that its own sandbox's network
// namespace carries, and returns both.
func (v *vmNode) waitRunning(name string) (netip.Addr, string) {
	v.t.Helper()
	var ip netip.Addr
	var netns string
	v.wait(2*time.Minute, "pod "+name+" to run", func() error {
		p, err := v.kube.CoreV1().Pods(testNamespace).Get(v.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("pod %s is %s (ip %q)", name, p.Status.Phase, p.Status.PodIP)
		}
		if ip, err = netip.ParseAddr(p.Status.PodIP); err != nil || !vmPoolCIDR.Contains(ip) {
			v.t.Fatalf("vm: pod %s has %q, not in %s", name, p.Status.PodIP, vmPoolCIDR)
		}
		if _, netns, err = v.podSandbox(v.ctx, string(p.UID)); err != nil {
			return err
		}
		if !v.netnsCarries(ip, netns) {
			return fmt.Errorf("pod %s: its sandbox's namespace %s does not carry %s", name, netns, ip)
		}
		return nil
	})
	return ip, netns
}

// untouched fails the test unless pod name still runs with ip in the network namespace netns.
func (v *vmNode) untouched(name string, ip netip.Addr, netns string) {
	v.t.Helper()
	got, ns := v.waitRunning(name)
	if got != ip || ns != netns {
		v.t.Fatalf("vm: pod %s now has %s in %s, had %s in %s", name, got, ns, ip, netns)
	}
}

// notRunning fails the test if pod name has an address.
func (v *vmNode) notRunning(name string) {
	v.t.Helper()
	p, err := v.kube.CoreV1().Pods(testNamespace).Get(v.ctx, name, metav1.GetOptions{})
	if err != nil {
		v.t.Fatal(err)
	}
	if p.Status.PodIP != "" {
		v.t.Fatalf("vm: pod %s got %s", name, p.Status.PodIP)
	}
}

// waitSandboxFailure waits for a FailedCreatePodSandBox event of the pod whose message names
// what (the CNI error the agent answered).
func (v *vmNode) waitSandboxFailure(uid, what string) {
	v.t.Helper()
	v.wait(2*time.Minute, "a sandbox failure naming "+what, func() error {
		evs, err := v.kube.CoreV1().Events(testNamespace).List(v.ctx, metav1.ListOptions{
			FieldSelector: "involvedObject.uid=" + uid + ",reason=FailedCreatePodSandBox"})
		if err != nil {
			return err
		}
		var msgs []string
		for _, e := range evs.Items {
			if strings.Contains(e.Message, what) {
				return nil
			}
			msgs = append(msgs, e.Message)
		}
		return fmt.Errorf("sandbox failures %q", msgs)
	})
}

// waitBinding waits until the pool's status binds ip to the claim uid (present) or holds no
// binding of uid (!present).
func (v *vmNode) waitBinding(uid string, ip netip.Addr, present bool) {
	v.t.Helper()
	v.wait(2*time.Minute, fmt.Sprintf("binding of %s to claim %s present=%v", ip, uid, present), func() error {
		var pool ipwardenv1.IPPool
		if err := v.k8s.Get(v.ctx, client.ObjectKey{Name: poolName}, &pool); err != nil {
			return err
		}
		for _, b := range pool.Status.IPAMClaims {
			if b.UID == uid {
				if !present {
					return fmt.Errorf("binding %+v still there", b)
				}
				if string(b.Address) != ip.String() {
					v.t.Fatalf("vm: claim %s is bound to %s, want %s", uid, b.Address, ip)
				}
				return nil
			}
		}
		if present {
			return fmt.Errorf("no binding of claim %s in %+v", uid, pool.Status.IPAMClaims)
		}
		return nil
	})
}

// waitAllocated waits until claim name shows ip, owner pod and IPsAllocated=True.
func (v *vmNode) waitAllocated(name string, ip netip.Addr, pod string) {
	v.t.Helper()
	v.waitClaim(name, func(c *ipamclaimsv1alpha1.IPAMClaim) error {
		return claimShows(c, ip, pod, metav1.ConditionTrue, ipwardenv1.ClaimReasonAllocated)
	})
}

// waitFillers waits until exactly want filler pods run, none with the claim's address ip.
func (v *vmNode) waitFillers(want int, ip netip.Addr) {
	v.t.Helper()
	v.wait(3*time.Minute, fmt.Sprintf("%d running fillers", want), func() error {
		list, err := v.kube.CoreV1().Pods(testNamespace).List(v.ctx, metav1.ListOptions{LabelSelector: "app=filler"})
		if err != nil {
			return err
		}
		running := 0
		for _, p := range list.Items {
			if p.Status.PodIP == ip.String() {
				v.t.Fatalf("vm: filler %s got the claim's address %s", p.Name, ip)
			}
			if p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" && p.DeletionTimestamp == nil {
				running++
			}
		}
		if running != want {
			return fmt.Errorf("%d fillers run, want %d", running, want)
		}
		return nil
	})
}

func (v *vmNode) waitClaim(name string, cond func(*ipamclaimsv1alpha1.IPAMClaim) error) {
	v.t.Helper()
	v.wait(2*time.Minute, "claim "+name, func() error {
		c, err := v.claims.K8sV1alpha1().IPAMClaims(testNamespace).Get(v.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		return cond(c)
	})
}
