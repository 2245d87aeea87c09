package node

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// draDriver is the DRA driver the agent registers (internal/agent/dra).
const draDriver = "ipam.ipwarden.io"

// TestRealNodeDRA runs ipwarden with its DRA component (deploy/kustomize/dra) on the real node,
// with the real scheduler and controller manager: the node's ResourceSlice shows one slot per
// address the node can give (maxPerNode 4); pods from a ResourceClaimTemplate run with the
// address their claim's status names; a fifth pod stays Pending while every slot is taken and
// runs once a pod is deleted; deleting the pods frees their reservations.
func TestRealNodeDRA(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	n := startNodeIn(t, ctx, "dra", "dra-fs")
	n.pool = ipwardenv1.IPPoolSpec{
		Scaling:       ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 50, MaxPerNode: 4},
		ReuseCooldown: metav1.Duration{Duration: 0},
	}
	n.overlayComponents = []string{"deploy/kustomize/dra"}
	n.deployIpwarden(ctx)
	if _, err := n.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	t.Run("the node's ResourceSlice has a slot per address it can give", func(t *testing.T) {
		n.t = t
		n.waitSlots(ctx, 4)
	})

	tmpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "address"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "addr", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "ipwarden-address",
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
					Expression: fmt.Sprintf(`device.attributes[%q].ippool == %q`, draDriver, poolName)}}},
			}}},
		}}},
	}
	if _, err := n.kube.ResourceV1().ResourceClaimTemplates(testNamespace).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	d := sleeperDeployment("dra", 1, map[string]string{"app": "dra"})
	d.Spec.Strategy = appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType}
	d.Spec.Template.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "addr", ResourceClaimTemplateName: ptr.To("address")}}
	d.Spec.Template.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "addr"}}
	if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	t.Run("a pod from a ResourceClaimTemplate runs with its claim's address", func(t *testing.T) {
		n.t = t
		start := time.Now()
		pods := n.waitDRAPods(ctx, 1)
		n.logf("DRA: pod %s running with %s in %s", pods[0].Name, pods[0].Status.PodIP, time.Since(start).Round(time.Millisecond))
	})

	var four []corev1.Pod
	t.Run("four pods take the four slots", func(t *testing.T) {
		n.t = t
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=4")
		four = n.waitDRAPods(ctx, 4)
		n.waitSlots(ctx, 4) // the slice is not rewritten for pods with claims
	})

	t.Run("a fifth pod stays Pending until a pod is deleted", func(t *testing.T) {
		n.t = t
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=5")
		var pending corev1.Pod
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			list, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=dra"})
			if err != nil {
				return err
			}
			for _, p := range list.Items {
				for _, c := range p.Status.Conditions {
					if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
						pending = p
						return nil
					}
				}
			}
			return fmt.Errorf("no unschedulable pod yet")
		})
		msg := ""
		for _, c := range pending.Status.Conditions {
			if c.Type == corev1.PodScheduled {
				msg = c.Message
			}
		}
		claim := ""
		if len(pending.Status.ResourceClaimStatuses) == 1 && pending.Status.ResourceClaimStatuses[0].ResourceClaimName != nil {
			claim = *pending.Status.ResourceClaimStatuses[0].ResourceClaimName
		}
		n.logf("DRA: %s is Pending: %q (its claim: %s)", pending.Name, msg, claim)
		if !strings.Contains(msg, "claim") {
			t.Errorf("the scheduling message %q does not name the claims as the reason", msg)
		}
		events := n.kubectl("get", "events", "-n", testNamespace, "--field-selector", "involvedObject.name="+pending.Name, "-o", "custom-columns=REASON:.reason,MESSAGE:.message", "--no-headers")
		n.logf("DRA: events of %s:\n%s", pending.Name, events)
		time.Sleep(5 * time.Second) // still Pending a while later: nothing gives it an address
		if p, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, pending.Name, metav1.GetOptions{}); err != nil || p.Spec.NodeName != "" {
			t.Fatalf("the fifth pod was scheduled (%v) while every slot was taken", err)
		}

		victim := four[0]
		n.logf("DRA: deleting %s (%s)", victim.Name, victim.Status.PodIP)
		n.kubectl("delete", "pod", "-n", testNamespace, victim.Name, "--wait=true")
		// The Deployment keeps 5 replicas: the freed slot goes to the pending pod or to the
		// victim's replacement, and one stays Pending.
		pods := n.waitDRAPods(ctx, 4)
		for _, p := range pods {
			if p.Name == victim.Name {
				t.Fatalf("%s still runs", victim.Name)
			}
		}
		n.logf("DRA: a Pending pod was scheduled and runs once %s was deleted", victim.Name)
	})

	t.Run("deleting the pods frees the slots and the addresses", func(t *testing.T) {
		n.t = t
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=0")
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			claims, err := n.kube.ResourceV1().ResourceClaims(testNamespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			if len(claims.Items) > 0 {
				return fmt.Errorf("%d claims left", len(claims.Items))
			}
			res, err := agentReservations()
			if err != nil {
				return err
			}
			if len(res) > 0 {
				return fmt.Errorf("the agent still holds reservations %v", res)
			}
			return nil
		})
		n.waitSlots(ctx, 4)
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=4")
		n.waitDRAPods(ctx, 4)
	})

	// The kubelet prepares a claim once per node: for a second pod of a claim already prepared it
	// does not call the driver again (so the driver's refusal of a claim reserved for two pods
	// never runs), and the second pod's sandbox is created. Its ADD finds the claim's reservation
	// made for the first pod and is refused, naming the claim and that pod (ipam.reservedForAnother):
	// the second pod does not run, and the first keeps the claim's address.
	t.Run("a named claim shared by two pods fails the second, visibly", func(t *testing.T) {
		n.t = t
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=2")
		n.waitDRAPods(ctx, 2)
		shared := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "shared"}, Spec: tmpl.Spec.Spec}
		if _, err := n.kube.ResourceV1().ResourceClaims(testNamespace).Create(ctx, shared, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		mk := func(name string) string {
			spec := sleeperPodSpec()
			spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "addr", ResourceClaimName: ptr.To("shared")}}
			spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "addr"}}
			p, err := n.kube.CoreV1().Pods(testNamespace).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name}, Spec: spec}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return string(p.UID)
		}
		mk("shared-a")
		var first string
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			p, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, "shared-a", metav1.GetOptions{})
			if err != nil || p.Status.Phase != corev1.PodRunning {
				return fmt.Errorf("shared-a not running yet (%v)", err)
			}
			first = p.Status.PodIP
			return nil
		})
		c, err := n.kube.ResourceV1().ResourceClaims(testNamespace).Get(ctx, "shared", metav1.GetOptions{})
		if err != nil || len(c.Status.Devices) != 1 || c.Status.Devices[0].NetworkData == nil ||
			strings.Join(c.Status.Devices[0].NetworkData.IPs, ",") != first+"/"+fmt.Sprint(poolPrefix.Bits()) {
			t.Fatalf("claim shared: %+v (%v), shared-a runs with %s", c.Status.Devices, err, first)
		}
		uidB := mk("shared-b")
		want := "ResourceClaim " + testNamespace + "/shared's address"
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			n.scanNoDuplicates()
			b, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, "shared-b", metav1.GetOptions{})
			if err != nil {
				return err
			}
			if b.Status.PodIP != "" {
				t.Fatalf("shared-b runs with %s; its claim's address is shared-a's %s", b.Status.PodIP, first)
			}
			evs, err := n.kube.CoreV1().Events(testNamespace).List(ctx, metav1.ListOptions{
				FieldSelector: "involvedObject.uid=" + uidB + ",reason=FailedCreatePodSandBox"})
			if err != nil {
				return err
			}
			for _, e := range evs.Items {
				if strings.Contains(e.Message, want) && strings.Contains(e.Message, "shared-a") {
					return nil
				}
			}
			return fmt.Errorf("no sandbox failure of shared-b naming %q and shared-a yet (%d failures)", want, len(evs.Items))
		})
		a, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, "shared-a", metav1.GetOptions{})
		if err != nil || a.Status.Phase != corev1.PodRunning || a.Status.PodIP != first {
			t.Fatalf("shared-a: %v %s %s, want it running with %s", err, a.Status.Phase, a.Status.PodIP, first)
		}
		n.logf("DRA: the second pod of a named claim is refused, naming the claim and the first pod")
		n.kubectl("delete", "pod", "-n", testNamespace, "shared-a", "shared-b", "--wait=true")
		n.kubectl("delete", "resourceclaim", "-n", testNamespace, "shared", "--wait=true")
	})

	t.Run("without resourceclaims/status RBAC Prepare fails visibly and the address comes back", func(t *testing.T) {
		n.t = t
		n.onePodWithoutStatusRBAC(ctx)
		var victim string
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			ev := n.kubectl("get", "events", "-n", testNamespace, "--field-selector", "reason=FailedPrepareDynamicResources", "-o", "custom-columns=POD:.involvedObject.name,MESSAGE:.message", "--no-headers")
			for _, line := range strings.Split(strings.TrimSpace(ev), "\n") {
				if strings.Contains(line, "write the address into the status") {
					victim = strings.Fields(line)[0]
					n.logf("DRA: without the RBAC: %s", line)
					return nil
				}
			}
			return fmt.Errorf("no FailedPrepareDynamicResources naming the status write yet")
		})
		if res, err := agentReservations(); err != nil || len(res) != 1 {
			t.Fatalf("reservations %v (%v), want the failed Prepare's one kept for the retry", res, err)
		}
		start := time.Now()
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=0")
		n.waitOrDump(ctx, 3*time.Minute, func() error {
			if res, err := agentReservations(); err != nil || len(res) > 0 {
				return fmt.Errorf("reservations %v (%v) after %s was deleted", res, err, victim)
			}
			return nil
		})
		n.logf("DRA: the reservation of %s was released %s after it was deleted", victim, time.Since(start).Round(time.Second))
		n.kubectl("apply", "-k", filepath.Join(n.dir, "overlay"))
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=2")
		n.waitDRAPods(ctx, 2)
	})

	// kill -9 of the agent between Prepare's journal write and its status write. The status
	// write is held failing (the status RBAC removed, as above) so the kill lands in that window
	// for sure; the restarted agent has the reservation from its journal, and once the RBAC is
	// back the kubelet's retry of Prepare gets the same address and writes one status entry.
	t.Run("kill -9 between the journal write and the status write: the retry gets the same address and one status entry", func(t *testing.T) {
		n.t = t
		n.onePodWithoutStatusRBAC(ctx)
		var reserved, victim string
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			res, err := agentReservations()
			if err != nil || len(res) != 1 {
				return fmt.Errorf("reservations %v (%v), want the failing Prepare's one", res, err)
			}
			for a, pod := range res {
				reserved, victim = a, pod
			}
			return nil
		})
		pid, err := agentPID()
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		n.logf("DRA: agent (pid %d) killed with %s reserved for %s and its claim's status not written", pid, reserved, victim)
		n.waitOrDump(ctx, 3*time.Minute, func() error {
			if p, err := agentPID(); err != nil || p == pid {
				return fmt.Errorf("no new agent process yet (%v)", err)
			}
			res, err := agentReservations()
			if err != nil {
				return err
			}
			if res[reserved] != victim || len(res) != 1 {
				return fmt.Errorf("reservations after the restart %v, want %s for %s", res, reserved, victim)
			}
			return nil
		})
		n.kubectl("apply", "-k", filepath.Join(n.dir, "overlay"))
		pods := n.waitDRAPods(ctx, 1) // one status entry, networkData equal to the pod's IPs
		if pods[0].Name != victim || pods[0].Status.PodIP != reserved {
			t.Fatalf("pod %s runs with %s; want %s with %s, reserved before the kill", pods[0].Name, pods[0].Status.PodIP, victim, reserved)
		}
		n.logf("DRA: after the kill the kubelet's retry gave %s the address reserved before it, %s, with one status entry", victim, reserved)
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=2")
		n.waitDRAPods(ctx, 2)
	})

	// The agent is down while a pod and its claim are force-deleted: no Unprepare reaches it.
	// Once it is back, its level reconcile finds the claim gone and releases the reservation.
	t.Run("agent down while a pod and its claim are force-deleted: the address comes back", func(t *testing.T) {
		n.t = t
		pods := n.waitDRAPods(ctx, 2)
		victim := pods[0]
		claim := *victim.Status.ResourceClaimStatuses[0].ResourceClaimName
		n.agentOff(ctx)
		n.logf("DRA: the agent is down; force-deleting %s (%s) and its claim %s", victim.Name, victim.Status.PodIP, claim)
		n.kubectl("delete", "pod", "-n", testNamespace, victim.Name, "--force", "--grace-period=0")
		n.waitOrDump(ctx, 2*time.Minute, func() error {
			if _, err := n.kube.ResourceV1().ResourceClaims(testNamespace).Get(ctx, claim, metav1.GetOptions{}); err == nil {
				return fmt.Errorf("claim %s still exists", claim)
			}
			return nil
		})
		start := time.Now()
		n.agentOn()
		n.waitOrDump(ctx, 3*time.Minute, func() error {
			res, err := agentReservations()
			if err != nil {
				return err
			}
			if who, ok := res[victim.Status.PodIP]; ok && who == victim.Name {
				return fmt.Errorf("the agent still holds %s for %s", victim.Status.PodIP, victim.Name)
			}
			return nil
		})
		n.logf("DRA: %s's reservation of %s released %s after the agent came back", victim.Name, victim.Status.PodIP, time.Since(start).Round(time.Second))
		n.waitDRAPods(ctx, 2) // the replacement runs with its own claim's address
	})

	// The journal lost while pods with claims run: the kubelet does not prepare a prepared claim
	// again, so only the claims' status entries (written after each reservation was journaled)
	// name the reserved addresses. The restarted agent re-creates the reservations from them
	// before it serves (docs/design.md, "After a lost journal"); a new pod gets neither address.
	t.Run("the journal lost while pods with claims run: the reservations come back from the claims' status", func(t *testing.T) {
		n.t = t
		pods := n.waitDRAPods(ctx, 2)
		before, err := agentReservations()
		if err != nil || len(before) != 2 {
			t.Fatalf("reservations %v (%v), want the two pods'", before, err)
		}
		n.agentOff(ctx)
		journal := "/var/lib/ipwarden/journal.db"
		if err := os.Remove(journal); err != nil {
			t.Fatalf("remove the stopped agent's journal: %v", err)
		}
		n.logf("DRA: agent stopped and %s removed, reservations were %v", journal, before)
		start := time.Now()
		n.agentOn()
		n.waitOrDump(ctx, 3*time.Minute, func() error {
			n.scanNoDuplicates()
			res, err := agentReservations()
			if err != nil {
				return err
			}
			if !maps.Equal(res, before) {
				return fmt.Errorf("reservations after the lost journal %v, want %v", res, before)
			}
			return nil
		})
		n.logf("DRA: both reservations re-created from their claims' status %s after the agent started", time.Since(start).Round(time.Second))
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=3")
		after := n.waitDRAPods(ctx, 3) // three distinct addresses, each its claim's
		for _, p := range after {
			if slices.ContainsFunc(pods, func(o corev1.Pod) bool { return o.Name == p.Name }) {
				continue
			}
			if who, ok := before[p.Status.PodIP]; ok {
				t.Fatalf("new pod %s got %s, reserved for %s before the journal was lost", p.Name, p.Status.PodIP, who)
			}
		}
		n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=2")
		n.waitDRAPods(ctx, 2)
	})
}

// agentOff stops the agent on the node (the DaemonSet's pods select a label the node lacks) and
// waits until no agent pod is left.
func (n *realNode) agentOff(ctx context.Context) {
	n.kubectl("patch", "daemonset", "-n", "ipwarden-system", "ipwarden-agent", "--type=merge", "-p",
		`{"spec":{"template":{"spec":{"nodeSelector":{"ipwarden.test/agent-off":"true"}}}}}`)
	n.waitOrDump(ctx, 2*time.Minute, func() error {
		if uid := n.agentPodUID(ctx); uid != "" {
			return fmt.Errorf("the agent pod %s still runs", uid)
		}
		list, err := n.kube.CoreV1().Pods("ipwarden-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
		if err != nil || len(list.Items) > 0 {
			return fmt.Errorf("agent pods left: %d (%v)", len(list.Items), err)
		}
		return nil
	})
}

// agentOn starts the agent again (agentOff undone) and waits for its rollout.
func (n *realNode) agentOn() {
	n.kubectl("patch", "daemonset", "-n", "ipwarden-system", "ipwarden-agent", "--type=json", "-p",
		`[{"op":"remove","path":"/spec/template/spec/nodeSelector"}]`)
	n.kubectl("rollout", "status", "-n", "ipwarden-system", "daemonset/ipwarden-agent", "--timeout=3m")
}

// onePodWithoutStatusRBAC scales the DRA pods down to none (every reservation released), takes
// the agent's resourceclaims/status grant away, and starts one pod: its Prepare reserves in the
// journal and then fails writing the claim's status. `kubectl apply -k` of the overlay gives the
// grant back.
func (n *realNode) onePodWithoutStatusRBAC(ctx context.Context) {
	n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=0")
	n.waitOrDump(ctx, 2*time.Minute, func() error {
		if res, err := agentReservations(); err != nil || len(res) > 0 {
			return fmt.Errorf("reservations %v (%v)", res, err)
		}
		return nil
	})
	n.kubectl("patch", "clusterrole", "ipwarden-agent-dra", "--type=json", "-p", `[{"op":"test","path":"/rules/2/resources/0","value":"resourceclaims/status"},{"op":"remove","path":"/rules/2"}]`)
	n.kubectl("scale", "-n", testNamespace, "deployment/dra", "--replicas=1")
}

// waitSlots waits until the node's pool of driver ipam.ipwarden.io has want devices, each
// with the pool's attributes.
func (n *realNode) waitSlots(ctx context.Context, want int) {
	n.waitOrDump(ctx, 2*time.Minute, func() error {
		list, err := n.kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		var devices []resourceapi.Device
		for _, s := range list.Items {
			if s.Spec.Driver == draDriver && s.Spec.Pool.Name == nodeName {
				if s.Spec.NodeName == nil || *s.Spec.NodeName != nodeName {
					n.t.Fatalf("slice %s is not the node's: nodeName %v", s.Name, s.Spec.NodeName)
				}
				devices = append(devices, s.Spec.Devices...)
			}
		}
		if len(devices) != want {
			return fmt.Errorf("%d slot devices, want %d", len(devices), want)
		}
		for _, d := range devices {
			a := d.Attributes
			if v := a["ippool"].StringValue; v == nil || *v != poolName {
				n.t.Fatalf("device %s: ippool %v", d.Name, v)
			}
			if v := a["family"].StringValue; v == nil || *v != "ipv4" {
				n.t.Fatalf("device %s: family %v", d.Name, v)
			}
			if v := a["network"].StringValue; v == nil || *v != "" {
				n.t.Fatalf("device %s: network %v", d.Name, v)
			}
		}
		return nil
	})
	n.logf("DRA: the node's ResourceSlice has %d slots", want)
}

// waitDRAPods waits until want pods of the DRA Deployment run, each with the address its claim's
// status names (networkData.ips, with the pool's prefix, interface eth0, Ready), no two alike.
func (n *realNode) waitDRAPods(ctx context.Context, want int) []corev1.Pod {
	var pods []corev1.Pod
	n.waitOrDump(ctx, 3*time.Minute, func() error {
		n.scanNoDuplicates()
		list, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=dra"})
		if err != nil {
			return err
		}
		pods = pods[:0]
		seen := map[string]string{}
		for _, p := range list.Items {
			if p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
				continue
			}
			if len(p.Status.ResourceClaimStatuses) != 1 || p.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
				return fmt.Errorf("pod %s: claim statuses %+v", p.Name, p.Status.ResourceClaimStatuses)
			}
			claim, err := n.kube.ResourceV1().ResourceClaims(testNamespace).Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			var podIPs []string
			for _, ip := range p.Status.PodIPs {
				podIPs = append(podIPs, ip.IP+"/"+fmt.Sprint(poolPrefix.Bits()))
			}
			if len(claim.Status.Devices) != 1 {
				return fmt.Errorf("claim %s: status.devices %+v", claim.Name, claim.Status.Devices)
			}
			e := claim.Status.Devices[0]
			alloc := claim.Status.Allocation.Devices.Results[0]
			if e.Driver != draDriver || e.Pool != alloc.Pool || e.Device != alloc.Device || e.NetworkData == nil ||
				e.NetworkData.InterfaceName != "eth0" || len(e.Conditions) != 1 || e.Conditions[0].Type != "Ready" || e.Conditions[0].Status != metav1.ConditionTrue {
				n.t.Fatalf("claim %s: status entry %+v, allocation %+v", claim.Name, e, alloc)
			}
			if strings.Join(e.NetworkData.IPs, ",") != strings.Join(podIPs, ",") {
				n.t.Fatalf("claim %s says %v, pod %s runs with %v", claim.Name, e.NetworkData.IPs, p.Name, podIPs)
			}
			if other, dup := seen[p.Status.PodIP]; dup {
				n.t.Fatalf("pods %s and %s both have %s", other, p.Name, p.Status.PodIP)
			}
			seen[p.Status.PodIP] = p.Name
			pods = append(pods, p)
		}
		if len(pods) != want {
			return fmt.Errorf("%d DRA pods running with their claim's address, want %d", len(pods), want)
		}
		res, err := agentReservations()
		if err != nil {
			return err
		}
		for _, p := range pods {
			if res[p.Status.PodIP] != p.Name {
				return fmt.Errorf("the agent's reservations %v lack %s of %s", res, p.Status.PodIP, p.Name)
			}
		}
		return nil
	})
	sort.Slice(pods, func(i, j int) bool { return pods[i].Name < pods[j].Name })
	var ips []string
	for _, p := range pods {
		ips = append(ips, p.Name+"="+p.Status.PodIP)
	}
	n.logf("DRA: %d pods running with their claims' addresses: %s", len(pods), strings.Join(ips, " "))
	return pods
}

// agentReservations asks the agent for its DRA reservations: address -> pod name.
func agentReservations() (map[string]string, error) {
	return agentAddresses(func(a cniproto.Attachment) bool { return strings.HasPrefix(a.ContainerID, "dra:") })
}

// agentPID is the pid of the ipwarden agent process the kubelet runs on this machine.
func agentPID() (int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
		if len(args) > 1 && filepath.Base(args[0]) == "ipwarden" && args[1] == "agent" && !(len(args) > 2 && args[2] == "list") {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no ipwarden agent process")
}
