package integration

// Pool edits under running pods: real agent, controller and plugin processes on the real API
// server.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
)

// findingsOn returns the check findings of kind that name node.
func findingsOn(r check.Report, kind, node string) []check.Finding {
	var out []check.Finding
	for _, f := range r.Findings {
		if f.Kind == kind && slices.Contains(f.Nodes, node) {
			out = append(out, f)
		}
	}
	return out
}

// An exclusion added to a pool under running pods, with churn: the agent never hands out an
// excluded address again, even though its status still holds them; the excluded free addresses
// are given back at once and the ones in use as their pods go; the metric and `ipwarden check`
// show them until they are gone. Deleting the pool gives a clear CNI error and takes nothing from
// running pods.
func TestAgentPoolShrinkUnderChurn(t *testing.T) {
	const node = "pool-edit"
	gcSetup(t, node, "10.142.0.0/24")
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	live := map[string]netip.Addr{}
	n := 0
	add := func() netip.Addr {
		n++
		cid := fmt.Sprintf("pe-%d", n)
		a := addrOf(t, mustAdd(t, conf, cid).IPs[0].Address)
		live[cid] = a
		return a
	}
	for range 12 {
		add()
	}
	holding := waitHeld(t, node, node, 32)
	// Exclude the /27 that holds the lowest address in use: pods run on some of it.
	var lowest netip.Addr
	for _, a := range live {
		if !lowest.IsValid() || a.Less(lowest) {
			lowest = a
		}
	}
	excluded := netip.PrefixFrom(lowest, 27).Masked()
	if !holding.Overlaps(mustPrefix(excluded.String())) {
		t.Fatalf("the node holds %v; the test wants it to hold part of %v", holding, excluded)
	}
	pool := getPool(t, node)
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(pool), pool); err != nil {
			return err
		}
		pool.Spec.Exclude = []ipwardenv1.IPOrCIDR{ipwardenv1.IPOrCIDR(excluded.String())}
		return k8s.Update(context.Background(), pool)
	}); err != nil {
		t.Fatal(err)
	}
	inUseExcluded := 0
	for _, a := range live {
		if excluded.Contains(a) {
			inUseExcluded++
		}
	}
	ag.waitMetric(t, 20*time.Second, fmt.Sprintf(`ipwarden_agent_addresses_outside_pool{pool=%q}`, node), float64(inUseExcluded))
	if r, _, _ := runCheck(t); len(findingsOn(r, check.OutsidePool, node)) == 0 {
		t.Fatalf("ipwarden check shows nothing outside the pool on %s: %+v", node, r.Findings)
	}

	// Churn: pods come and go; no new one gets an excluded address. The pods on excluded
	// addresses go first, so the node drains.
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 40 {
		var victim string
		for cid, a := range live {
			if excluded.Contains(a) && (victim == "" || cid < victim) {
				victim = cid
			}
		}
		if victim == "" || rng.IntN(3) == 0 {
			ids := make([]string, 0, len(live))
			for cid := range live {
				ids = append(ids, cid)
			}
			slices.Sort(ids)
			victim = ids[rng.IntN(len(ids))]
		}
		mustDel(t, conf, victim)
		delete(live, victim)
		if a := add(); excluded.Contains(a) {
			t.Fatalf("churn step %d: handed out %s, excluded by %s", i, a, excluded)
		}
	}
	for cid, a := range live {
		if excluded.Contains(a) {
			mustDel(t, conf, cid)
			delete(live, cid)
		}
	}
	eventually(t, 30*time.Second, "the node to hold nothing excluded", func() error {
		if h := held(t, node, node); h.Overlaps(mustPrefix(excluded.String())) {
			return fmt.Errorf("holds %v", h)
		}
		return nil
	})
	ag.waitMetricAtMost(t, 20*time.Second, fmt.Sprintf(`ipwarden_agent_addresses_outside_pool{pool=%q}`, node), 0)
	if r, _, _ := runCheck(t); len(findingsOn(r, check.OutsidePool, node)) != 0 {
		t.Fatalf("ipwarden check after the drain: %+v", findingsOn(r, check.OutsidePool, node))
	}

	// The pool is deleted: ADD naming it fails clearly; running pods keep their addresses.
	if err := k8s.Delete(context.Background(), getPool(t, node)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "ADD naming the deleted pool to fail clearly", func() error {
		_, e := cni(t, "ADD", pluginConf("1.1.0", ag.socket, node), "after-delete", podArgs("default", "after-delete", "uid-ad"))
		if e == nil {
			return fmt.Errorf("ADD succeeded")
		}
		if e.Code != 7 || !strings.Contains(e.Msg, "was deleted") {
			return fmt.Errorf("error %+v", e)
		}
		return nil
	})
	if got := len(ag.attachmentIDs(t)); got != len(live) {
		t.Fatalf("%d attachments after the pool was deleted, want %d", got, len(live))
	}
}

// waitMetricAtMost waits until a series is at most max.
func (a *agentProcess) waitMetricAtMost(t *testing.T, timeout time.Duration, series string, max float64) {
	t.Helper()
	eventually(t, timeout, fmt.Sprintf("%s <= %v", series, max), func() error {
		if v := a.metric(t, series); v > max {
			return fmt.Errorf("%s = %v", series, v)
		}
		return nil
	})
}
