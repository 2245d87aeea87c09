package integration

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/check"
)

// A node's disk restored from an older snapshot: the journal rewinds while the API objects are
// current (the node-side twin of an etcd restore). After the snapshot, 8 of the node's 12 pods
// end, 3 new pods take reused addresses (cooldown 0) and report them in status.podIPs, and the
// node gives addresses back. Then the old journal comes back and the agent restarts. The pods'
// reported addresses are the truth, not the journal's rewind: every running pod's address is
// attached to that pod (not to the ended pod the old journal names) and held by the node, the
// leak collector frees none of them, new ADDs never get one, and `ipwarden check` is clean.
func TestDiskRewindKeepsRunningPodsAddresses(t *testing.T) {
	ctx := context.Background()
	n := startTwoNodes(t, "diskrw", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.127.0.0/24"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64, ReleaseDelay: &metav1.Duration{Duration: 0}},
		ReuseCooldown: cooldown(0),
	}, "--gc-grace=1s")
	a, confA, confB := n.a, n.confA, n.confB

	type runningPod struct {
		pod *corev1.Pod
		cid string
		ip  string
	}
	start := func(name, cid string) runningPod {
		t.Helper()
		p := createBoundPod(t, name, "diskrw-a")
		r, e := cni(t, "ADD", confA, cid, podArgs("default", p.Name, string(p.UID)))
		if e != nil {
			t.Fatalf("ADD %s: %v", name, e)
		}
		ip := addrOf(t, r.IPs[0].Address).String()
		setPodIP(t, p, ip)
		return runningPod{pod: p, cid: cid, ip: ip}
	}
	var pods []runningPod
	for i := range 12 {
		pods = append(pods, start(fmt.Sprintf("diskrw-old-%d", i), fmt.Sprintf("old%d", i)))
	}

	// The snapshot: the node's disk as it is now (the agent is stopped for a consistent copy).
	a.kill()
	<-a.done
	snapshot := t.TempDir()
	if out, err := exec.Command("cp", "-a", a.stateDir+"/.", snapshot).CombinedOutput(); err != nil {
		t.Fatalf("snapshot the state directory: %v %s", err, out)
	}
	a.start(t)
	a.waitServing(t)

	// After the snapshot: 8 pods end (DEL, then the Pod is deleted), 3 new pods take the
	// addresses they left (cooldown 0), and the node gives its spares back.
	for _, p := range pods[:8] {
		if _, e := cni(t, "DEL", confA, p.cid, podArgs("default", p.pod.Name, string(p.pod.UID))); e != nil {
			t.Fatal(e)
		}
		if err := k8s.Delete(ctx, p.pod, client.GracePeriodSeconds(0)); err != nil {
			t.Fatal(err)
		}
	}
	ended := map[string]bool{}
	for _, p := range pods[:8] {
		ended[p.ip] = true
	}
	running := pods[8:]
	for i := range 3 {
		p := start(fmt.Sprintf("diskrw-new-%d", i), fmt.Sprintf("new%d", i))
		running = append(running, p)
	}
	reused := 0
	for _, p := range running[4:] {
		if ended[p.ip] {
			reused++
		}
	}
	if reused == 0 {
		t.Fatalf("no new pod reused an ended pod's address (new pods %v): the test would prove nothing", running[4:])
	}
	inUse := addr.Set{}
	for _, p := range running {
		inUse = inUse.Union(addr.SetOfAddrs(netip.MustParseAddr(p.ip)))
	}
	eventually(t, 30*time.Second, "node a to give its spares back", func() error {
		if h := held(t, "diskrw-a", "diskrw"); size(h) > 8 {
			return fmt.Errorf("node a holds %d (%v), its pods use %d", size(h), h, size(inUse))
		}
		return nil
	})
	// Node b grows into what node a gave back.
	for i := range 20 {
		mustAddB := func() {
			p := createBoundPod(t, fmt.Sprintf("diskrw-b-%d", i), "diskrw-b")
			if _, e := cni(t, "ADD", confB, fmt.Sprintf("b%d", i), podArgs("default", p.Name, string(p.UID))); e != nil {
				t.Fatalf("ADD on node b: %v", e)
			}
		}
		mustAddB()
	}

	// The disk is restored from the snapshot and the agent restarts on it.
	a.kill()
	<-a.done
	if err := os.RemoveAll(a.stateDir); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", snapshot+"/.", a.stateDir).CombinedOutput(); err != nil {
		t.Fatalf("restore the state directory: %v %s", err, out)
	}
	a.start(t)
	a.waitServing(t)

	// Every running pod's address is attached to that pod, and held by node a.
	eventually(t, 30*time.Second, "node a's attachments to account for every running pod's address", func() error {
		resp, err := a.list(t)
		if err != nil {
			return err
		}
		owner := map[string]string{}
		for _, att := range resp.Attachments {
			for _, ip := range att.IPs {
				owner[addrOf(t, ip.Address).String()] = att.Pod.UID
			}
		}
		for _, p := range running {
			if owner[p.ip] != string(p.pod.UID) {
				return fmt.Errorf("address %s of pod %s is attached to %q", p.ip, p.pod.Name, owner[p.ip])
			}
		}
		if h := held(t, "diskrw-a", "diskrw"); !h.ContainsSet(inUse) {
			return fmt.Errorf("node a holds %v, its pods use %v", h, inUse)
		}
		return nil
	})
	// The leak collector runs (grace 1s; the ended pods' sandboxes are gone) and new pods
	// arrive: none gets an address a running pod uses, on either node.
	for i := range 6 {
		p := createBoundPod(t, fmt.Sprintf("diskrw-late-%d", i), "diskrw-a")
		r, e := cni(t, "ADD", confA, fmt.Sprintf("late%d", i), podArgs("default", p.Name, string(p.UID)))
		if e != nil {
			t.Fatalf("ADD after the restore: %v", e)
		}
		if got := addrOf(t, r.IPs[0].Address); inUse.Contains(got) {
			t.Fatalf("a new pod got %s, which a running pod uses", got)
		}
	}
	if hb := held(t, "diskrw-b", "diskrw"); hb.Overlaps(inUse) {
		t.Fatalf("node b holds %v, which node a's pods use", hb.Intersect(inUse))
	}
	eventually(t, 30*time.Second, "ipwarden check to be clean", func() error {
		r, code, stderr := runCheck(t, "--agent", "diskrw-a="+a.socket, "--agent", "diskrw-b="+n.b.socket)
		var kinds []string
		for _, f := range r.Findings {
			switch f.Kind {
			case check.HeldTwice, check.AttachedTwice, check.PodAddressNotHeld, check.PodAddressNotAttached, check.ClaimConflict:
				kinds = append(kinds, f.Kind+" "+f.Addresses+" "+f.Pod+": "+f.Detail)
			}
		}
		if len(kinds) > 0 {
			return fmt.Errorf("check (exit %d) reports %v %s", code, kinds, stderr)
		}
		return nil
	})
}
