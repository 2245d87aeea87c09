package node

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ipwarden/ipwarden/internal/localcluster"
)

const (
	// secondNodeName is a second kubelet with its own containerd on the same machine. It runs
	// only the controller's pods (hostNetwork, so they need no pod network): the agent
	// DaemonSet is kept off it (the overlay's affinity on controllerOnlyLabel), as both nodes
	// share this machine's node paths (/run/ipwarden, /var/lib/ipwarden, /etc/cni/net.d).
	secondNodeName = "ipwn-node2"
	secondNodeIP   = "10.250.0.3"
	// secondNodeCgroupSuffix names the second kubelet's cgroup root after the first's.
	secondNodeCgroupSuffix = "-node2"
	// controllerOnlyLabel marks a node the test overlay keeps the agent DaemonSet off.
	controllerOnlyLabel = "ipwarden.test/controller-only"
)

// secondNode is a containerd and a kubelet whose state lives in the suite's scratch directory,
// never in the node paths the first node uses.
type secondNode struct {
	dir        string
	sock       string
	containerd *localcluster.Process
	kubelet    *localcluster.Process
	cri        runtimeapi.RuntimeServiceClient
	conn       *grpc.ClientConn
	cgroupDirs []string
}

// startSecondNode brings up the second node and waits until it is Ready.
func (n *realNode) startSecondNode(ctx context.Context) {
	t := n.t
	s := &secondNode{dir: filepath.Join(n.dir, "node2")}
	n.second = s
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	cniConf := filepath.Join(s.dir, "cni", "net.d")
	for _, d := range []string{cniConf, filepath.Join(s.dir, "kubelet"), filepath.Join(s.dir, "pods-logs")} {
		must(os.MkdirAll(d, 0o755))
	}
	must(run("ip", "addr", "add", secondNodeIP+"/32", "dev", "lo"))
	// A CNI config makes the runtime report its network ready (so the node turns Ready); no
	// pod on this node uses it, as the controller's pods are hostNetwork.
	must(os.WriteFile(filepath.Join(cniConf, "10-node2.conflist"), []byte(`{
  "cniVersion": "1.0.0", "name": "node2",
  "plugins": [{"type": "bridge", "bridge": "cni1", "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.245.0.0/24"}]], "dataDir": "`+filepath.Join(s.dir, "host-local")+`"}}]
}
`), 0o644))
	s.sock = filepath.Join(s.dir, "containerd.sock")
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
`, filepath.Join(s.dir, "containerd-root"), filepath.Join(s.dir, "containerd-state"), s.sock, s.sock+".ttrpc", pauseImage, cniConf)
	cfgPath := filepath.Join(s.dir, "containerd.toml")
	must(os.WriteFile(cfgPath, []byte(cfg), 0o644))
	var err error
	s.containerd, err = localcluster.Start("containerd-node2", "containerd", filepath.Join(s.dir, "containerd.log"), "--config", cfgPath)
	must(err)
	s.conn, err = grpc.NewClient("unix://"+s.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(err)
	s.cri = runtimeapi.NewRuntimeServiceClient(s.conn)
	must(localcluster.WaitFor(ctx, time.Minute, 100*time.Millisecond, func() error {
		if !s.containerd.Running() {
			return fmt.Errorf("containerd of %s exited: %s", secondNodeName, s.containerd.LogTail(2000))
		}
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := s.cri.Version(c, &runtimeapi.VersionRequest{})
		return err
	}))
	for _, img := range prep.Images {
		if out, err := exec.CommandContext(ctx, "ctr", "--address", s.sock, "-n", "k8s.io", "images", "import", img).CombinedOutput(); err != nil {
			t.Fatalf("ctr images import %s: %v\n%s", img, err, out)
		}
	}

	cgroupRoot := "/" + filepath.Base(prep.Scratch) + secondNodeCgroupSuffix
	s.cgroupDirs, err = makeCgroupRoot(cgroupRoot)
	must(err)
	ports, err := localcluster.FreePorts(2)
	must(err)
	kcfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: %s
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%s
podLogsDir: %s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
maxPods: 110
`, ports[0], ports[1], cgroupRoot, s.sock, filepath.Join(s.dir, "pods-logs"))
	kcfgPath := filepath.Join(s.dir, "kubelet.yaml")
	must(os.WriteFile(kcfgPath, []byte(kcfg), 0o644))
	s.kubelet, err = localcluster.Start("kubelet-node2", prep.Node.Kubelet, filepath.Join(s.dir, "kubelet.log"),
		"--config", kcfgPath, "--kubeconfig", n.cp.Kubeconfig, "--hostname-override", secondNodeName,
		"--node-ip", secondNodeIP, "--root-dir", filepath.Join(s.dir, "kubelet"),
		"--cert-dir", filepath.Join(s.dir, "kubelet", "pki"), "--node-labels", controllerOnlyLabel+"=true",
		// As a control-plane node: the workload stays off it, the controller tolerates it.
		"--register-with-taints", "node-role.kubernetes.io/control-plane=:NoSchedule", "--v", "2")
	must(err)
	start := time.Now()
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		return nodeReady(ctx, n, secondNodeName)
	}); err != nil {
		n.dumpState(ctx)
		t.Fatalf("%s: %v\nkubelet log:\n%s", secondNodeName, err, s.kubelet.LogTail(3000))
	}
	n.logf("second node %s Ready in %s", secondNodeName, time.Since(start).Round(time.Millisecond))
}

func nodeReady(ctx context.Context, n *realNode, name string) error {
	node, err := n.kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for _, c := range node.Status.Conditions {
		if c.Type == "Ready" {
			if c.Status == "True" {
				return nil
			}
			return fmt.Errorf("node %s not ready: %s", name, c.Message)
		}
	}
	return fmt.Errorf("node %s has no Ready condition", name)
}

// teardown stops the second node once its pods are gone (the first node's teardown deleted
// them): kubelet, sandboxes, containerd, cgroups.
func (s *secondNode) teardown(ctx context.Context, t *testing.T) {
	if s.kubelet != nil {
		s.kubelet.Stop()
	}
	if s.cri != nil && s.containerd != nil && s.containerd.Running() {
		resp, err := s.cri.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			t.Errorf("teardown %s: list sandboxes: %v", secondNodeName, err)
		} else {
			for _, sb := range resp.Items {
				if sb.State == runtimeapi.PodSandboxState_SANDBOX_READY {
					t.Errorf("teardown %s: sandbox of %s/%s still ready after its pod was deleted", secondNodeName, sb.Metadata.Namespace, sb.Metadata.Name)
					_, _ = s.cri.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sb.Id})
				}
				if _, err := s.cri.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
					t.Errorf("teardown %s: remove sandbox: %v", secondNodeName, err)
				}
			}
		}
		if err := localcluster.WaitFor(ctx, time.Minute, 200*time.Millisecond, func() error {
			if left := processesMentioning(s.sock); len(left) > 0 {
				return fmt.Errorf("%d shims of %s still running", len(left), secondNodeName)
			}
			return nil
		}); err != nil {
			t.Errorf("teardown: %v", err)
		}
	}
	if s.conn != nil {
		s.conn.Close()
	}
	if s.containerd != nil {
		s.containerd.Stop()
	}
	if left := mountsBelow([]string{s.dir}); len(left) > 0 {
		t.Errorf("teardown %s: mounts left: %v", secondNodeName, left)
	}
	for i := len(s.cgroupDirs) - 1; i >= 0; i-- {
		if err := removeCgroupTree(s.cgroupDirs[i]); err != nil {
			t.Errorf("teardown: cgroup %s: %v", s.cgroupDirs[i], err)
		}
	}
}

// controllerPods are the controller Deployment's pods that are not being deleted.
func (n *realNode) controllerPods(ctx context.Context) ([]corev1.Pod, error) {
	list, err := n.kube.CoreV1().Pods("ipwarden-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controller"})
	if err != nil {
		return nil, err
	}
	var out []corev1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out, nil
}

// leaderPod is the pod name in the controller Lease's holder identity ("<pod>_<uuid>").
func (n *realNode) leaderPod(ctx context.Context) (string, error) {
	l, err := n.kube.CoordinationV1().Leases("ipwarden-system").Get(ctx, "ipwarden-controller", metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
		return "", fmt.Errorf("lease ipwarden-system/ipwarden-controller has no holder")
	}
	pod, _, _ := strings.Cut(*l.Spec.HolderIdentity, "_")
	return pod, nil
}

// checkRolloutOnTwoNodes restarts the controller Deployment with the second node up: the
// rollout completes, the two replicas run Ready on different nodes (the anti-affinity
// preference), and the Lease passes to one of the new pods.
func (n *realNode) checkRolloutOnTwoNodes(ctx context.Context) {
	t := n.t
	oldLeader, err := n.leaderPod(ctx)
	if err != nil {
		t.Fatal(err)
	}
	old, err := n.controllerPods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	oldNames := map[string]bool{}
	for _, p := range old {
		oldNames[p.Name] = true
	}
	if !oldNames[oldLeader] {
		t.Fatalf("the lease holder %q is none of the controller pods %v", oldLeader, oldNames)
	}
	n.logf("controller leader before the rollout: %s", oldLeader)
	n.kubectl("rollout", "restart", "-n", "ipwarden-system", "deployment/ipwarden-controller")
	n.kubectl("rollout", "status", "-n", "ipwarden-system", "deployment/ipwarden-controller", "--timeout=3m")
	var placed map[string]string
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		pods, err := n.controllerPods(ctx)
		if err != nil {
			return err
		}
		placed = map[string]string{}
		nodes := map[string]bool{}
		for _, p := range pods {
			if oldNames[p.Name] {
				return fmt.Errorf("old controller pod %s still there", p.Name)
			}
			ready := false
			for _, c := range p.Status.Conditions {
				ready = ready || (c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue)
			}
			if !ready {
				return fmt.Errorf("controller pod %s on %q not ready", p.Name, p.Spec.NodeName)
			}
			placed[p.Name] = p.Spec.NodeName
			nodes[p.Spec.NodeName] = true
		}
		if len(pods) != 2 || len(nodes) != 2 {
			return fmt.Errorf("controller pods on nodes %v, want 2 pods on 2 nodes", placed)
		}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	n.logf("controller pods after the rollout: %v", placed)
	var leader string
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		leader, err = n.leaderPod(ctx)
		if err != nil {
			return err
		}
		if _, ok := placed[leader]; !ok {
			return fmt.Errorf("lease held by %q, none of the new pods %v", leader, placed)
		}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	n.logf("controller leader after the rollout: %s on %s", leader, placed[leader])
}
