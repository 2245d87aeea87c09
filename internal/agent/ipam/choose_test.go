package ipam

import (
	"encoding/json"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

func TestParsePoolNames(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
		err  string
	}{
		{"blue-v4", []string{"blue-v4"}, ""},
		{" blue-v4 , blue-v6 ", []string{"blue-v4", "blue-v6"}, ""},
		{"a,,b", nil, "empty pool name"},
		{"a,", nil, "empty pool name"},
		{"Blue", nil, "is not an IPPool name"},
		{"a,a", nil, "listed twice"},
		{"a,b,c,d,e,f,g,h,i", nil, "at most 8"},
	} {
		got, err := ParsePoolNames(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParsePoolNames(%q) error = %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParsePoolNames(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

// The order of precedence: pod annotation, namespace annotation, CNI config, node.
func TestChoosePoolsPrecedence(t *testing.T) {
	ns := Namespace{Pools: "ns-v4"}
	for _, tc := range []struct {
		name   string
		meta   PodMeta
		config []string
		want   []string
		src    string
		err    string
	}{
		{"pod over namespace and config", PodMeta{Pools: "pod-v4,pod-v6", Namespace: ns, NamespaceKnown: true}, []string{"cfg"},
			[]string{"pod-v4", "pod-v6"}, SourcePod, ""},
		{"namespace over config", PodMeta{Namespace: ns, NamespaceKnown: true}, []string{"cfg"}, []string{"ns-v4"}, SourceNamespace, ""},
		{"unknown namespace: config", PodMeta{Namespace: ns}, []string{"cfg"}, []string{"cfg"}, SourceConfig, ""},
		{"config", PodMeta{NamespaceKnown: true}, []string{"cfg"}, []string{"cfg"}, SourceConfig, ""},
		{"node", PodMeta{NamespaceKnown: true}, nil, nil, SourceNode, ""},
		{"blank pod annotation is unset", PodMeta{Pools: "  ", Namespace: ns, NamespaceKnown: true}, nil, []string{"ns-v4"}, SourceNamespace, ""},
		{"malformed pod annotation is an error, not skipped", PodMeta{Pools: "a,,b", Namespace: ns, NamespaceKnown: true}, nil, nil, SourcePod, "empty pool name"},
		{"malformed namespace annotation", PodMeta{Namespace: Namespace{Pools: "A"}, NamespaceKnown: true}, []string{"cfg"}, nil, SourceNamespace, "not an IPPool name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, src, err := ChoosePools(tc.meta, tc.config)
			if src != tc.src {
				t.Errorf("source %q, want %q", src, tc.src)
			}
			if tc.err != "" {
				var pc *PoolChoiceError
				if !errors.As(err, &pc) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want a PoolChoiceError with %q", err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("= %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

// The state's resolution: served, namespaceSelector and one-per-family checks, and the default.
func TestChoosePoolsEnforced(t *testing.T) {
	blue4 := poolV4
	blue4.Name, blue4.NamespaceSelector = "blue-v4", "team=blue"
	blue6 := poolV6
	blue6.Name, blue6.NamespaceSelector = "blue-v6", "team=blue"
	other4 := poolV4
	other4.Name, other4.CIDRs = "other-v4", []netip.Prefix{netip.MustParsePrefix("10.9.0.0/24")}
	h := newHarness(t, poolV4, poolV6, blue4, blue6, other4)
	// far-v4 exists but does not select the node.
	h.s.SetPools([]Pool{poolV4, poolV6, blue4, blue6, other4, {Name: "far-v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.8.0.0/24")}}},
		[]string{"v4", "v6", "blue-v4", "blue-v6", "other-v4"})
	blueNS := Namespace{Labels: map[string]string{"team": "blue"}}
	redNS := Namespace{Labels: map[string]string{"team": "red"}}
	for _, tc := range []struct {
		name   string
		meta   PodMeta
		config []string
		want   []string
		err    string
	}{
		{"annotation in an admitted namespace", PodMeta{Pools: "blue-v4,blue-v6", Namespace: blueNS, NamespaceKnown: true}, nil,
			[]string{"blue-v4", "blue-v6"}, ""},
		{"annotation in a namespace the pool does not admit", PodMeta{Pools: "blue-v4", Namespace: redNS, NamespaceKnown: true}, nil,
			nil, `pool "blue-v4" may not be used by namespace "ns": its namespaceSelector "team=blue"`},
		{"namespace annotation is enforced too", PodMeta{Namespace: Namespace{Pools: "blue-v4", Labels: redNS.Labels}, NamespaceKnown: true}, nil,
			nil, "may not be used by namespace"},
		{"config is enforced too", PodMeta{Namespace: redNS, NamespaceKnown: true}, []string{"blue-v4"}, nil, "may not be used by namespace"},
		{"unknown namespace: a pool with a selector admits nothing", PodMeta{Pools: "blue-v4"}, nil, nil, "may not be used"},
		{"pool that does not exist", PodMeta{Pools: "nope", NamespaceKnown: true}, nil, nil, `pool "nope" is not an IPPool the agent knows`},
		{"pool that does not select the node", PodMeta{Pools: "far-v4", NamespaceKnown: true}, nil, nil, `pool "far-v4" does not serve node node-a`},
		{"two of one family", PodMeta{Pools: "v4,other-v4", NamespaceKnown: true}, nil, nil, "one address family"},
		{"default leaves out pools the namespace may not use", PodMeta{Namespace: redNS, NamespaceKnown: true}, nil,
			[]string{"other-v4", "v4", "v6"}, ""},
		{"default in an admitted namespace", PodMeta{Namespace: blueNS, NamespaceKnown: true}, nil,
			[]string{"blue-v4", "other-v4", "v4", "blue-v6", "v6"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := h.s.ResolvePools(AddRequest{Pod: PodRef{Namespace: "ns", Name: "p"}, Pools: tc.config, Meta: tc.meta})
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("= %v, %v; want %v", got, err, tc.want)
			}
		})
	}

	// ADD refused: nothing handed out.
	h.hold("blue-v4", "10.0.0.0/28")
	_, _, err := h.s.Add(AddRequest{Key: key("c1"), Pod: PodRef{"ns", "p", "u1"}, Meta: PodMeta{Pools: "blue-v4", Namespace: redNS, NamespaceKnown: true}}, h.now)
	if err == nil || h.s.NumAttachments() != 0 {
		t.Fatalf("ADD in a namespace the pool refuses: %v, %d attachments", err, h.s.NumAttachments())
	}
}

// Demand counts each pod bound to the node in the pools its ADD will draw from.
func TestDemandFollowsPoolChoice(t *testing.T) {
	blue4 := poolV4
	blue4.Name, blue4.NamespaceSelector = "blue-v4", "team=blue"
	h := newHarness(t, poolV4, blue4)
	h.s.SetNamespaces(map[string]Namespace{
		"blue": {Labels: map[string]string{"team": "blue"}},
		"red":  {Labels: map[string]string{"team": "red"}},
		"pick": {Labels: map[string]string{"team": "blue"}, Pools: "blue-v4"},
	})
	h.s.SetPods([]Pod{
		{Ref: PodRef{"red", "a", "ua"}},                        // v4 only: blue-v4 does not admit red
		{Ref: PodRef{"blue", "b", "ub"}},                       // both (the default)
		{Ref: PodRef{"blue", "c", "uc"}, Pools: "v4"},          // v4 by annotation
		{Ref: PodRef{"pick", "d", "ud"}},                       // blue-v4 by namespace annotation
		{Ref: PodRef{"red", "e", "ue"}, Pools: "blue-v4"},      // refused: counts nowhere
		{Ref: PodRef{"unknown", "f", "uf"}},                    // unknown namespace: v4 only
		{Ref: PodRef{"blue", "g", "ug"}, Pools: "bad,,"},       // malformed: counts nowhere
		{Ref: PodRef{"blue", "h", "uh"}, Pools: "blue-v4,v4"},  // two of one family: nowhere
		{Ref: PodRef{"blue", "i", "ui"}, Pools: "blue-v4"},     // blue-v4
		{Ref: PodRef{"blue", "j", "uj"}, HostNetwork: true},    // no address
		{Ref: PodRef{"blue", "k", "uk"}, Pools: "blue-v4"},     // blue-v4
		{Ref: PodRef{"blue", "l", "ul"}, Deleting: true},       // no new address
		{Ref: PodRef{"red", "m", "um"}, Pools: " v4 "},         // v4
		{Ref: PodRef{"pick", "n", "un"}, Pools: "v4"},          // pod over namespace: v4
		{Ref: PodRef{"blue", "o", "uo"}, Finished: true},       // none
		{Ref: PodRef{"red", "p", "up"}, Pools: "nonexistent"},  // refused
		{Ref: PodRef{"blue", "q", "uq"}, IPs: nil, Pools: ""},  // both
		{Ref: PodRef{"red", "r", "ur"}, Pools: "v4,blue-v4,x"}, // refused (blue-v4)
	})
	if got, want := h.s.Demand("v4"), 7; got != want { // a b c f m n q
		t.Errorf("demand v4 = %d, want %d", got, want)
	}
	if got, want := h.s.Demand("blue-v4"), 5; got != want { // b d i k q
		t.Errorf("demand blue-v4 = %d, want %d", got, want)
	}
}

// Once an ADD on eth0 brought the pod network configuration's "pools", a bound pod without
// annotations counts where its ADD will draw (the configuration's pools), not in every pool that
// selects the node; a secondary interface's configuration changes nothing. It survives a restart.
func TestDemandFollowsTheConfigPools(t *testing.T) {
	other := poolV4
	other.Name, other.CIDRs, other.Gateway = "other-v4", []netip.Prefix{netip.MustParsePrefix("10.0.1.0/24")}, ip("10.0.1.1")
	h := newHarness(t, poolV4, other)
	h.hold("v4", "10.0.0.2-10.0.0.9")
	h.s.SetPods([]Pod{{Ref: PodRef{"ns", "a", "ua"}}, {Ref: PodRef{"ns", "b", "ub"}}})
	if v4, o := h.s.Demand("v4"), h.s.Demand("other-v4"); v4 != 2 || o != 2 {
		t.Fatalf("before any ADD: demand v4 %d, other-v4 %d; want 2 and 2 (every pool that selects the node)", v4, o)
	}
	add := func(cid, ifname string, pools ...string) {
		t.Helper()
		_, ch, err := h.s.Add(AddRequest{Key: Key{ContainerID: cid, IfName: ifname}, Pod: PodRef{"ns", cid, "u" + cid}, Pools: pools}, h.now)
		if err != nil {
			t.Fatal(err)
		}
		h.commit(ch)
		h.s.ConfirmAdd(Key{ContainerID: cid, IfName: ifname})
	}
	add("z", "eth0", "v4")
	if v4, o := h.s.Demand("v4"), h.s.Demand("other-v4"); v4 != 3 || o != 0 {
		t.Fatalf("after an ADD with pools [v4]: demand v4 %d, other-v4 %d; want 3 (a, b and z) and 0", v4, o)
	}
	h.hold("other-v4", "10.0.1.2-10.0.1.9")
	add("y", "net1", "other-v4")
	if v4, o := h.s.Demand("v4"), h.s.Demand("other-v4"); v4 != 3 || o != 1 {
		t.Fatalf("after an ADD on net1 with pools [other-v4]: demand v4 %d, other-v4 %d; want 3 and 1 (y's address only)", v4, o)
	}
	h.restart()
	h.s.SetPods([]Pod{{Ref: PodRef{"ns", "a", "ua"}}, {Ref: PodRef{"ns", "b", "ub"}}})
	if v4, o := h.s.Demand("v4"), h.s.Demand("other-v4"); v4 != 3 || o != 1 {
		t.Fatalf("after a restart: demand v4 %d, other-v4 %d; want 3 and 1 (the journaled configuration's pools)", v4, o)
	}
}

func TestParseStaticAddresses(t *testing.T) {
	for _, tc := range []struct {
		in  string
		n   int
		err string
	}{
		{"10.0.5.20", 1, ""},
		{" 10.0.5.20 , fd00::20 ", 2, ""},
		{"10.0.5.20,10.0.5.21", 0, "two addresses of one family"},
		{"10.0.5", 0, "is not an IP address"},
		{"10.0.5.20/32", 0, "is not an IP address"},
		{"fe80::1%eth0", 0, "is not an IP address"},
		{"1.1.1.1,2.2.2.2,fd00::1", 0, "at most one IPv4"},
	} {
		got, err := ParseStaticAddresses(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseStaticAddresses(%q) error = %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || len(got) != tc.n {
			t.Errorf("ParseStaticAddresses(%q) = %v, %v", tc.in, got, err)
		}
	}
}

// A static address: taken when held and free; waited for (and wanted in the spec) when not held;
// refused with the controller's reason; never taken from another attachment; never handed to
// another pod nor given back while wanted; malformed, outside or excluded: a clear error.
func TestStaticAddresses(t *testing.T) {
	p4 := poolV4
	p4.Exclude = []netip.Prefix{netip.MustParsePrefix("10.0.0.50/32")}
	h := newHarness(t, p4, poolV6)
	h.hold("v4", "10.0.0.2-10.0.0.5")
	h.hold("v6", "fd00::1-fd00::4")
	static := func(cid, ips string) (Attachment, error) {
		a, ch, err := h.s.Add(AddRequest{Key: key(cid), Pod: PodRef{"ns", cid, "uid-" + cid}, Meta: PodMeta{IPAddresses: ips, NamespaceKnown: true}}, h.now)
		if err == nil {
			h.commit(ch)
			h.s.ConfirmAdd(key(cid))
		}
		return a, err
	}
	// Held and free: taken, the other family dynamic.
	a, err := static("s1", "10.0.0.4")
	if err != nil || a.Addresses[0].Addr != ip("10.0.0.4") || a.Addresses[1].Pool != "v6" {
		t.Fatalf("static held address: %v, %v", a, err)
	}
	// In use by another attachment: refused, nothing taken.
	if _, err := static("s2", "10.0.0.4"); err == nil || !strings.Contains(err.Error(), "in use by pod ns/s1") {
		t.Fatalf("static address in use: %v", err)
	}
	var su *StaticUnavailableError
	if _, err := static("s2", "10.0.0.4"); !errors.As(err, &su) {
		t.Fatalf("in use: %T, want *StaticUnavailableError", err)
	}
	// Not held: the ADD waits and the node wants it; another pod never gets it once granted.
	_, err = static("s3", "10.0.0.9")
	var short *ShortError
	if !errors.As(err, &short) || len(short.Wanted) != 1 || short.Wanted[0].Addr != ip("10.0.0.9") {
		t.Fatalf("static address not held: %v", err)
	}
	h.s.AddWaiter(key("s3"), "uid-s3", []string{"v4", "v6"}, short.Wanted...)
	if spec := h.s.Spec(); !spec[0].Wanted.Contains(ip("10.0.0.9")) {
		t.Fatalf("spec %+v does not want 10.0.0.9", spec)
	}
	h.hold("v4", "10.0.0.2-10.0.0.5", "10.0.0.9")
	if rel := h.s.Release(h.now); rel.Marked["v4"].Contains(ip("10.0.0.9")) {
		t.Fatalf("gave back the wanted address: %v", rel.Marked)
	}
	if a := h.mustAdd("other"); a[0] == "10.0.0.9/24" {
		t.Fatalf("another pod got the wanted address")
	}
	if a, err := static("s3", "10.0.0.9"); err != nil || a.Addresses[0].Addr != ip("10.0.0.9") {
		t.Fatalf("static address after the grant: %v, %v", a, err)
	}
	// Refused by the controller: the ADD fails with its reason.
	h.s.SetRefused(map[string]map[netip.Addr]string{"v4": {ip("10.0.0.7"): "held by node b"}})
	if _, err := static("s4", "10.0.0.7"); !errors.As(err, &su) || !strings.Contains(err.Error(), "held by node b") {
		t.Fatalf("refused static address: %v", err)
	}
	for _, tc := range []struct{ ips, want string }{
		{"10.0.0", "is not an IP address"},
		{"10.9.0.1", "outside every pool the pod may use"},
		{"10.0.0.50", "excluded from pool v4"},
		{"10.0.0.1", "excluded from pool v4"}, // the gateway
		{"10.0.0.255", "excluded from pool v4"},
	} {
		if _, err := static("bad", tc.ips); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("static %q: %v, want %q", tc.ips, err, tc.want)
		}
	}
	// Wanted elsewhere: a free one is given back whatever the target and never handed out; one
	// in use stays.
	h.s.SetWantedElsewhere(map[string]addr.Set{"v4": set(t, "10.0.0.2-10.0.0.4")})
	rel := h.s.Release(h.now)
	if !rel.Marked["v4"].Equal(set(t, "10.0.0.3")) {
		t.Fatalf("released %v: want the free 10.0.0.3, never 10.0.0.2 and 10.0.0.4 (in use)", rel.Marked["v4"])
	}
	if _, err := h.add("more", "v4"); err == nil {
		if a, _ := h.s.Attachment(key("more")); set(t, "10.0.0.2-10.0.0.4").Contains(a.Addresses[0].Addr) {
			t.Fatalf("handed out %v, wanted elsewhere", a.Addresses)
		}
		h.del("more")
	}
	if h.s.NumAttachments() != 3 {
		t.Fatalf("%d attachments, want 3 (s1, other, s3)", h.s.NumAttachments())
	}
}

// An attachment draws only from pools of the network its configuration names; the pod's
// annotations choose the pod network's pools only. Two attachments of one pod (eth0 and net1)
// are independent.
func TestChoosePoolsByNetwork(t *testing.T) {
	storage := poolV4
	storage.Name, storage.Network = "storage", "storage"
	h := newHarness(t, poolV4, storage)
	h.hold("v4", "10.0.0.2-10.0.0.5")
	h.hold("storage", "10.0.0.2-10.0.0.5") // the same addresses, on another network
	add := func(ifname, network string, config ...string) (Attachment, error) {
		a, ch, err := h.s.Add(AddRequest{Key: Key{"c1", ifname}, Pod: PodRef{"ns", "p", "u1"}, Pools: config, PoolNetwork: network,
			Meta: PodMeta{Pools: "v4", NamespaceKnown: true}}, h.now)
		if err == nil {
			h.commit(ch)
			h.s.ConfirmAdd(Key{"c1", ifname})
		}
		return a, err
	}
	eth0, err := add("eth0", "")
	if err != nil || len(eth0.Addresses) != 1 || eth0.Addresses[0].Pool != "v4" {
		t.Fatalf("eth0: %v, %v", eth0, err)
	}
	net1, err := add("net1", "storage")
	if err != nil || len(net1.Addresses) != 1 || net1.Addresses[0].Pool != "storage" || net1.Addresses[0].Addr != eth0.Addresses[0].Addr {
		t.Fatalf("net1: %v, %v (want storage's lowest, the same address as eth0's on another network)", net1, err)
	}
	if _, err := add("net2", "storage", "v4"); err == nil || !strings.Contains(err.Error(), `pool "v4" is on network "", this attachment on network "storage"`) {
		t.Fatalf("a pod-network pool on a storage attachment: %v", err)
	}
	if _, err := add("net3", "nowhere"); err == nil || !strings.Contains(err.Error(), `no pool of network "nowhere"`) {
		t.Fatalf("a network without pools: %v", err)
	}
	plan, _ := h.s.PlanDel(Key{"c1", "net1"}, h.now)
	h.s.ApplyDel(plan)
	if a, ok := h.s.Attachment(Key{"c1", "eth0"}); !ok || a.Addresses[0] != eth0.Addresses[0] {
		t.Fatalf("DEL of net1 touched eth0: %v %v", a, ok)
	}
}

// A sticky pod gets its identity's reserved address as a static address; no other pod gets a
// reserved address; a sticky pod's address the record lacks is reported in the spec.
func TestStickyAddresses(t *testing.T) {
	web0 := sticky.Identity{Namespace: "ns", StatefulSet: "web", Ordinal: 0}
	web1 := sticky.Identity{Namespace: "ns", StatefulSet: "web", Ordinal: 1}
	p4 := poolV4
	p4.Sticky = true
	p4.Reserved = []StickyUse{{Identity: web0, Addr: ip("10.0.0.2")}}
	h := newHarness(t, p4)
	h.hold("v4", "10.0.0.2-10.0.0.9")
	// An ordinary pod never gets the reserved 10.0.0.2.
	if a := h.mustAdd("plain"); a[0] == "10.0.0.2" {
		t.Fatalf("ordinary pod got a reserved address")
	}
	add := func(cid string, id sticky.Identity) (Attachment, error) {
		a, ch, err := h.s.Add(AddRequest{Key: key(cid), Pod: PodRef{"ns", cid, "uid-" + cid}, Meta: PodMeta{Identity: id, NamespaceKnown: true}}, h.now)
		if err == nil {
			h.commit(ch)
			h.s.ConfirmAdd(key(cid))
		}
		return a, err
	}
	if a, err := add("web-0", web0); err != nil || a.Addresses[0].Addr != ip("10.0.0.2") {
		t.Fatalf("web-0: %v, %v", a, err)
	}
	// web-1 has no reservation yet: an ordinary address, reported for the record.
	a1, err := add("web-1", web1)
	if err != nil {
		t.Fatal(err)
	}
	h.s.SetPods([]Pod{{Ref: PodRef{"ns", "web-0", "uid-web-0"}, Identity: web0}, {Ref: PodRef{"ns", "web-1", "uid-web-1"}, Identity: web1}})
	spec := h.s.Spec()
	if len(spec[0].Sticky) != 1 || spec[0].Sticky[0] != (StickyUse{Identity: web1, Addr: a1.Addresses[0].Addr}) {
		t.Fatalf("spec sticky %+v, want web-1's %v only", spec[0].Sticky, a1.Addresses)
	}
	// Not sticky (pool not sticky, pod not opted in): no reservation used, nothing reported.
	h.s.SetPools([]Pool{poolV4}, []string{"v4"})
	if spec := h.s.Spec(); len(spec[0].Sticky) != 0 {
		t.Fatalf("non-sticky pool reports %+v", spec[0].Sticky)
	}
}

// The reservations are part of the journaled pool settings: an agent restarted from its journal
// alone (the API server away) still keeps a reserved address out of ordinary ADDs and hands it
// to its identity's pod. The pool settings go through JSON as the journal stores them.
func TestStickyReservationsSurviveARestart(t *testing.T) {
	web0 := sticky.Identity{Namespace: "ns", StatefulSet: "web", Ordinal: 0}
	p4 := poolV4
	p4.Sticky = true
	p4.Reserved = []StickyUse{{Identity: web0, Addr: ip("10.0.0.2")}}
	h := newHarness(t, p4)
	h.hold("v4", "10.0.0.2-10.0.0.9")
	raw, err := json.Marshal(h.snap.Pools)
	if err != nil {
		t.Fatal(err)
	}
	h.snap.Pools = nil
	if err := json.Unmarshal(raw, &h.snap.Pools); err != nil {
		t.Fatal(err)
	}
	old := h.s
	h.s = New(old.node)
	if problems := h.s.Restore(h.snap); len(problems) > 0 {
		t.Fatalf("restore: %v", problems)
	}
	if a := h.mustAdd("plain"); a[0] == "10.0.0.2" {
		t.Fatal("after a restart from the journal an ordinary pod got the reserved address")
	}
	a, ch, err := h.s.Add(AddRequest{Key: key("web-0"), Pod: PodRef{"ns", "web-0", "uid-web-0"}, Meta: PodMeta{Identity: web0, NamespaceKnown: true}}, h.now)
	if err != nil {
		t.Fatal(err)
	}
	h.commit(ch)
	if a.Addresses[0].Addr != ip("10.0.0.2") {
		t.Fatalf("after a restart from the journal web-0 got %v, want its reserved 10.0.0.2", a.Addresses)
	}
}
