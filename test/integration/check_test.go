package integration

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
)

// runCheck runs `ipwarden check -o json` against the test API server, with args added.
func runCheck(t *testing.T, args ...string) (check.Report, int, string) {
	t.Helper()
	cmd := exec.Command(ipwardenBinary(t), append([]string{"check", "--kubeconfig", kubeconfigPath, "-o", "json"}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	var r check.Report
	if code != 2 {
		if err := json.Unmarshal(out, &r); err != nil {
			t.Fatalf("check output is not JSON: %v\n%s\n%s", err, out, stderr.String())
		}
	}
	return r, code, stderr.String()
}

func createRunningPod(t *testing.T, name, node, ip string) {
	t.Helper()
	ctx := context.Background()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)) })
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}}
	if err := k8s.Status().Update(ctx, p); err != nil {
		t.Fatal(err)
	}
}

// The check command reports nothing on a consistent cluster, and each class of problem with a
// non-zero exit when the objects disagree. It needs no controller: the test writes statuses.
func TestCheckCommand(t *testing.T) {
	ctx := context.Background()
	createPool(t, "check", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.110.0.0/24"}})
	createNode(t, "check-a", nil)
	createNode(t, "check-b", nil)
	setStatus := func(node string, addrs ...string) {
		a := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: node}}
		if err := k8s.Create(ctx, a); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k8s.Delete(context.Background(), a) })
		a.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "check", Addresses: addrs, Held: 16}}
		if err := k8s.Status().Update(ctx, a); err != nil {
			t.Fatal(err)
		}
	}
	setStatus("check-a", "10.110.0.32/28")
	setStatus("check-b", "10.110.0.16/28")
	createRunningPod(t, "check-pod", "check-a", "10.110.0.35")

	r, code, stderr := runCheck(t)
	if code != 0 || !r.OK() {
		t.Fatalf("consistent cluster: exit %d, findings %+v, stderr %s", code, r.Findings, stderr)
	}
	if r.RunningPods < 1 || r.Held < 32 {
		t.Fatalf("report %+v", r)
	}

	// Now break it three ways.
	setStatus("check-ghost", "10.110.0.40/29")                    // held twice, and no Node
	createRunningPod(t, "check-stray", "check-b", "10.110.0.200") // not held by its node
	r, code, _ = runCheck(t)
	if code != 1 {
		t.Fatalf("exit %d with problems, want 1", code)
	}
	for _, kind := range []string{check.HeldTwice, check.OrphanAllocation, check.PodAddressNotHeld} {
		if r.CountsByKind[kind] < 1 {
			t.Errorf("no %s finding in %+v", kind, r.Findings)
		}
	}

	// An unreachable API server is exit 2 with a clear message.
	cmd := exec.Command(ipwardenBinary(t), "check", "--kubeconfig", "/nonexistent/kubeconfig")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "load kubeconfig /nonexistent/kubeconfig") {
		t.Fatalf("bad kubeconfig: %v\n%s", err, out)
	}
}
