package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// podArgs is CNI_ARGS as containerd and CRI-O pass it: IgnoreUnknown=1 lets host-local accept
// the K8S_POD_* keys it does not read.
const podArgs = "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web;K8S_POD_UID=u1"

var (
	cniPathOnce sync.Once
	cniPathDir  string
	cniPathErr  error
)

// cniPath builds, once per test run, a CNI_PATH holding the real host-local plugin of the
// containernetworking plugins release the project tests with (localcluster.PluginsVersion) and
// nogc (testdata/nogc: a plugin whose spec versions stop at 1.0.0, so it has no GC).
func cniPath(t *testing.T) string {
	t.Helper()
	cniPathOnce.Do(func() {
		if cniPathDir, cniPathErr = os.MkdirTemp("", "ipwarden-cni-path"); cniPathErr != nil {
			return
		}
		if cniPathErr = localcluster.InstallPlugins(cniPathDir, io.Discard, "ipam/host-local"); cniPathErr != nil {
			return
		}
		cniPathErr = localcluster.BuildOnce(".", filepath.Join(cniPathDir, "nogc"), "./testdata/nogc")
	})
	if cniPathErr != nil {
		t.Fatalf("build the CNI plugins: %v", cniPathErr)
	}
	return cniPathDir
}

// hostLocalIPAM is the "ipam" object of a node that ran host-local before ipwarden.
func hostLocalIPAM(dataDir string) string {
	return `{"type":"host-local","ranges":[[{"subnet":"10.85.0.0/16"}]],"dataDir":"` + dataDir + `"}`
}

// oldPod ADDs container cid through host-local itself, as the node did before it moved to
// ipwarden, and returns host-local's result and the file that holds its reservation.
func oldPod(t *testing.T, dataDir, cid string) (result, reservation string) {
	t.Helper()
	bin := filepath.Join(cniPath(t), "host-local")
	conf := `{"cniVersion":"1.1.0","name":"podnet","type":"bridge","ipam":` + hostLocalIPAM(dataDir) + `}`
	out, _, e := runBin(t, bin, "ADD", conf, "CNI_CONTAINERID="+cid, "CNI_PATH="+cniPath(t), podArgs)
	if e != nil {
		t.Fatalf("host-local ADD of %s: %+v", cid, e)
	}
	ip, _, _ := strings.Cut(addressOf(t, out), "/")
	reservation = filepath.Join(dataDir, "podnet", ip)
	if b, err := os.ReadFile(reservation); err != nil || !strings.HasPrefix(string(b), cid) {
		t.Fatalf("host-local's reservation of %s for %s: %q, %v", ip, cid, b, err)
	}
	return out, reservation
}

// realAgent serves a socket with the agent's real request handling (agent.Service over a journal
// in a temporary directory, ready, holding 10.1.0.5-10.1.0.9 of pool v4) and records the
// requests it answered.
func realAgent(t *testing.T) (sock string, reqs func() []cniproto.Request) {
	t.Helper()
	j, err := journal.Open(t.TempDir(), journal.Options{Node: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	svc := agent.NewService(ipam.New("node-a"), j, agent.ServiceOptions{Node: "node-a", AddressWait: time.Second, GCGrace: time.Minute, Log: logr.Discard()})
	pool := ipam.Pool{Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}, Gateway: netip.MustParseAddr("10.1.0.1")}
	svc.SetPools([]ipam.Pool{pool}, []string{"v4"})
	svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.5-10.1.0.9")}, agent.RecordOf{})
	svc.SetReady(true)
	sock = filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var mu sync.Mutex
	var got []cniproto.Request
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			req, rerr := cniproto.ReadRequest(conn)
			resp := &cniproto.Response{}
			if rerr != nil {
				resp.Error = &cniproto.Error{Code: cniproto.CodeDecodingFailure, Msg: rerr.Error()}
			} else {
				mu.Lock()
				got = append(got, req)
				mu.Unlock()
				resp = svc.Handle(context.Background(), req)
			}
			_ = cniproto.WriteResponse(conn, resp)
			conn.Close()
		}
	}()
	return sock, func() []cniproto.Request {
		mu.Lock()
		defer mu.Unlock()
		return append([]cniproto.Request(nil), got...)
	}
}

// ipwardenConf is a network configuration with ipwarden as IPAM and previous as its "previous".
func ipwardenConf(sock, previous, extra string) string {
	return `{"cniVersion":"1.1.0","name":"podnet","type":"bridge","ipam":{"type":"ipwarden","pools":["v4"],"socket":"` + sock +
		`","previous":` + previous + `}` + extra + `}`
}

// addressOf is the only address of an ADD result.
func addressOf(t *testing.T, result string) string {
	t.Helper()
	var res struct {
		IPs []struct{ Address string } `json:"ips"`
	}
	if err := json.Unmarshal([]byte(result), &res); err != nil || len(res.IPs) != 1 {
		t.Fatalf("result %s: %v", result, err)
	}
	return res.IPs[0].Address
}

func withPrevResult(result string) string {
	return `,"prevResult":` + result
}

func exists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return err == nil
}

// A pod started under host-local, still running when the node moved to ipwarden: CHECK through
// ipwarden-cni is answered by host-local (the agent has no attachment for it), its DEL frees
// host-local's reservation after the agent's DEL, and a container neither knows fails CHECK.
func TestPreviousOldPodCheckAndDel(t *testing.T) {
	dataDir := t.TempDir()
	result, reservation := oldPod(t, dataDir, "old1")
	sock, reqs := realAgent(t)
	conf := ipwardenConf(sock, hostLocalIPAM(dataDir), withPrevResult(result))
	env := []string{"CNI_PATH=" + cniPath(t), "CNI_CONTAINERID=old1", podArgs}

	if _, e := run(t, "CHECK", conf, env...); e != nil {
		t.Fatalf("CHECK of the old pod: %+v", e)
	}
	_, e := run(t, "CHECK", ipwardenConf(sock, hostLocalIPAM(dataDir), ""), "CNI_PATH="+cniPath(t), "CNI_CONTAINERID=stranger", podArgs)
	if e == nil || !strings.Contains(e.Msg, "agent has no attachment for container stranger") || !strings.Contains(e.Msg, `previous IPAM "host-local"`) {
		t.Fatalf("CHECK of a container neither knows: %+v, want an error naming the agent and host-local", e)
	}

	if _, e := run(t, "DEL", conf, env...); e != nil {
		t.Fatalf("DEL of the old pod: %+v", e)
	}
	if exists(t, reservation) {
		t.Fatalf("host-local's reservation %s outlived the pod's DEL", reservation)
	}
	var dels int
	for _, r := range reqs() {
		if r.Op == cniproto.OpDel && r.ContainerID == "old1" && r.IfName == "eth0" && r.Network == "podnet" {
			dels++
		}
	}
	if dels != 1 {
		t.Fatalf("the agent got %d DELs of old1: %+v", dels, reqs())
	}
	if _, e := run(t, "DEL", conf, env...); e != nil {
		t.Fatalf("DEL again (idempotent): %+v", e)
	}
	if _, e := run(t, "CHECK", conf, env...); e == nil || !strings.Contains(e.Msg, "host-local") {
		t.Fatalf("CHECK after the DEL: %+v, want host-local's refusal", e)
	}
	// The next pod host-local would have given the address to gets it from ipwarden instead.
	if out, e := run(t, "ADD", conf, "CNI_PATH="+cniPath(t), "CNI_CONTAINERID=new1", podArgs); e != nil || addressOf(t, out) != "10.1.0.5/16" {
		t.Fatalf("ADD after the takeover: %s %+v", out, e)
	}
}

// ADD never reaches the previous IPAM: host-local does not run (the agent reads its
// reservations and writes its own reservation file for the new pod's address), and CHECK of the
// new pod is the agent's alone.
func TestPreviousAddNeverDelegates(t *testing.T) {
	dataDir := t.TempDir()
	sock, reqs := realAgent(t)
	conf := ipwardenConf(sock, hostLocalIPAM(dataDir), "")
	env := []string{"CNI_PATH=" + cniPath(t), "CNI_CONTAINERID=new1", podArgs}
	out, e := run(t, "ADD", conf, env...)
	if e != nil {
		t.Fatal(e)
	}
	if addressOf(t, out) != "10.1.0.5/16" {
		t.Fatalf("ADD result %s, want ipwarden's 10.1.0.5/16", out)
	}
	if _, e := run(t, "CHECK", ipwardenConf(sock, hostLocalIPAM(dataDir), withPrevResult(out)), env...); e != nil {
		t.Fatalf("CHECK of the new pod: %+v", e)
	}
	// host-local never ran (it would have written last_reserved_ip.0); the agent wrote its
	// own reservation of the new pod's address, under host-local's lock, before it answered.
	var files []string
	err := filepath.WalkDir(dataDir, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			rel, _ := filepath.Rel(dataDir, path)
			files = append(files, rel)
		}
		return err
	})
	if err != nil || !slices.Equal(files, []string{"podnet/10.1.0.5", "podnet/lock"}) {
		t.Fatalf("host-local's dataDir after ADD and CHECK: %v %v, want the agent's reservation and host-local's lock alone", files, err)
	}
	if b, err := os.ReadFile(filepath.Join(dataDir, "podnet", "10.1.0.5")); err != nil || !previous.IsOwnHostLocal(string(b)) {
		t.Fatalf("the reservation file holds %q (%v), not ipwarden's", b, err)
	}
	got := reqs()
	if len(got) != 2 || got[0].Op != cniproto.OpAdd || got[1].Op != cniproto.OpCheck {
		t.Fatalf("agent requests %+v", got)
	}
	// The ADD carries the "previous" object: the agent reads host-local's reservations first.
	if string(got[0].Previous) != hostLocalIPAM(dataDir) || got[1].Previous != nil {
		t.Fatalf("the ADD forwarded previous %s and the CHECK %s; want host-local's ipam object with the ADD only", got[0].Previous, got[1].Previous)
	}
}

// GC after the agent's is delegated with the same valid-attachments list. host-local of
// containernetworking/plugins v1.9.1 has no GC of its own (its main leaves GC as a FIXME), and
// the CNI library's skel it is built on answers a GC without a GC function with success: the GC
// succeeds and host-local's reservations stay, listed or not (only DEL frees them).
func TestPreviousGC(t *testing.T) {
	dataDir := t.TempDir()
	_, stale := oldPod(t, dataDir, "old1")
	_, kept := oldPod(t, dataDir, "old2")
	sock, reqs := realAgent(t)
	conf := ipwardenConf(sock, hostLocalIPAM(dataDir), `,"cni.dev/valid-attachments":[{"containerID":"old2","ifname":"eth0"}]`)
	_, stderr, e := runBin(t, plugin(t), "GC", conf, "CNI_PATH="+cniPath(t), podArgs)
	if e != nil {
		t.Fatalf("GC: %+v", e)
	}
	if got := reqs(); len(got) != 1 || got[0].Op != cniproto.OpGC || len(got[0].ValidAttachments) != 1 {
		t.Fatalf("agent requests %+v", got)
	}
	if strings.Contains(stderr, "does not support GC") {
		t.Fatalf("host-local's GC was skipped: %s", stderr)
	}
	if localcluster.PluginsVersion != "v1.9.1" {
		t.Fatalf("plugins %s: see whether its host-local has GC and update this test", localcluster.PluginsVersion)
	}
	if !exists(t, stale) || !exists(t, kept) {
		t.Fatalf("host-local v1.9.1 has no GC, yet its reservations changed: %s %v, %s %v", stale, exists(t, stale), kept, exists(t, kept))
	}
}

// A previous IPAM without GC (spec versions before 1.1.0: a version error) is skipped with a note
// on stderr; a GC without a valid-attachments list is not delegated at all.
func TestPreviousWithoutGC(t *testing.T) {
	sock, reqs := fakeAgent(t, cniproto.Response{})
	conf := ipwardenConf(sock, `{"type":"nogc"}`, `,"cni.dev/valid-attachments":[]`)
	_, stderr, e := runBin(t, plugin(t), "GC", conf, "CNI_PATH="+cniPath(t))
	if e != nil {
		t.Fatalf("GC with a previous IPAM without GC: %+v", e)
	}
	if !strings.Contains(stderr, `previous IPAM "nogc" does not support GC`) {
		t.Fatalf("stderr %q does not say the previous IPAM's GC was skipped", stderr)
	}
	_, stderr, _ = runBin(t, plugin(t), "GC", ipwardenConf(sock, `{"type":"nogc"}`, ""), "CNI_PATH="+cniPath(t))
	if !strings.Contains(stderr, "not delegated") {
		t.Fatalf("GC without a list: stderr %q", stderr)
	}
	if got := *reqs; len(got) != 2 || got[0].Op != cniproto.OpGC || got[1].Op != cniproto.OpGC {
		t.Fatalf("agent requests %+v", got)
	}
}

// A failed DEL says which part failed: the agent (its code kept: 11 for an unreachable agent) or
// the previous IPAM, by its type.
func TestPreviousDelErrors(t *testing.T) {
	sock, reqs := fakeAgent(t, cniproto.Response{})
	_, e := run(t, "DEL", ipwardenConf(sock, `{"type":"absent-ipam"}`, ""), "CNI_PATH="+cniPath(t))
	if e == nil || !strings.Contains(e.Msg, "agent's DEL succeeded") || !strings.Contains(e.Msg, `previous IPAM "absent-ipam" failed`) {
		t.Fatalf("DEL with a previous IPAM missing from CNI_PATH: %+v", e)
	}
	if len(*reqs) != 1 {
		t.Fatalf("agent requests %+v", *reqs)
	}
	missing := filepath.Join(t.TempDir(), "nope.sock")
	_, e = run(t, "DEL", ipwardenConf(missing, hostLocalIPAM(t.TempDir()), ""), "CNI_PATH="+cniPath(t), podArgs)
	if e == nil || e.Code != types.ErrTryAgainLater || !strings.Contains(e.Msg, "by the ipwarden agent failed") ||
		!strings.Contains(e.Msg, `DEL by the previous IPAM "host-local" succeeded`) {
		t.Fatalf("DEL with an unreachable agent: %+v, want code 11 naming the agent", e)
	}
}

func TestParseConfigPreviousType(t *testing.T) {
	for conf, want := range map[string]string{
		`{"name":"n","ipam":{"type":"ipwarden","previous":{"type":"host-local"}}}`: "host-local",
		`{"name":"n","previous":{"type":"whereabouts"}}`:                           "whereabouts",
		`{"name":"n","ipam":{"type":"ipwarden"}}`:                                  "",
	} {
		c, err := parseConfig([]byte(conf))
		if err != nil || c.PreviousType != want || (want == "") != (c.Previous == nil) {
			t.Fatalf("%s: %v %q", conf, err, c.PreviousType)
		}
	}
	// The previous IPAM reads its own object as "ipam"; everything else passes unchanged.
	out, err := previousConf([]byte(`{"cniVersion":"1.1.0","name":"n","ipam":{"type":"ipwarden","previous":{"type":"host-local","dataDir":"/d"}},"prevResult":{"ips":[]}}`),
		json.RawMessage(`{"type":"host-local","dataDir":"/d"}`))
	if err != nil || string(out) != `{"cniVersion":"1.1.0","ipam":{"type":"host-local","dataDir":"/d"},"name":"n","prevResult":{"ips":[]}}` {
		t.Fatalf("%s %v", out, err)
	}
}

// A previous IPAM that cannot CHECK (a version error, or Whereabouts' "not implemented") leaves
// nothing to check; any other CHECK failure is the previous IPAM's answer.
func TestCheckUnsupported(t *testing.T) {
	for _, tc := range []struct {
		err  *types.Error
		want bool
	}{
		{types.NewError(types.ErrIncompatibleCNIVersion, "plugin version does not allow CHECK", ""), true},
		{types.NewError(types.ErrInternal, `CHECK by the previous IPAM "whereabouts" failed: CNI CHECK method is not implemented`, ""), true},
		{types.NewError(types.ErrInternal, `CHECK by the previous IPAM "host-local" failed: host-local: Failed to find address added by container x`, ""), false},
		{types.NewError(types.ErrTryAgainLater, "timeout", ""), false},
	} {
		if got := checkUnsupported(tc.err); got != tc.want {
			t.Errorf("checkUnsupported(%d %q) = %v, want %v", tc.err.Code, tc.err.Msg, got, tc.want)
		}
	}
}
