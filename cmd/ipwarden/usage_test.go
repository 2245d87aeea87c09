package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/ipwarden/ipwarden/internal/usage"
)

// Installed as kubectl-ipwarden, the binary is a kubectl plugin and names itself so.
func TestPluginName(t *testing.T) {
	for _, tc := range []struct{ argv0, want string }{
		{"/usr/local/bin/kubectl-ipwarden", "kubectl ipwarden"},
		{"kubectl-ipwarden", "kubectl ipwarden"},
		{"/usr/local/bin/ipwarden", "ipwarden"},
		{"./ipwarden", "ipwarden"},
	} {
		root := newRootCommand()
		pluginName(root, tc.argv0)
		if got := root.DisplayName(); got != tc.want {
			t.Errorf("argv[0] %q: display name %q, want %q", tc.argv0, got, tc.want)
		}
	}
}

func TestUsageTables(t *testing.T) {
	var b bytes.Buffer
	if err := writePools(&b, []usage.Pool{{Name: "v4", Capacity: 254, Allocated: 20, Held: 16, InUse: 9, Free: 234, Cooling: 4, Reserved: 2},
		{Name: "bad", Invalid: "spec.cidrs is empty"}}, "text"); err != nil {
		t.Fatal(err)
	}
	want := `POOL                                 CAPACITY   ALLOCATED   IN USE   FREE   COOLING   RESERVED   EXHAUSTED   NODES
v4                                   254        20          9        234    4         2          false       0
bad (invalid: spec.cidrs is empty)   0          0           0        0      0         0          false       0
`
	if b.String() != want {
		t.Errorf("pools table:\n%s\nwant:\n%s", b.String(), want)
	}
	b.Reset()
	if err := writeNodes(&b, []usage.Node{{Node: "n1", Pool: "v4", Held: 16, InUse: 9, Requested: 16, Runs: 1, Source: usage.FromPods}}, "text"); err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(b.String(), "\n"); !strings.HasPrefix(lines[0], "NODE   POOL   HELD   IN USE   REQUESTED   RELEASING   RUNS   SOURCE") ||
		!strings.HasPrefix(lines[1], "n1     v4     16     9        16          0           1      pods") {
		t.Errorf("nodes table:\n%s", b.String())
	}
	b.Reset()
	if err := writePools(&b, nil, "json"); err != nil || strings.TrimSpace(b.String()) != "{\n  \"pools\": []\n}" {
		t.Errorf("empty JSON: %q %v", b.String(), err)
	}
	b.Reset()
	if err := writeWho(&b, usage.Who{Address: "10.0.0.5", Pool: "v4", State: usage.StateHeld, Nodes: []string{"n1"},
		Holders: []usage.Holder{{Node: "n1", Pod: "default/web"}}, Detail: "held by node n1, used by default/web"}, "text"); err != nil {
		t.Fatal(err)
	}
	want = `ADDRESS    POOL   STATE   NODE   POD           DETAIL
10.0.0.5   v4     held    n1     default/web   held by node n1, used by default/web
`
	if b.String() != want {
		t.Errorf("who table:\n%s\nwant:\n%s", b.String(), want)
	}
}
