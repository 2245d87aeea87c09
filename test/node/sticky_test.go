package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// stickySet is the sticky StatefulSet of the real-node suite, in the workload namespace.
const stickySet = "web"

// checkStickyStatefulSet runs a 2-replica StatefulSet with the ipwarden.io/sticky opt-in (the
// pool itself is not sticky) beside the workload Deployment, and checks that its pods keep
// their addresses when a pod is deleted and re-created under its name, on `kubectl rollout
// restart`, and when its sandbox is stopped under the kubelet; that scaling to 1 returns
// ordinal 1's reservation (whenScaled: Delete) and deleting the StatefulSet returns the rest
// (whenDeleted: Delete). Every poll scans every pod network namespace for an address on two.
//
// On one node an allocator without stickiness would often hand a re-created pod its old address
// anyway (it is the one just freed). So the node is kept full (maxPerNode 8: 6 Deployment pods
// and 2 StatefulSet pods) and a "squatter" pod, bound to the node directly, keeps asking for an
// address throughout: without the reservation it gets the address a StatefulSet pod gave up,
// and that pod none. It leaves the Deployment at 7 pods and no StatefulSet.
func (n *realNode) checkStickyStatefulSet(ctx context.Context) {
	t := n.t
	n.scale(ctx, 6)
	deploy := n.waitPods(ctx, 6)
	labels := map[string]string{"app": stickySet}
	sts := &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: stickySet},
		Spec: appsv1.StatefulSetSpec{
			Replicas:            ptr.To(int32(2)),
			ServiceName:         stickySet,
			PodManagementPolicy: appsv1.ParallelPodManagement,
			Selector:            &metav1.LabelSelector{MatchLabels: labels},
			PersistentVolumeClaimRetentionPolicy: &appsv1.StatefulSetPersistentVolumeClaimRetentionPolicy{
				WhenScaled: appsv1.DeletePersistentVolumeClaimRetentionPolicyType, WhenDeleted: appsv1.DeletePersistentVolumeClaimRetentionPolicyType},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: map[string]string{podinfo.AnnotationSticky: "true"}},
				Spec:       sleeperPodSpec(),
			},
		},
	}
	start := time.Now()
	if _, err := n.kube.AppsV1().StatefulSets(testNamespace).Create(ctx, sts, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Should a step fail, the rest of the suite gets its scheduler back and the Deployment alone.
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		if !n.scheduler.Running() {
			_ = n.scheduler.Restart()
		}
		bg := context.Background()
		_ = n.kube.AppsV1().StatefulSets(testNamespace).Delete(bg, stickySet, metav1.DeleteOptions{})
		_ = n.kube.CoreV1().Pods(testNamespace).Delete(bg, squatterName, metav1.DeleteOptions{})
		n.others, n.refuseSquatter = 0, false
	})
	n.others = 2
	first := n.waitStatefulSet(ctx, 2, 6)
	n.logf("sticky: StatefulSet running in %s: %s", time.Since(start).Round(time.Millisecond), podIPs(first))
	want := map[string]string{}
	for _, p := range first {
		want[testNamespace+"/"+p.name] = p.ip.String()
	}
	n.waitStickyRecord(ctx, want)

	same := func(step string, before, after []pod, newPod func(b, a pod) bool) {
		t.Helper()
		if b, a := podIPs(before), podIPs(after); b != a {
			t.Fatalf("sticky: addresses changed across %s:\nbefore %s\nafter  %s", step, b, a)
		}
		for i := range before {
			if newPod(before[i], after[i]) && after[i].netns == before[i].netns {
				t.Fatalf("sticky: %s: %s runs in the same network namespace %s as before: not restarted", step, after[i].name, after[i].netns)
			}
		}
		n.logf("sticky: %s kept %s", step, podIPs(after))
		n.waitStickyRecord(ctx, want)
	}

	// 1. Delete web-0 with the scheduler stopped, so the StatefulSet controller's new web-0
	// (same name, new UID) stays unscheduled while the squatter asks for an address: once the
	// agent has freed web-0's address, an ADD of the squatter that began after that fails.
	start = time.Now()
	n.scheduler.Stop()
	n.kubectl("delete", "pod", "-n", testNamespace, first[0].name, "--wait=true")
	squatter := n.createSquatter(ctx)
	n.refuseSquatter = true
	n.waitAgentFreed(ctx, first[0].ip, first[0].name)
	base := n.sandboxFailures(ctx, squatter)
	if err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
		if ns := n.scanNoDuplicates()[first[0].ip]; len(ns) > 0 {
			t.Fatalf("sticky: %s, reserved for %s (unscheduled), is on network namespace %v", first[0].ip, first[0].name, ns)
		}
		n.squatterHasNoAddress(ctx)
		if f := n.sandboxFailures(ctx, squatter); f <= base {
			return fmt.Errorf("%d failed sandbox creations of the squatter, waiting for more than %d", f, base)
		}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	n.logf("sticky: the squatter was refused %s while %s was away", first[0].ip, first[0].name)
	if err := n.scheduler.Restart(); err != nil {
		t.Fatal(err)
	}
	after := n.waitStatefulSetWhere(ctx, 2, 6, func(p pod) error {
		if p.name == first[0].name && p.uid == first[0].uid {
			return fmt.Errorf("%s not re-created yet", p.name)
		}
		return nil
	})
	same("deleting "+first[0].name, first, after, func(b, a pod) bool { return b.name == first[0].name })
	n.logf("sticky: pod delete and re-create took %s", time.Since(start).Round(time.Millisecond))
	n.checkPing(ctx, append([]pod{deploy[0]}, after...))
	n.checkAttachments(ctx, append(slices.Clone(deploy), after...))

	// 2. kubectl rollout restart: every pod replaced, one at a time.
	start = time.Now()
	before := after
	n.kubectl("rollout", "restart", "-n", testNamespace, "statefulset/"+stickySet)
	n.kubectl("rollout", "status", "-n", testNamespace, "statefulset/"+stickySet, "--timeout=3m")
	after = n.waitStatefulSetWhere(ctx, 2, 6, func(p pod) error {
		for _, b := range before {
			if b.uid == p.uid {
				return fmt.Errorf("%s not replaced yet", p.name)
			}
		}
		return nil
	})
	same("kubectl rollout restart", before, after, func(pod, pod) bool { return true })
	n.logf("sticky: rollout restart took %s", time.Since(start).Round(time.Millisecond))

	// 3. The runtime stops web-1's sandbox under the kubelet (as when its pause process
	// dies): the kubelet starts a new sandbox for the same pod (same UID).
	start = time.Now()
	before = after
	victim := before[1]
	n.logf("sticky: stopping the sandbox %s of %s", victim.sandbox[:12], victim.name)
	if _, err := n.cri.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: victim.sandbox}); err != nil {
		t.Fatal(err)
	}
	after = n.waitStatefulSetWhere(ctx, 2, 6, func(p pod) error {
		if p.name == victim.name && (p.uid != victim.uid || p.sandbox == victim.sandbox) {
			return fmt.Errorf("%s (uid %s) runs in sandbox %s, want a new sandbox of uid %s", p.name, p.uid, p.sandbox[:12], victim.uid)
		}
		return nil
	})
	same("stopping the sandbox of "+victim.name, before, after, func(b, a pod) bool { return b.name == victim.name })
	n.logf("sticky: sandbox restart took %s", time.Since(start).Round(time.Millisecond))
	n.checkPing(ctx, append([]pod{deploy[0]}, after...))
	n.checkAttachments(ctx, append(slices.Clone(deploy), after...))

	// 4. Scale to 1 (whenScaled: Delete): ordinal 1's reservation goes back to the pool, and
	// the squatter gets the address (the node's only free one).
	start = time.Now()
	n.refuseSquatter = false
	n.kubectl("scale", "-n", testNamespace, "statefulset/"+stickySet, "--replicas=1")
	delete(want, testNamespace+"/"+first[1].name)
	n.waitStickyRecord(ctx, want)
	sq := n.waitSquatterRunning(ctx, first[1].ip)
	after = n.waitStatefulSet(ctx, 1, 7)
	n.logf("sticky: scale to 1 returned %s, now the squatter's, in %s", first[1].ip, time.Since(start).Round(time.Millisecond))
	n.checkAttachments(ctx, append(append(slices.Clone(deploy), after...), sq))
	n.kubectl("delete", "pod", "-n", testNamespace, squatterName, "--wait=true")
	n.others = 1
	out := n.checkClean(ctx)
	if line := fmt.Sprintf("reserves %s for %s/%s", first[0].ip, testNamespace, first[0].name); !strings.Contains(out, line) {
		t.Fatalf("ipwarden check does not list %q:\n%s", line, out)
	}
	if strings.Contains(out, testNamespace+"/"+first[1].name) {
		t.Fatalf("ipwarden check still lists %s:\n%s", first[1].name, out)
	}

	// 5. Delete the StatefulSet (whenDeleted: Delete): the last reservation goes, and its
	// address serves ordinary pods again: the Deployment fills the node's 8 addresses.
	n.kubectl("delete", "statefulset", "-n", testNamespace, stickySet, "--wait=true")
	n.others = 0
	n.waitStickyRecord(ctx, map[string]string{})
	n.scale(ctx, 8)
	n.checkAttachments(ctx, n.waitPods(ctx, 8))
	n.scale(ctx, 7)
	n.waitPods(ctx, 7)
}

// squatterName is a pod bound to the node directly (no scheduler) that asks for an address
// while the node has none free but a reserved one.
const squatterName = "squatter"

func sleeperPodSpec() corev1.PodSpec {
	return corev1.PodSpec{
		TerminationGracePeriodSeconds: ptr.To(int64(2)),
		AutomountServiceAccountToken:  ptr.To(false),
		EnableServiceLinks:            ptr.To(false),
		Containers: []corev1.Container{{
			Name: "sleeper", Image: workloadImage, ImagePullPolicy: corev1.PullNever,
		}},
	}
}

func (n *realNode) createSquatter(ctx context.Context) string {
	spec := sleeperPodSpec()
	spec.NodeName = nodeName
	p, err := n.kube.CoreV1().Pods(testNamespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: squatterName, Labels: map[string]string{"app": squatterName}},
		Spec:       spec}, metav1.CreateOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	return string(p.UID)
}

// squatterHasNoAddress fails the test if the squatter has an address.
func (n *realNode) squatterHasNoAddress(ctx context.Context) {
	n.t.Helper()
	p, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, squatterName, metav1.GetOptions{})
	if err != nil {
		return // not there (yet or any more)
	}
	if p.Status.PodIP != "" {
		n.t.Fatalf("sticky: the squatter got %s while the node's only free address was reserved", p.Status.PodIP)
	}
}

// waitSquatterRunning waits until the squatter runs with address ip on its sandbox's network
// namespace.
func (n *realNode) waitSquatterRunning(ctx context.Context, ip netip.Addr) pod {
	t := n.t
	t.Helper()
	var got pod
	err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		addrs := n.scanNoDuplicates()
		p, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, squatterName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("squatter is %s (ip %q)", p.Status.Phase, p.Status.PodIP)
		}
		if p.Status.PodIP != ip.String() {
			t.Fatalf("sticky: the squatter got %s, want %s (the node's only free address)", p.Status.PodIP, ip)
		}
		sandbox, netns, err := n.podSandbox(ctx, string(p.UID))
		if err != nil {
			return err
		}
		if ns := addrs[ip]; len(ns) != 1 || ns[0] != netns {
			return fmt.Errorf("squatter address %s is on network namespaces %v, want only %s", ip, ns, netns)
		}
		got = pod{name: p.Name, uid: string(p.UID), ip: ip, netns: netns, sandbox: sandbox}
		return nil
	})
	if err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	return got
}

// sandboxFailures counts the kubelet's FailedCreatePodSandBox events for the pod with uid.
func (n *realNode) sandboxFailures(ctx context.Context, uid string) int {
	evs, err := n.kube.CoreV1().Events(testNamespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.uid=" + uid + ",reason=FailedCreatePodSandBox"})
	if err != nil {
		n.t.Fatal(err)
	}
	var c int
	for _, e := range evs.Items {
		c += max(1, int(e.Count))
	}
	return c
}

// waitAgentFreed waits until no attachment of the agent has ip, reserved for owner: an
// attachment of another pod to it fails the test.
func (n *realNode) waitAgentFreed(ctx context.Context, ip netip.Addr, owner string) {
	t := n.t
	t.Helper()
	err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
		n.scanNoDuplicates()
		got, err := agentAttachments()
		if err != nil {
			return err
		}
		if pod, ok := got[ip.String()]; ok && pod != owner {
			t.Fatalf("sticky: the agent attached %s, reserved for %s, to %s", ip, owner, pod)
		} else if ok {
			return fmt.Errorf("the agent still has %s attached to %s", ip, pod)
		}
		return nil
	})
	if err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
}

// waitStatefulSet waits until the sticky StatefulSet runs exactly want pods and the node's
// pod network namespaces carry exactly want+others pool addresses.
func (n *realNode) waitStatefulSet(ctx context.Context, want, others int) []pod {
	return n.waitStatefulSetWhere(ctx, want, others, func(pod) error { return nil })
}

// waitStatefulSetWhere is waitStatefulSet until every pod also satisfies cond. A pod counts when
// it is Running with one pool address in status.podIP and status.podIPs, and that address is on
// its ready sandbox's network namespace (asked of the runtime) and on no other.
func (n *realNode) waitStatefulSetWhere(ctx context.Context, want, others int, cond func(pod) error) []pod {
	t := n.t
	t.Helper()
	var pods []pod
	err := localcluster.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func() error {
		addrs := n.scanNoDuplicates()
		if n.refuseSquatter {
			n.squatterHasNoAddress(ctx)
		}
		list, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=" + stickySet})
		if err != nil {
			return err
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.DeletionTimestamp != nil {
				return fmt.Errorf("pod %s is terminating", p.Name)
			}
			if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
				return fmt.Errorf("pod %s is %s (ip %q)", p.Name, p.Status.Phase, p.Status.PodIP)
			}
			if len(p.Status.PodIPs) != 1 || p.Status.PodIPs[0].IP != p.Status.PodIP {
				return fmt.Errorf("pod %s: podIP %s, podIPs %v", p.Name, p.Status.PodIP, p.Status.PodIPs)
			}
			ip, err := netip.ParseAddr(p.Status.PodIP)
			if err != nil || !poolPrefix.Contains(ip) {
				t.Fatalf("pod %s has address %q, not in pool %s", p.Name, p.Status.PodIP, poolCIDR)
			}
			sandbox, netns, err := n.podSandbox(ctx, string(p.UID))
			if err != nil {
				return fmt.Errorf("pod %s: %w", p.Name, err)
			}
			if ns := addrs[ip]; len(ns) != 1 || ns[0] != netns {
				return fmt.Errorf("pod %s address %s is on network namespaces %v, want only its sandbox's %s", p.Name, ip, ns, netns)
			}
			got := pod{name: p.Name, uid: string(p.UID), ip: ip, netns: netns, sandbox: sandbox}
			if err := cond(got); err != nil {
				return err
			}
			pods = append(pods, got)
		}
		if len(pods) != want {
			return fmt.Errorf("%d StatefulSet pods, want %d", len(pods), want)
		}
		var inPool int
		for a := range addrs {
			if poolPrefix.Contains(a) {
				inPool++
			}
		}
		if inPool != want+others {
			return fmt.Errorf("%d pool addresses on pod network namespaces, want %d", inPool, want+others)
		}
		return nil
	})
	if err != nil {
		n.dumpState(ctx)
		t.Fatalf("waiting for %d running StatefulSet pods: %v", want, err)
	}
	sort.Slice(pods, func(i, j int) bool { return pods[i].name < pods[j].name })
	return pods
}

// podSandbox asks the runtime for the pod's one ready sandbox: its id and the name of its
// network namespace in /run/netns (from the sandbox's runtime spec).
func (n *realNode) podSandbox(ctx context.Context, uid string) (string, string, error) {
	resp, err := n.cri.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State:         &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": uid},
	}})
	if err != nil {
		return "", "", err
	}
	if len(resp.Items) != 1 {
		return "", "", fmt.Errorf("%d ready sandboxes", len(resp.Items))
	}
	id := resp.Items[0].Id
	st, err := n.cri.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		return "", "", err
	}
	var info struct {
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string }
			}
		}
	}
	if err := json.Unmarshal([]byte(st.Info["info"]), &info); err != nil {
		return "", "", fmt.Errorf("sandbox %s info: %w", id[:12], err)
	}
	for _, ns := range info.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" && ns.Path != "" {
			return id, filepath.Base(ns.Path), nil
		}
	}
	return "", "", fmt.Errorf("sandbox %s has no network namespace path", id[:12])
}

// waitStickyRecord waits until the pool's status.sticky is exactly want (namespace/pod name ->
// address).
func (n *realNode) waitStickyRecord(ctx context.Context, want map[string]string) {
	t := n.t
	t.Helper()
	var got map[string]string
	err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
		n.scanNoDuplicates()
		var pool ipwardenv1.IPPool
		if err := n.k8s.Get(ctx, client.ObjectKey{Name: poolName}, &pool); err != nil {
			return err
		}
		got = map[string]string{}
		for _, e := range pool.Status.Sticky {
			got[fmt.Sprintf("%s/%s-%d", e.Namespace, e.StatefulSet, e.Ordinal)] = string(e.Address)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("pool %s status.sticky %v, want %v", poolName, got, want)
		}
		return nil
	})
	if err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
}
