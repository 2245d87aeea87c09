package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func cooldown(d time.Duration) metav1.Duration { return metav1.Duration{Duration: d} }

// Two network namespaces get addresses from the pool through bridge -> ipwarden-cni -> agent,
// reach each other over the bridge, pass CHECK, and DEL gives their addresses back (cooling).
func TestBridgeNamespacesReachEachOther(t *testing.T) {
	createPool(t, "e2e-bridge", "bridge", ipwardenv1.IPPoolSpec{
		CIDRs:   []ipwardenv1.CIDR{"10.130.0.0/24"},
		Exclude: []ipwardenv1.IPOrCIDR{"10.130.0.0", "10.130.0.1", "10.130.0.255"}, Gateway: "10.130.0.1",
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32},
		ReuseCooldown: cooldown(time.Hour),
	})
	createNode(t, "e2e-bridge", "bridge")
	startController(t)
	ag := startAgent(t, "e2e-bridge")
	net := newNetwork(t, bridgeName(t), ag.socket)
	ctx := context.Background()

	type pod struct {
		ns, id, ip string
	}
	pods := []*pod{{ns: netns(t, "a"), id: "e2ea"}, {ns: netns(t, "b"), id: "e2eb"}}
	for _, p := range pods {
		rt := runtimeConf(p.ns, p.id, p.id)
		t.Cleanup(func() { _ = net.cni.DelNetworkList(context.Background(), net.list, rt) })
		res, err := net.add(ctx, rt)
		if err != nil {
			t.Fatalf("ADD %s: %v", p.ns, err)
		}
		var ips []string
		for _, ip := range res.IPs {
			ips = append(ips, ip.Address.String())
		}
		if len(res.IPs) != 1 || !strings.HasPrefix(ips[0], "10.130.0.") || !strings.HasSuffix(ips[0], "/24") ||
			res.IPs[0].Gateway.String() != "10.130.0.1" {
			t.Fatalf("ADD %s: result IPs %v", p.ns, ips)
		}
		p.ip = res.IPs[0].Address.IP.String()
		if !held(t, "e2e-bridge", "e2e-bridge").Contains(netip.MustParseAddr(p.ip)) {
			t.Fatalf("%s got %s, which the node does not hold", p.ns, p.ip)
		}
		out, err := exec.Command("ip", "netns", "exec", p.ns, "ip", "-4", "-o", "addr", "show", "dev", "eth0").CombinedOutput()
		if err != nil || !strings.Contains(string(out), p.ip+"/24") {
			t.Fatalf("%s eth0 does not carry %s: %v %s", p.ns, p.ip, err, out)
		}
	}
	if pods[0].ip == pods[1].ip {
		t.Fatalf("both namespaces got %s", pods[0].ip)
	}
	if err := ping(pods[0].ns, pods[1].ip); err != nil {
		t.Fatal(err)
	}
	if err := ping(pods[1].ns, pods[0].ip); err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if err := net.cni.CheckNetworkList(ctx, net.list, runtimeConf(p.ns, p.id, p.id)); err != nil {
			t.Fatalf("CHECK %s: %v", p.ns, err)
		}
	}

	for _, p := range pods {
		for range 2 { // DEL is idempotent
			if err := net.cni.DelNetworkList(ctx, net.list, runtimeConf(p.ns, p.id, p.id)); err != nil {
				t.Fatalf("DEL %s: %v", p.ns, err)
			}
		}
	}
	resp, err := ag.list()
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Attachments) != 0 {
		t.Fatalf("attachments left after DEL: %+v", resp.Attachments)
	}
	for _, p := range resp.Pools {
		if p.Pool == "e2e-bridge" && (p.InUse != 0 || p.Cooling != 2) {
			t.Fatalf("after DEL the pool shows %+v, want 0 in use and the 2 freed addresses cooling", p)
		}
	}
	// A new namespace does not get a freed address (cooldown 1h).
	c := netns(t, "c")
	rt := runtimeConf(c, "e2ec", "e2ec")
	t.Cleanup(func() { _ = net.cni.DelNetworkList(context.Background(), net.list, rt) })
	res, err := net.add(ctx, rt)
	if err != nil {
		t.Fatal(err)
	}
	if got := res.IPs[0].Address.IP.String(); got == pods[0].ip || got == pods[1].ip {
		t.Fatalf("a new namespace got %s, freed moments ago", got)
	}
}

// 110 namespaces (kubelet's pod limit) start at once on a cold node: every ADD through the bridge
// plugin succeeds with a distinct address while the controller fills the node in batches.
func TestBurstOf110OnColdNode(t *testing.T) {
	createPool(t, "e2e-burst", "burst", ipwardenv1.IPPoolSpec{
		CIDRs:   []ipwardenv1.CIDR{"10.131.0.0/22"},
		Exclude: []ipwardenv1.IPOrCIDR{"10.131.0.0", "10.131.0.1", "10.131.3.255"}, Gateway: "10.131.0.1",
		Scaling:       ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}, // the API defaults
		ReuseCooldown: cooldown(30 * time.Second),
	})
	createNode(t, "e2e-burst", "burst")
	startController(t)
	ag := startAgent(t, "e2e-burst", "--address-wait=60s")
	net := newNetwork(t, bridgeName(t), ag.socket)
	ctx := context.Background()

	const n = 110
	names := make([]string, n)
	for i := range n {
		names[i] = netns(t, fmt.Sprintf("burst%03d", i))
	}
	ips := make([]string, n)
	errs := make([]error, n)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		rt := runtimeConf(names[i], fmt.Sprintf("burst%03d", i), fmt.Sprintf("burst%03d", i))
		t.Cleanup(func() { _ = net.cni.DelNetworkList(context.Background(), net.list, rt) })
		wg.Go(func() {
			res, err := net.add(ctx, rt)
			if err != nil {
				errs[i] = err
				return
			}
			ips[i] = res.IPs[0].Address.IP.String()
		})
	}
	wg.Wait()
	took := time.Since(start)
	seen := map[string]int{}
	for i := range n {
		if errs[i] != nil {
			t.Errorf("ADD %d: %v", i, errs[i])
			continue
		}
		if j, dup := seen[ips[i]]; dup {
			t.Errorf("%s handed to namespaces %d and %d", ips[i], j, i)
		}
		seen[ips[i]] = i
	}
	if t.Failed() {
		t.FailNow()
	}
	h := held(t, "e2e-burst", "e2e-burst")
	for ip := range seen {
		if !h.Contains(netip.MustParseAddr(ip)) {
			t.Fatalf("%s is not held by the node", ip)
		}
	}
	if err := ping(names[0], ips[n-1]); err != nil {
		t.Fatal(err)
	}
	p50, p99 := waitQuantiles(t, "http://"+ag.metrics+"/metrics")
	t.Logf("110 ADDs through bridge in %s; IP wait p50 <= %s, p99 <= %s (histogram bucket bounds); node holds %d",
		took.Round(time.Millisecond), p50, p99, h.Size().Lo)

	var dwg sync.WaitGroup
	for i := range n {
		dwg.Go(func() {
			if err := net.cni.DelNetworkList(ctx, net.list, runtimeConf(names[i], fmt.Sprintf("burst%03d", i), "x")); err != nil {
				t.Errorf("DEL %d: %v", i, err)
			}
		})
	}
	dwg.Wait()
	resp, err := ag.list()
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Attachments) != 0 {
		t.Fatalf("%d attachments left after DEL", len(resp.Attachments))
	}
}

// waitQuantiles reads the agent's IP wait histogram and returns the bucket bounds holding the
// 50th and 99th percentile.
func waitQuantiles(t *testing.T, url string) (time.Duration, time.Duration) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	type bucket struct {
		le    float64
		count float64
	}
	var bs []bucket
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, "ipwarden_agent_ip_wait_seconds_bucket{") {
			continue
		}
		le := line[strings.Index(line, `le="`)+4:]
		le = le[:strings.Index(le, `"`)]
		v, _ := strconv.ParseFloat(strings.Fields(line)[1], 64)
		f, err := strconv.ParseFloat(le, 64)
		if err != nil {
			f = 1e9 // +Inf
		}
		bs = append(bs, bucket{f, v})
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].le < bs[j].le })
	if len(bs) == 0 {
		t.Fatal("no ip_wait histogram")
	}
	total := bs[len(bs)-1].count
	q := func(p float64) time.Duration {
		for _, b := range bs {
			if b.count >= p*total {
				return time.Duration(b.le * float64(time.Second))
			}
		}
		return 0
	}
	return q(0.5), q(0.99)
}
