package chaos

// VMs in the chaos run (issue 36; docs/design.md, "VM addresses (IPAMClaim)"): a few IPAMClaims,
// each with one launcher pod at a time that is restarted on any node or live-migrated (a target
// pod with KubeVirt's migration label beside the source, then the source's or the target's DEL)
// while the faults go on. A VM's address never changes (after the etcd restore a change is
// counted, not failed: a binding made after the backup may be lost, docs/design.md, "VM
// addresses"), no ordinary pod ever gets it, and at most two pods, both of that VM, hold it at
// once.

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	ipamclaimsv1alpha1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	claimclient "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1/apis/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// chaosVMs is the number of VMs (IPAMClaims) of a run; podNetworkName is the pod network's CNI
// network name (its configuration's "name"), which each claim's spec.network names.
const (
	chaosVMs       = 3
	podNetworkName = "chaos"
)

// vmName is the claim of VM i; its launcher pods are named vm-<i>-l<seq>.
func vmName(i int) string { return fmt.Sprintf("vm-%d", i) }

// vmOf is the VM a pod name belongs to ("" for an ordinary pod).
func vmOf(pod string) string {
	if !strings.HasPrefix(pod, "vm-") {
		return ""
	}
	v, _, _ := strings.Cut(pod, "-l")
	return v
}

// setupVMs installs the IPAMClaim CRD and creates the run's claims.
func (x *chaos) setupVMs(ctx context.Context) {
	t := x.t
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if err := controlplane.InstallCRDs(ctx, x.cp.Config, filepath.Join(root, "config", "ipamclaim")); err != nil {
		t.Fatal(err)
	}
	cc, err := claimclient.NewForConfig(x.cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	for i := range chaosVMs {
		if _, err := cc.K8sV1alpha1().IPAMClaims("default").Create(ctx, &ipamclaimsv1alpha1.IPAMClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: vmName(i)},
			Spec:       ipamclaimsv1alpha1.IPAMClaimSpec{Network: podNetworkName}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	x.vmAddr = map[string]string{}
	x.vmRuns = map[string]*podRun{}
}

// holdLive records pod's addresses in the ledger: a VM's pod may share an address only with one
// other pod of its VM, an ordinary pod with none.
func (x *chaos) holdLive(name string, keys []string) {
	x.liveMu.Lock()
	defer x.liveMu.Unlock()
	for _, k := range keys {
		holders := x.live[k]
		switch {
		case holders == "":
			x.live[k] = name
			continue
		case vmOf(name) != "" && vmOf(holders) == vmOf(name) && !strings.Contains(holders, ","):
			x.live[k] = holders + "," + name
			continue
		}
		x.inc("live address handed out again")
		x.problem("address %s handed to %s while %s still runs", k, name, holders)
	}
}

// dropLive removes pod from the ledger's holders of keys.
func (x *chaos) dropLive(name string, keys []string) {
	x.liveMu.Lock()
	defer x.liveMu.Unlock()
	for _, k := range keys {
		x.dropLiveLocked(name, k)
	}
}

// dropLiveLocked is dropLive of one key, with liveMu held.
func (x *chaos) dropLiveLocked(name, k string) {
	var rest []string
	for _, h := range strings.Split(x.live[k], ",") {
		if h != name && h != "" {
			rest = append(rest, h)
		}
	}
	if len(rest) == 0 {
		delete(x.live, k)
	} else {
		x.live[k] = strings.Join(rest, ",")
	}
}

// vmLauncher creates a launcher pod of VM vm on a node and runs its ADD as a runtime would
// (retrying while the claim's binding, grant or hand-back land). It returns nil when the
// runtime gives up (the pod is then torn down and deleted).
func (x *chaos) vmLauncher(vm string, target bool) *podRun {
	n := x.pickNode()
	id := x.seq.Add(1)
	name := fmt.Sprintf("%s-l%05d", vm, id)
	podObj := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name,
		Annotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: vm}},
		Spec: corev1.PodSpec{NodeName: n.name, Containers: []corev1.Container{{Name: "c", Image: "chaos"}}}}
	if target {
		podObj.Labels = map[string]string{ipamclaim.LabelMigrationTarget: fmt.Sprintf("job-%d", id)}
	}
	if err := x.createPod(podObj); err != nil {
		x.inc("VM pod creates given up (API down)")
		return nil
	}
	p := localcluster.Pod{Namespace: "default", Name: name, UID: string(podObj.UID), ContainerID: fmt.Sprintf("v%011d", id)}
	pr := &podRun{node: n, pod: p}
	if err := retry(60*time.Second, func() error {
		var err error
		pr.ips, err = n.net.Add(context.Background(), p)
		return err
	}); err != nil {
		x.inc("VM ADDs given up")
		x.delAll(pr, false)
		x.deletePod(name)
		return nil
	}
	x.holdLive(name, pr.keys())
	x.note("VM %s: pod %s on %s got %s (migration target %v)", vm, name, n.name, pr.ips[0], target)
	x.liveMu.Lock()
	if want, ok := x.vmAddr[vm]; !ok {
		x.vmAddr[vm] = pr.ips[0]
	} else if want != pr.ips[0] && x.restored {
		// After the etcd restore a binding made after the backup may be lost, or recorded
		// again from a rewound spec: a known gap (docs/design.md, "VM addresses"), counted.
		x.vmAddr[vm] = pr.ips[0]
		x.inc("VM address changed after the etcd restore")
	} else if want != pr.ips[0] {
		x.inc("VM address changed")
		x.problem("VM %s's pod %s got %s, the VM had %s", vm, name, pr.ips[0], want)
	}
	x.vmRuns[name] = pr
	x.liveMu.Unlock()
	_ = retry(20*time.Second, func() error { return x.setRunning(name, pr.ips) })
	return pr
}

// vmStop tears a launcher down: DEL, then the pod object goes (already done when the etcd
// rewind stopped it).
func (x *chaos) vmStop(pr *podRun) {
	x.liveMu.Lock()
	delete(x.vmRuns, pr.pod.Name)
	x.liveMu.Unlock()
	if pr.gone {
		return
	}
	x.note("VM %s: pod %s on %s stopped", vmOf(pr.pod.Name), pr.pod.Name, pr.node.name)
	x.dropLive(pr.pod.Name, pr.keys())
	if !pr.node.deleted.Load() {
		x.delAll(pr, false)
	}
	x.deletePod(pr.pod.Name)
}

// vmLifecycle runs VM vm until ctx ends: start, then restarts and live migrations (some
// failing: the target goes, the source stays). Its last launcher runs to the end of the run.
func (x *chaos) vmLifecycle(ctx context.Context, vm string) {
	var src *podRun
	for ctx.Err() == nil {
		x.quiet.RLock()
		switch {
		case src == nil || src.node.deleted.Load() || src.gone:
			if src != nil && !src.gone {
				x.liveMu.Lock()
				delete(x.vmRuns, src.pod.Name)
				x.liveMu.Unlock()
				x.dropLive(src.pod.Name, src.keys())
				x.deletePod(src.pod.Name)
			}
			src = x.vmLauncher(vm, false)
			x.inc("VM starts")
		case x.intn(2) == 0: // restart: the launcher goes, a new one starts on any node
			x.vmStop(src)
			src = x.vmLauncher(vm, false)
			x.inc("VM restarts")
		default: // live migration
			tgt := x.vmLauncher(vm, true)
			if tgt == nil {
				x.inc("VM migrations given up")
				break
			}
			time.Sleep(x.between(0, 500*time.Millisecond))
			if x.intn(4) == 0 {
				x.vmStop(tgt) // failed migration: the source keeps running
				x.inc("VM migrations failed")
			} else {
				x.vmStop(src)
				src = tgt
				x.inc("VM migrations")
			}
		}
		x.quiet.RUnlock()
		time.Sleep(x.between(200*time.Millisecond, 2*time.Second))
	}
	if src != nil && !src.gone {
		x.liveMu.Lock()
		delete(x.vmRuns, src.pod.Name)
		if !src.node.deleted.Load() { // under liveMu, as deleteNode clears its node's pods
			x.running[src.pod.Name] = src
		}
		x.liveMu.Unlock()
	}
}
