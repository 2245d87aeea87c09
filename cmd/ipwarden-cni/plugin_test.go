package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"github.com/containernetworking/cni/pkg/skel"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

func TestParseConfig(t *testing.T) {
	for _, tc := range []struct {
		name, conf       string
		pools            []string
		socket, errField string
	}{
		{"defaults", `{"cniVersion":"1.1.0","name":"n","type":"ipwarden"}`, nil, cniproto.DefaultSocket, ""},
		{"top level", `{"cniVersion":"1.1.0","name":"n","type":"ipwarden","pools":["a","b"],"socket":"/x/s.sock"}`, []string{"a", "b"}, "/x/s.sock", ""},
		{"ipam section wins", `{"cniVersion":"1.1.0","name":"n","type":"bridge","pools":["top"],"ipam":{"type":"ipwarden","pools":["a"]}}`, []string{"a"}, cniproto.DefaultSocket, ""},
		{"pools not a list", `{"name":"n","ipam":{"type":"ipwarden","pools":"a"}}`, nil, "", `"ipam.pools"`},
		{"pools with empty name", `{"name":"n","pools":[""]}`, nil, "", `"pools"`},
		{"pools twice", `{"name":"n","pools":["a","a"]}`, nil, "", `names pool "a" twice`},
		{"socket relative", `{"name":"n","ipam":{"type":"ipwarden","socket":"agent.sock"}}`, nil, "", `"ipam.socket"`},
		{"socket not a string", `{"name":"n","socket":5}`, nil, "", `"socket"`},
		{"claim reference not a string", `{"name":"n","args":{"cni":{"ipam-claim-reference":5}}}`, nil, "", `"args.cni.ipam-claim-reference"`},
		{"args of another shape", `{"name":"n","args":"x"}`, nil, cniproto.DefaultSocket, ""},
		{"previous in ipam", `{"cniVersion":"1.1.0","name":"n","type":"bridge","ipam":{"type":"ipwarden","previous":{"type":"host-local","ranges":[[{"subnet":"10.85.0.0/16"}]]}}}`, nil, cniproto.DefaultSocket, ""},
		{"previous at the top level", `{"cniVersion":"1.1.0","name":"n","type":"ipwarden","previous":{"type":"whereabouts"}}`, nil, cniproto.DefaultSocket, ""},
		{"previous null", `{"name":"n","ipam":{"type":"ipwarden","previous":null}}`, nil, cniproto.DefaultSocket, ""},
		{"previous a string", `{"name":"n","ipam":{"type":"ipwarden","previous":"host-local"}}`, nil, "", `"ipam.previous"`},
		{"previous a list", `{"name":"n","previous":[{"type":"host-local"}]}`, nil, "", `"previous"`},
		{"previous without type", `{"name":"n","ipam":{"type":"ipwarden","previous":{"ranges":[]}}}`, nil, "", `"ipam.previous.type"`},
		{"previous type empty", `{"name":"n","ipam":{"type":"ipwarden","previous":{"type":""}}}`, nil, "", `"ipam.previous.type"`},
		{"previous type not a string", `{"name":"n","previous":{"type":7}}`, nil, "", `"previous.type"`},
		{"previous is ipwarden", `{"name":"n","ipam":{"type":"ipwarden","previous":{"type":"ipwarden"}}}`, nil, "", `"ipam.previous.type"`},
		{"previous a path", `{"name":"n","previous":{"type":"../../usr/bin/true"}}`, nil, "", `"previous.type"`},
		{"previous too large", `{"name":"n","ipam":{"type":"ipwarden","previous":{"type":"host-local","x":"` + strings.Repeat("a", maxPrevious) + `"}}}`, nil, "", `"ipam.previous"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseConfig([]byte(tc.conf))
			if tc.errField != "" {
				var te *types.Error
				if !errors.As(err, &te) || te.Code != types.ErrInvalidNetworkConfig || !strings.Contains(te.Msg, tc.errField) {
					t.Fatalf("err = %v, want code 7 naming %s", err, tc.errField)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if strings.Join(c.Pools, ",") != strings.Join(tc.pools, ",") || c.Socket != tc.socket {
				t.Fatalf("pools %v socket %q", c.Pools, c.Socket)
			}
		})
	}
}

func TestPodFromArgs(t *testing.T) {
	p := podFromArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID=u-1")
	if p != (cniproto.Pod{Namespace: "ns", Name: "web-0", UID: "u-1"}) {
		t.Fatalf("%+v", p)
	}
}

func TestMain(m *testing.M) {
	code := m.Run()
	if pluginBin != "" {
		os.RemoveAll(filepath.Dir(pluginBin))
	}
	if cniPathDir != "" {
		os.RemoveAll(cniPathDir)
	}
	os.Exit(code)
}

var (
	buildOnce sync.Once
	pluginBin string
	buildErr  error
)

// plugin builds the plugin binary once per test run.
func plugin(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "ipwarden-cni-test")
		if err != nil {
			buildErr = err
			return
		}
		pluginBin = filepath.Join(dir, "ipwarden-cni")
		buildErr = localcluster.BuildOnce(".", pluginBin, ".")
	})
	if buildErr != nil {
		t.Fatalf("build plugin: %v", buildErr)
	}
	return pluginBin
}

// fakeAgent answers every request with resp and records the requests.
func fakeAgent(t *testing.T, resp cniproto.Response) (string, *[]cniproto.Request) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var mu sync.Mutex
	var reqs []cniproto.Request
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			req, _ := cniproto.ReadRequest(conn)
			mu.Lock()
			reqs = append(reqs, req)
			mu.Unlock()
			_ = cniproto.WriteResponse(conn, &resp)
			conn.Close()
		}
	}()
	return sock, &reqs
}

func run(t *testing.T, cmd, conf string, env ...string) (stdout string, cniErr *types.Error) {
	t.Helper()
	stdout, _, cniErr = runBin(t, plugin(t), cmd, conf, env...)
	return stdout, cniErr
}

// runBin runs the CNI plugin bin for cmd with conf on stdin; env overrides the defaults (the
// last value of a variable wins).
func runBin(t *testing.T, bin, cmd, conf string, env ...string) (stdout, stderr string, cniErr *types.Error) {
	t.Helper()
	c := exec.Command(bin)
	c.Env = append([]string{"CNI_COMMAND=" + cmd, "CNI_CONTAINERID=abc123", "CNI_NETNS=/var/run/netns/x", "CNI_NETNS_OVERRIDE=1",
		"CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin", "CNI_ARGS=K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web;K8S_POD_UID=u1"}, env...)
	c.Stdin = strings.NewReader(conf)
	var out, errOut bytes.Buffer
	c.Stdout, c.Stderr = &out, &errOut
	err := c.Run()
	if err != nil {
		var e types.Error
		if jerr := json.Unmarshal(out.Bytes(), &e); jerr != nil {
			t.Fatalf("%s failed without a CNI error: %v: %s %s", filepath.Base(bin), err, out.String(), errOut.String())
		}
		return "", errOut.String(), &e
	}
	return out.String(), errOut.String(), nil
}

func TestAddResultForEveryVersion(t *testing.T) {
	sock, reqs := fakeAgent(t, cniproto.Response{
		IPs:    []cniproto.IP{{Pool: "v4", Address: "10.1.0.7/16", Gateway: "10.1.0.1"}, {Pool: "v6", Address: "fd01::7/64"}},
		Routes: []cniproto.Route{{Dst: "0.0.0.0/0"}, {Dst: "10.9.0.0/16", GW: "10.1.0.254"}},
	})
	for _, v := range []string{"0.4.0", "1.0.0", "1.1.0"} {
		t.Run(v, func(t *testing.T) {
			conf := `{"cniVersion":"` + v + `","name":"podnet","type":"bridge","ipam":{"type":"ipwarden","pools":["v4","v6"],"socket":"` + sock + `"}}`
			out, cerr := run(t, "ADD", conf)
			if cerr != nil {
				t.Fatal(cerr)
			}
			var res struct {
				CNIVersion string `json:"cniVersion"`
				IPs        []struct {
					Version string `json:"version"`
					Address string `json:"address"`
					Gateway string `json:"gateway"`
				} `json:"ips"`
				Routes []struct{ Dst, GW string } `json:"routes"`
			}
			if err := json.Unmarshal([]byte(out), &res); err != nil {
				t.Fatal(err)
			}
			if res.CNIVersion != v || len(res.IPs) != 2 || res.IPs[0].Address != "10.1.0.7/16" || res.IPs[0].Gateway != "10.1.0.1" ||
				res.IPs[1].Address != "fd01::7/64" || len(res.Routes) != 2 || res.Routes[1].GW != "10.1.0.254" {
				t.Fatalf("result %s", out)
			}
			if v == "0.4.0" && res.IPs[0].Version != "4" {
				t.Fatalf("0.4.0 result lacks the IP version field: %s", out)
			}
		})
	}
	r := (*reqs)[0]
	if r.Op != cniproto.OpAdd || r.ContainerID != "abc123" || r.IfName != "eth0" || r.Network != "podnet" ||
		strings.Join(r.Pools, ",") != "v4,v6" || r.Pod != (cniproto.Pod{Namespace: "ns", Name: "web", UID: "u1"}) {
		t.Fatalf("request %+v", r)
	}
}

func TestVerbsReachAgent(t *testing.T) {
	sock, reqs := fakeAgent(t, cniproto.Response{})
	conf := func(v string, extra string) string {
		return `{"cniVersion":"` + v + `","name":"podnet","type":"ipwarden","socket":"` + sock + `"` + extra + `}`
	}
	if _, e := run(t, "DEL", conf("1.1.0", "")); e != nil {
		t.Fatal(e)
	}
	prev := `,"prevResult":{"cniVersion":"1.1.0","ips":[{"address":"10.1.0.7/16"}]}`
	if _, e := run(t, "CHECK", conf("1.1.0", prev)); e != nil {
		t.Fatal(e)
	}
	gc := `,"cni.dev/valid-attachments":[{"containerID":"k1","ifname":"eth0"}]`
	if _, e := run(t, "GC", conf("1.1.0", gc)); e != nil {
		t.Fatal(e)
	}
	if _, e := run(t, "STATUS", conf("1.1.0", "")); e != nil {
		t.Fatal(e)
	}
	got := *reqs
	if len(got) != 4 || got[0].Op != cniproto.OpDel || got[1].Op != cniproto.OpCheck || got[2].Op != cniproto.OpGC || got[3].Op != cniproto.OpStatus {
		t.Fatalf("requests %+v", got)
	}
	if strings.Join(got[1].PrevAddresses, ",") != "10.1.0.7/16" {
		t.Fatalf("CHECK prevAddresses %v", got[1].PrevAddresses)
	}
	if len(got[2].ValidAttachments) != 1 || got[2].ValidAttachments[0] != (cniproto.AttachmentID{ContainerID: "k1", IfName: "eth0"}) ||
		got[2].Network != "podnet" || !got[2].HasValidAttachments {
		t.Fatalf("GC request %+v", got[2])
	}
}

// GC tells the agent whether the runtime sent a valid-attachments list at all (an empty list is
// a list; no list is no information), under either key libcni has used.
func TestGCListPresence(t *testing.T) {
	for _, tc := range []struct {
		name, extra string
		has         bool
		n           int
	}{
		{"no list (cnitool gc)", "", false, 0},
		{"null", `,"cni.dev/valid-attachments":null`, false, 0},
		{"empty list", `,"cni.dev/valid-attachments":[]`, true, 0},
		{"libcni before v1.2.3", `,"cni.dev/attachments":[{"containerID":"k","ifname":"eth0"}]`, true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseConfig([]byte(`{"cniVersion":"1.1.0","name":"n"` + tc.extra + `}`))
			if err != nil {
				t.Fatal(err)
			}
			if c.HasValidAttachments != tc.has || len(c.ValidAttachments) != tc.n {
				t.Fatalf("has %v, %d attachments", c.HasValidAttachments, len(c.ValidAttachments))
			}
		})
	}
}

func TestAllowNonKubernetes(t *testing.T) {
	for _, tc := range []struct {
		conf string
		want bool
		bad  bool
	}{
		{`{"name":"n"}`, false, false},
		{`{"name":"n","allowNonKubernetes":true}`, true, false},
		{`{"name":"n","ipam":{"type":"ipwarden","allowNonKubernetes":true}}`, true, false},
		{`{"name":"n","allowNonKubernetes":"yes"}`, false, true},
	} {
		c, err := parseConfig([]byte(tc.conf))
		if tc.bad {
			var te *types.Error
			if !errors.As(err, &te) || te.Code != types.ErrInvalidNetworkConfig || !strings.Contains(te.Msg, "allowNonKubernetes") {
				t.Fatalf("%s: %v", tc.conf, err)
			}
			continue
		}
		if err != nil || c.AllowNonKubernetes != tc.want {
			t.Fatalf("%s: %v %+v", tc.conf, err, c)
		}
	}
	sock, reqs := fakeAgent(t, cniproto.Response{})
	if _, e := run(t, "ADD", `{"cniVersion":"1.1.0","name":"podnet","ipam":{"type":"ipwarden","allowNonKubernetes":true,"socket":"`+sock+`"}}`); e != nil {
		t.Fatal(e)
	}
	if got := *reqs; len(got) != 1 || !got[0].NonKubernetes {
		t.Fatalf("requests %+v", got)
	}
}

// The plugin's own time limits sit below containerd's (the kubelet's 2m runtime request timeout
// for ADD, 1m deferred cleanup for DEL) and CRI-O's (5m ADD, 1m DEL), so the runtime gets a CNI
// error, not a killed plugin. A DEL delegated to the previous IPAM runs after the agent's, so the
// two limits together stay below 1m.
func TestTimeoutsBelowRuntimes(t *testing.T) {
	if addTimeout >= 2*time.Minute || otherTimeout+previousTimeout >= time.Minute {
		t.Fatalf("ADD %s, other verbs %s, previous IPAM %s", addTimeout, otherTimeout, previousTimeout)
	}
}

func TestErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope.sock")
	conf := `{"cniVersion":"1.1.0","name":"podnet","type":"ipwarden","socket":"` + missing + `"}`
	_, e := run(t, "ADD", conf)
	if e == nil || e.Code != types.ErrTryAgainLater || !strings.Contains(e.Msg, missing) {
		t.Fatalf("unreachable agent: %+v, want code 11 naming the socket", e)
	}
	if _, e := run(t, "STATUS", conf); e == nil || e.Code != types.ErrPluginNotAvailable || !strings.Contains(e.Msg, missing) {
		t.Fatalf("STATUS with an unreachable agent: %+v, want code 50", e)
	}
	if _, e := run(t, "ADD", `{"cniVersion":"1.1.0","name":"podnet","type":"ipwarden","pools":"v4"}`); e == nil || e.Code != types.ErrInvalidNetworkConfig || !strings.Contains(e.Msg, `"pools"`) {
		t.Fatalf("bad config: %+v, want code 7 naming pools", e)
	}
	sock, _ := fakeAgent(t, cniproto.Response{Error: &cniproto.Error{Code: 11, Msg: "no free address on node n: pool v4: pool v4 is exhausted"}})
	if _, e := run(t, "ADD", `{"cniVersion":"1.1.0","name":"podnet","type":"ipwarden","socket":"`+sock+`"}`); e == nil || e.Code != 11 || !strings.Contains(e.Msg, "pool v4 is exhausted") {
		t.Fatalf("agent error: %+v", e)
	}
}

func TestVersion(t *testing.T) {
	out, e := run(t, "VERSION", "")
	if e != nil {
		t.Fatal(e)
	}
	if !strings.Contains(out, `"1.1.0"`) || !strings.Contains(out, `"0.4.0"`) {
		t.Fatalf("VERSION %s", out)
	}
}

// FuzzParseConfig: any network configuration is either accepted or refused with a CNI decoding
// (6) or configuration (7) error; it never panics.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","ipam":{"type":"ipwarden","pools":["a"],"socket":"/run/x.sock"}}`))
	f.Add([]byte(`{"name":"n","pools":[1,2]}`))
	f.Add([]byte(`{"name":"n","ipam":[]}`))
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","ipam":{"type":"ipwarden","previous":{"type":"host-local","ranges":[[{"subnet":"10.85.0.0/16"}]]}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := parseConfig(data)
		if err != nil {
			var te *types.Error
			if !errors.As(err, &te) || (te.Code != types.ErrDecodingFailure && te.Code != types.ErrInvalidNetworkConfig) {
				t.Fatalf("error %v is not a CNI decoding or configuration error", err)
			}
			return
		}
		if c.Socket == "" {
			t.Fatal("accepted a configuration without a socket")
		}
		if (c.Previous == nil) != (c.PreviousType == "") || c.PreviousType == "ipwarden" {
			t.Fatalf("accepted previous %s of type %q", c.Previous, c.PreviousType)
		}
	})
}

// TestParseConfigClaimReference: args.cni "ipam-claim-reference" (Multus' cni-args) reaches the
// agent's request as the attachment's claim reference.
func TestParseConfigClaimReference(t *testing.T) {
	c, err := parseConfig([]byte(`{"cniVersion":"1.1.0","name":"n","type":"ipwarden","args":{"cni":{"ipam-claim-reference":"vm-a.net1"}}}`))
	if err != nil || c.ClaimReference != "vm-a.net1" {
		t.Fatalf("parseConfig: %+v, %v", c, err)
	}
	req := request(cniproto.OpAdd, &skel.CmdArgs{ContainerID: "c", IfName: "net1"}, c)
	if req.IPAMClaimReference != "vm-a.net1" {
		t.Fatalf("request %+v lacks the claim reference", req)
	}
}
