package node

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// inflightIPAM is the previous IPAM of testTakeoverInFlight.
type inflightIPAM struct {
	typ     string // its CNI type, the plugin's name in /opt/cni/bin
	dir, fs string // the node's scratch directories (startNodeIn)
	// install puts the plugin on the node (nil: it is there).
	install func(ctx context.Context, n *realNode)
	// ipam is its ipam object under CNI type typ, handing out 10.244.0.10-13 of 10.244.0.0/24.
	ipam func(n *realNode, typ string) string
	// reserves reports whether it holds a reservation of ip; reservations compares what it
	// holds with want (takeover_test.go).
	reserves     func(ctx context.Context, n *realNode, ip netip.Addr) (bool, error)
	reservations func(ctx context.Context, n *realNode, want []pod) error
	// agentPatch is more of the test overlay's patches ("" for none).
	agentPatch func(n *realNode) string
}

// TestRealNodeTakeoverWithAnADDInFlight takes a node over from host-local while a pod's ADD
// through host-local is in flight (issue 31): host-local has reserved the pod's address, but the
// answer has not reached the runtime yet (a wrapper, host-local-slow, holds it, as a slow bridge
// or a busy runtime would) and the pod has no status.podIPs. The node switches to ipwarden with
// host-local as "previous", and new pods start through it, the runtime calling the plugin: none
// gets the in-flight pod's address, although the node holds it and it is the lowest free one
// (without the agent's reading of host-local's files, the first new pod got it). Then the
// in-flight ADD answers, the pod runs with its address and is adopted; once it is deleted (its
// DEL through ipwarden's plugin reaches host-local, which removes the file), a new pod gets the
// address. Every poll scans every pod network namespace for an address on two.
func TestRealNodeTakeoverWithAnADDInFlight(t *testing.T) {
	hostLocal := func(n *realNode) string { return filepath.Join(n.dir, "host-local") }
	testTakeoverInFlight(t, inflightIPAM{
		typ: "host-local", dir: "takeover-inflight", fs: "takeover-inflight-fs",
		ipam: func(n *realNode, typ string) string {
			return fmt.Sprintf(`{"type": %q, "ranges": [[{"subnet": "10.244.0.0/24", "rangeStart": "10.244.0.10", "rangeEnd": "10.244.0.13", "gateway": "10.244.0.1"}]], "dataDir": %q}`,
				typ, hostLocal(n))
		},
		reserves: func(ctx context.Context, n *realNode, ip netip.Addr) (bool, error) {
			_, err := os.Stat(filepath.Join(hostLocal(n), takeoverNetwork, ip.String()))
			if errors.Is(err, os.ErrNotExist) {
				return false, nil
			}
			return err == nil, err
		},
		reservations: func(ctx context.Context, n *realNode, want []pod) error {
			return hostLocalReservations(hostLocal(n), want)
		},
		agentPatch: func(n *realNode) string { return hostLocalMountPatch(hostLocal(n)) },
	})
}

// TestRealNodeTakeoverFromWhereaboutsWithAnADDInFlight is TestRealNodeTakeoverWithAnADDInFlight
// from Whereabouts (localcluster.WhereaboutsVersion): the agent, with the RBAC of deploy/, lists
// Whereabouts' IPPools at every ADD.
func TestRealNodeTakeoverFromWhereaboutsWithAnADDInFlight(t *testing.T) {
	testTakeoverInFlight(t, inflightIPAM{
		typ: "whereabouts", dir: "takeover-wb-inflight", fs: "takeover-wb-inflight-fs",
		install: func(ctx context.Context, n *realNode) { n.installWhereaboutsPlugin(ctx, "debug") },
		ipam: func(n *realNode, typ string) string {
			return fmt.Sprintf(`{"type": %q, "range": "10.244.0.0/24", "range_start": "10.244.0.10", "range_end": "10.244.0.13", "gateway": "10.244.0.1"}`, typ)
		},
		reserves:     whereaboutsReserves,
		reservations: whereaboutsReservations,
	})
}

// whereaboutsReserves reports whether an allocation of Whereabouts' IPPools holds ip.
func whereaboutsReserves(ctx context.Context, n *realNode, ip netip.Addr) (bool, error) {
	dyn, err := dynamic.NewForConfig(n.cp.Config)
	if err != nil {
		return false, err
	}
	pools, err := dyn.Resource(schema.GroupVersionResource{Group: "whereabouts.cni.cncf.io", Version: "v1alpha1", Resource: "ippools"}).
		List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, err
	}
	for _, p := range pools.Items {
		rs, err := localcluster.WhereaboutsPoolReservations(p.Object)
		if err != nil {
			return false, err
		}
		for _, r := range rs {
			if r.IP == ip && !strings.HasPrefix(r.ContainerID, previous.WhereaboutsIDPrefix) {
				return true, nil
			}
		}
	}
	return false, nil
}

func testTakeoverInFlight(t *testing.T, prev inflightIPAM) {
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	began := time.Now()
	n := startNodeIn(t, ctx, prev.dir, prev.fs)
	if prev.install != nil {
		prev.install(ctx, n)
	}
	slow := prev.typ + "-slow"
	ipamOf := func(typ string) string { return prev.ipam(n, typ) }
	conflist := func(ipam string) string {
		return fmt.Sprintf(`{"cniVersion": "1.0.0", "name": %q, "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "ipam": %s}, {"type": "portmap", "capabilities": {"portMappings": true}}]}`,
			takeoverNetwork, ipam)
	}
	addr := netip.MustParseAddr
	inflightIP := addr("10.244.0.13")

	// <type>-slow: the plugin, whose ADD answer waits, after it has reserved, until the test opens
	// the gate (a FIFO); it hands the plugin its own type (Whereabouts checks it).
	reserved := filepath.Join(n.dir, "inflight-reserved")
	gate, err := localcluster.NewGate(filepath.Join(n.dir, "inflight-gate"))
	if err != nil {
		t.Fatal(err)
	}
	openGate := gate.Open
	t.Cleanup(func() { _ = openGate() })
	wrapper := fmt.Sprintf(`#!/bin/sh
out=$(/bin/sed 's/"%[3]s-slow"/"%[3]s"/' | /opt/cni/bin/%[3]s)
rc=$?
if [ "$CNI_COMMAND" = ADD ]; then
	: > %[1]q
	/bin/cat %[2]q > /dev/null
fi
printf '%%s\n' "$out"
exit $rc
`, reserved, gate, prev.typ)
	if err := os.WriteFile("/opt/cni/bin/"+slow, []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}

	// 1. The node before ipwarden: bridge with the previous IPAM, 10.244.0.10-13. Three pods run.
	oldConf := filepath.Join("/etc/cni/net.d", takeoverConflist)
	if err := os.WriteFile(oldConf, []byte(conflist(ipamOf(prev.typ))), 0o644); err != nil {
		t.Fatal(err)
	}
	n.waitRuntimeIPAM(ctx, prev.typ)
	n.waitNodeReady(ctx)
	old := n.startOldPods(ctx, takeoverOld)
	for _, p := range old {
		if !takeoverOldRange[p.ip] {
			t.Fatalf("old pod %s has %s, want one of 10.244.0.10-12 (%s hands out the lowest first)", p.name, p.ip, prev.typ)
		}
	}

	// 2. ipwarden installed (not yet used: the runtime reads the first config by name), with the
	// previous IPAM as "previous". The pool is 10.244.0.10-15.
	n.overlayPatches = cniConfigPatch(conflist(fmt.Sprintf(`{"type": "ipwarden", "socket": %q, "previous": %s}`, cniproto.DefaultSocket, ipamOf(prev.typ)))) + `
- target: {kind: DaemonSet, name: ipwarden-agent, namespace: ipwarden-system}
  patch: |
    - {op: add, path: /spec/template/spec/containers/0/args/-, value: --gc-grace=10s}
`
	if prev.agentPatch != nil {
		n.overlayPatches += prev.agentPatch(n)
	}
	n.pool = sixAddressPool()
	n.deployIpwarden(ctx)
	n.checkOldPods(ctx, old)
	n.waitAdopted(ctx, old)

	// 3. A pod's ADD goes through <type>-slow (the node's config just before the switch): the
	// previous IPAM reserves 10.244.0.13, and the answer waits.
	if err := os.WriteFile(oldConf, []byte(conflist(ipamOf(slow))), 0o644); err != nil {
		t.Fatal(err)
	}
	n.waitRuntimeIPAM(ctx, slow)
	inflight := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "inflight", Labels: map[string]string{"app": "inflight"}},
		Spec: corev1.PodSpec{NodeName: nodeName, TerminationGracePeriodSeconds: ptr.To(int64(2)), AutomountServiceAccountToken: ptr.To(false),
			EnableServiceLinks: ptr.To(false),
			Containers:         []corev1.Container{{Name: "sleeper", Image: workloadImage, ImagePullPolicy: corev1.PullNever}}},
	}
	if _, err := n.kube.CoreV1().Pods(testNamespace).Create(ctx, inflight, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func() error {
		_, err := os.Stat(reserved)
		return err
	}); err != nil {
		t.Fatalf("%s never reserved for the in-flight pod: %v", slow, err)
	}
	if ok, err := prev.reserves(ctx, n, inflightIP); !ok || err != nil {
		t.Fatalf("%s reserved no %s for the in-flight pod: %v", prev.typ, inflightIP, err)
	}
	n.logf("takeover: the in-flight pod's ADD has %s reserved by %s; its answer waits", inflightIP, prev.typ)

	// 4. The switch, while that ADD is in flight; two new pods start through ipwarden.
	if err := os.Rename(oldConf, oldConf+".pre-ipwarden"); err != nil {
		t.Fatal(err)
	}
	n.waitRuntimeIPAM(ctx, "ipwarden")
	if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx,
		sleeperDeployment("new", 2, map[string]string{"app": "sleeper", "ipam": "new"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	all := n.waitPods(ctx, takeoverOld+2)
	fresh := newPods(all)
	for _, p := range fresh {
		if p.ip == inflightIP {
			t.Fatalf("new pod %s got %s, the address %s reserved for the in-flight pod", p.name, p.ip, prev.typ)
		}
	}
	n.checkFromIpwarden(ctx, fresh)
	resp, err := agentList()
	if err != nil {
		t.Fatal(err)
	}
	for _, ps := range resp.Pools {
		if ps.Pool == poolName && (ps.PreviousReserved != 1 || ps.Free != 0) {
			t.Fatalf("the agent's view of the pool %+v: want the in-flight address previous-reserved, none free", ps)
		}
	}

	// 5. The in-flight ADD answers: the pod runs with 10.244.0.13, alone on it, and is adopted.
	if err := localcluster.WaitFor(ctx, 30*time.Second, 50*time.Millisecond, openGate); err != nil {
		t.Fatalf("open the in-flight ADD's gate: %v", err)
	}
	n.others = 1
	var inflightPod pod
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		addrs := n.scanNoDuplicates()
		p, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, "inflight", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("the in-flight pod is %s (ip %q)", p.Status.Phase, p.Status.PodIP)
		}
		if p.Status.PodIP != inflightIP.String() {
			t.Fatalf("the in-flight pod got %s, want %s's %s", p.Status.PodIP, prev.typ, inflightIP)
		}
		if ns := addrs[inflightIP]; len(ns) != 1 {
			return fmt.Errorf("%s is on network namespaces %v", inflightIP, ns)
		}
		inflightPod = pod{name: p.Name, uid: string(p.UID), ip: inflightIP, netns: addrs[inflightIP][0]}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	n.waitAdopted(ctx, append(append([]pod(nil), old...), inflightPod))
	n.checkOldPods(ctx, old)

	// 6. The in-flight pod ends: its DEL goes through ipwarden's plugin to the previous IPAM,
	// which releases the address; the next new pod gets it.
	if err := n.kube.CoreV1().Pods(testNamespace).Delete(ctx, "inflight", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		n.scanNoDuplicates()
		if ok, err := prev.reserves(ctx, n, inflightIP); ok || err != nil {
			return fmt.Errorf("%s still reserves %s (%v)", prev.typ, inflightIP, err)
		}
		if _, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, "inflight", metav1.GetOptions{}); err == nil {
			return fmt.Errorf("the in-flight pod still exists")
		}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	n.others = 0
	n.kubectl("scale", "-n", testNamespace, "deployment/new", "--replicas=3")
	all = n.waitPods(ctx, takeoverOld+3)
	got := map[netip.Addr]bool{}
	for _, p := range all {
		got[p.ip] = true
	}
	if !got[inflightIP] {
		t.Fatalf("pods have %s, want %s in use again once %s released it", podIPs(all), inflightIP, prev.typ)
	}
	n.checkFromIpwarden(ctx, newPods(all))
	n.checkPing(ctx, all)
	if err := prev.reservations(ctx, n, old); err != nil {
		t.Fatal(err)
	}
	n.checkClean(ctx)
	n.logf("takeover from %s with an ADD in flight: test body took %s (preparation %s); pods %s",
		prev.typ, time.Since(began).Round(time.Second), prep.Prepared.Round(time.Second), strings.TrimSpace(podIPs(all)))
}
