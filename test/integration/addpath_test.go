package integration

import (
	"fmt"
	"strings"
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// The ADD path makes no API call for a pod the agent's watch knows (docs/design.md, "A pod's
// ADD"), and never chooses pools as if a pod it cannot read had no annotations. The agent is cut
// off from the API server (a proxy refuses its connections): pods it already knows, annotated
// ones included, still get addresses from their pools; a pod created meanwhile, which it cannot
// have seen, is refused with CNI error 11 saying why (not given the node's default pool), and
// gets its annotated pool's address once the agent can read it again.
func TestAddPathWithoutTheAPIServer(t *testing.T) {
	const node = "addpath"
	scale := ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 100, MaxPerNode: 64}
	agentPool(t, "addpath-default", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.130.0.0/24"}, Scaling: scale})
	agentPool(t, "addpath-named", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.130.1.0/24"}, Scaling: scale})
	agentNode(t, node, node)
	startController(t)
	proxy, kc := apiProxy(t)
	ag := startAgent(t, node, "", "--kubeconfig", kc, "--pools", "addpath-default,addpath-named")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket, "addpath-default")
	named := map[string]string{podinfo.AnnotationPools: "addpath-named"}

	plain := createBoundPod(t, "addpath-plain", node)
	annotated := createAnnotatedPod(t, "default", "addpath-annotated", node, named)
	eventually(t, 20*time.Second, "both pools to hold addresses for the known pods", func() error {
		if size(held(t, node, "addpath-default")) == 0 || size(held(t, node, "addpath-named")) == 0 {
			return fmt.Errorf("default holds %v, named %v", held(t, node, "addpath-default"), held(t, node, "addpath-named"))
		}
		return nil
	})

	cut := proxy.Block()
	t.Logf("the agent is cut off from the API server (%d connections cut)", cut)
	late := createAnnotatedPod(t, "default", "addpath-late", node, named)

	r, e := cni(t, "ADD", conf, "plain", podArgs("default", plain.Name, string(plain.UID)))
	if e != nil || !inPrefix(t, r.IPs[0].Address, "10.130.0.0/24") {
		t.Fatalf("ADD of a known pod while cut off: %+v %v", r, e)
	}
	r, e = cni(t, "ADD", conf, "annotated", podArgs("default", annotated.Name, string(annotated.UID)))
	if e != nil || !inPrefix(t, r.IPs[0].Address, "10.130.1.0/24") {
		t.Fatalf("ADD of a known annotated pod while cut off: %+v %v (want pool addpath-named)", r, e)
	}
	_, e = cni(t, "ADD", conf, "late", podArgs("default", late.Name, string(late.UID)))
	if e == nil || e.Code != 11 || !strings.Contains(e.Msg, "cannot read pod default/addpath-late's annotations") {
		t.Fatalf("ADD of a pod the agent cannot have seen, while cut off: %+v (want CNI error 11 saying it cannot read the pod)", e)
	}
	if ag.metric(t, "ipwarden_agent_add_pod_unreadable_total") < 1 {
		t.Fatal("ipwarden_agent_add_pod_unreadable_total did not count the refused ADD")
	}

	proxy.Unblock()
	eventually(t, 30*time.Second, "the late pod's ADD to get its annotated pool's address", func() error {
		r, e := cni(t, "ADD", conf, "late", podArgs("default", late.Name, string(late.UID)))
		if e != nil {
			return fmt.Errorf("%s", e.Msg)
		}
		if !inPrefix(t, r.IPs[0].Address, "10.130.1.0/24") {
			t.Fatalf("the late pod got %s, not from its annotated pool addpath-named", r.IPs[0].Address)
		}
		return nil
	})
}

// A paused agent (SIGSTOP: the kernel still accepts connections for it) gives the runtime a CNI
// error that names it well before the runtimes' timeouts (the plugin's own ADD timeout is 90s):
// the plugin hears no heartbeat for cniproto.Silence and gives up within that plus 1 s (the
// plugin's start included). Resumed, the agent serves again, and the ADD it had read while
// paused is rolled back (the plugin went away), so it holds nothing.
func TestPausedAgentGivesTheRuntimeAnError(t *testing.T) {
	const node = "paused-agent"
	gcSetup(t, node, "10.131.0.0/24")
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	p := createBoundPod(t, "paused-agent-pod", node)

	ag.proc.Pause()
	resumed := false
	defer func() {
		if !resumed {
			ag.proc.Resume()
		}
	}()
	cniBinary(t) // built (once per test binary) before the clock starts
	start := time.Now()
	_, e := cni(t, "ADD", conf, "while-paused", podArgs(p.Namespace, p.Name, string(p.UID)))
	took := time.Since(start)
	if e == nil || e.Code != 11 || !strings.Contains(e.Msg, ag.socket) || !strings.Contains(e.Msg, "paused") {
		t.Fatalf("ADD to a paused agent: %+v; want CNI error 11 naming the agent's socket", e)
	}
	if bound := cniproto.Silence + time.Second; took > bound {
		t.Fatalf("the plugin gave up on the paused agent after %s, more than its silence bound %s plus 1 s", took, cniproto.Silence)
	}
	t.Logf("the plugin gave up on the paused agent after %s (silence bound %s)", took, cniproto.Silence)
	ag.proc.Resume()
	resumed = true
	r, e := cni(t, "ADD", conf, "after", podArgs(p.Namespace, p.Name, string(p.UID)))
	if e != nil {
		t.Fatalf("ADD after the agent resumed: %v", e)
	}
	eventually(t, 20*time.Second, "the ADD read while paused to be rolled back", func() error {
		resp, err := ag.list(t)
		if err != nil {
			return err
		}
		for _, a := range resp.Attachments {
			if a.ContainerID == "while-paused" {
				return fmt.Errorf("attachment while-paused still there")
			}
		}
		if len(resp.Attachments) != 1 || resp.Attachments[0].IPs[0].Address != r.IPs[0].Address {
			return fmt.Errorf("attachments %+v", resp.Attachments)
		}
		return nil
	})
}
