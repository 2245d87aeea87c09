package handback

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func ips(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

const hostLocal24 = `{"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24", "rangeStart": "10.244.0.10", "rangeEnd": "10.244.0.15", "gateway": "10.244.0.1"}]]}`

func TestPlan(t *testing.T) {
	podA := Attachment{ContainerID: "aaaa", IfName: "eth0", Pod: "ns/a", Addresses: ips("10.244.0.10")}
	podB := Attachment{ContainerID: "bbbb", IfName: "eth0", Pod: "ns/b", Addresses: ips("10.244.0.11")}
	outside := Attachment{ContainerID: "cccc", IfName: "eth0", Pod: "ns/c", Addresses: ips("10.244.0.20")}
	gw := Attachment{ContainerID: "dddd", IfName: "eth0", Pod: "ns/d", Addresses: ips("10.244.0.1")}
	dual := Attachment{ContainerID: "eeee", IfName: "eth0", Pod: "ns/e", Addresses: ips("10.244.0.12", "fd00::10")}
	rebuilt := Attachment{ContainerID: "rebuilt:uid-f", IfName: "-", Pod: "ns/f", Addresses: ips("10.244.0.13"), Rebuilt: true}
	for _, tc := range []struct {
		name     string
		target   string
		atts     []Attachment
		existing map[string]string
		want     []string // "address=content"
		refuse   []string // substrings of the error
	}{
		{name: "empty node", target: hostLocal24, want: nil},
		{name: "inside the range", target: hostLocal24, atts: []Attachment{podB, podA},
			want: []string{"10.244.0.10=aaaa\r\neth0", "10.244.0.11=bbbb\r\neth0"}},
		{name: "outside the range refuses, naming the pod", target: hostLocal24, atts: []Attachment{podA, outside},
			refuse: []string{"nothing written", "pod ns/c uses 10.244.0.20, outside every range", "10.244.0.10-10.244.0.15 of 10.244.0.0/24"}},
		{name: "inside the subnet before rangeStart refuses", target: hostLocal24,
			atts: []Attachment{{ContainerID: "x", IfName: "eth0", Pod: "ns/x", Addresses: ips("10.244.0.9")}}, refuse: []string{"pod ns/x uses 10.244.0.9"}},
		{name: "the gateway refuses", target: `{"type": "host-local", "subnet": "10.244.0.0/24"}`, atts: []Attachment{gw},
			refuse: []string{"10.244.0.1, the gateway"}},
		{name: "legacy top-level subnet with defaults", target: `{"type": "host-local", "subnet": "10.244.0.0/24"}`, atts: []Attachment{podA, outside},
			want: []string{"10.244.0.10=aaaa\r\neth0", "10.244.0.20=cccc\r\neth0"}},
		{name: "legacy subnet excludes the IPv4 broadcast address", target: `{"type": "host-local", "subnet": "10.244.0.0/24"}`,
			atts: []Attachment{{ContainerID: "x", IfName: "eth0", Addresses: ips("10.244.0.255")}}, refuse: []string{"container x interface eth0 uses 10.244.0.255"}},
		{name: "legacy subnet and ranges together", target: `{"type": "host-local", "subnet": "10.244.0.0/28", "ranges": [[{"subnet": "10.244.1.0/24"}]]}`,
			atts: []Attachment{podA, {ContainerID: "y", IfName: "eth0", Addresses: ips("10.244.1.7")}},
			want: []string{"10.244.0.10=aaaa\r\neth0", "10.244.1.7=y\r\neth0"}},
		{name: "IPv6 and dual-stack", target: `{"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}], [{"subnet": "fd00::/64", "rangeStart": "fd00::10"}]]}`,
			atts: []Attachment{dual}, want: []string{"10.244.0.12=eeee\r\neth0", "fd00::10=eeee\r\neth0"}},
		{name: "IPv6 outside refuses", target: `{"type": "host-local", "ranges": [[{"subnet": "fd00::/64", "rangeStart": "fd00::11"}]]}`,
			atts: []Attachment{{ContainerID: "z", IfName: "eth0", Pod: "ns/z", Addresses: ips("fd00::10")}}, refuse: []string{"pod ns/z uses fd00::10"}},
		{name: "an identical existing file is kept", target: hostLocal24, atts: []Attachment{podA, podB},
			existing: map[string]string{"10.244.0.10": "aaaa\r\neth0"}, want: []string{"10.244.0.11=bbbb\r\neth0"}},
		{name: "an existing file for another container refuses", target: hostLocal24, atts: []Attachment{podA, podB},
			existing: map[string]string{"10.244.0.11": "other\r\neth0"}, refuse: []string{`pod ns/b uses 10.244.0.11, which host-local already reserves for container "other"`}},
		{name: "an existing file of another interface refuses", target: hostLocal24, atts: []Attachment{podA},
			existing: map[string]string{"10.244.0.10": "aaaa\r\nnet1"}, refuse: []string{"already reserves"}},
		{name: "a rebuilt attachment with host-local's own file", target: hostLocal24, atts: []Attachment{rebuilt, podA},
			existing: map[string]string{"10.244.0.13": "sandbox-f\r\neth0"}, want: []string{"10.244.0.10=aaaa\r\neth0"}},
		{name: "a rebuilt attachment without a file refuses", target: hostLocal24, atts: []Attachment{rebuilt},
			refuse: []string{"pod ns/f uses 10.244.0.13", "delete the pod first"}},
		{name: "whereabouts refuses: drain", target: `{"type": "whereabouts", "range": "10.244.0.0/24"}`, atts: []Attachment{podA},
			refuse: []string{`IPAM type "whereabouts"`, "IPPool objects", "drain the node"}},
		{name: "another IPAM refuses", target: `{"type": "calico-ipam"}`, refuse: []string{`IPAM type "calico-ipam"`, "drain the node"}},
		{name: "no type", target: `{"ranges": [[{"subnet": "10.244.0.0/24"}]]}`, refuse: []string{`no "type"`}},
		{name: "no ranges", target: `{"type": "host-local"}`, refuse: []string{"no ranges"}},
		{name: "not JSON", target: `{"type": "host-local",`, refuse: []string{"not a JSON object"}},
		{name: "two objects", target: hostLocal24 + `{}`, refuse: []string{"data after"}},
		{name: "host bits", target: `{"type": "host-local", "subnet": "10.244.0.5/24"}`, refuse: []string{"host bits"}},
		{name: "too small", target: `{"type": "host-local", "subnet": "10.244.0.4/31"}`, refuse: []string{"too small"}},
		{name: "start outside the subnet", target: `{"type": "host-local", "subnet": "10.244.0.0/24", "rangeStart": "10.244.1.1"}`, refuse: []string{"rangeStart 10.244.1.1 is not in subnet"}},
		{name: "end before start", target: `{"type": "host-local", "subnet": "10.244.0.0/24", "rangeStart": "10.244.0.9", "rangeEnd": "10.244.0.8"}`, refuse: []string{"before rangeStart"}},
		{name: "too large", target: `{"type": "host-local", "x": "` + strings.Repeat("a", MaxConfig) + `"}`, refuse: []string{"at most 16384"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			existing := map[netip.Addr]string{}
			for a, c := range tc.existing {
				existing[netip.MustParseAddr(a)] = c
			}
			var files []File
			target, err := ParseTarget([]byte(tc.target))
			if err == nil {
				files, err = Plan(tc.atts, target, existing)
			}
			if len(tc.refuse) > 0 {
				if err == nil {
					t.Fatalf("planned %v, want a refusal", files)
				}
				for _, s := range tc.refuse {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q lacks %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, f := range files {
				got = append(got, f.Addr.String()+"="+f.Content())
			}
			if strings.Join(got, "|") != strings.Join(tc.want, "|") {
				t.Fatalf("files %q, want %q", got, tc.want)
			}
		})
	}
}

// The refusal of an IPAM other than host-local is typed, for callers that tell it apart.
func TestUnsupportedIsTyped(t *testing.T) {
	_, err := ParseTarget([]byte(`{"type": "whereabouts"}`))
	var ue *UnsupportedError
	if !errors.As(err, &ue) || ue.Type != "whereabouts" {
		t.Fatalf("error %v, want an *UnsupportedError for whereabouts", err)
	}
}

func TestTargetDir(t *testing.T) {
	if d := (Target{}).Dir("net"); d != "/var/lib/cni/networks/net" {
		t.Fatalf("default dir %s", d)
	}
	if d := (Target{DataDir: "/x/"}).Dir("net"); d != "/x/net" {
		t.Fatalf("dir %s", d)
	}
}

// Write creates the files with host-local's content and mode, never overwrites one, and leaves
// nothing of its own behind when it fails; ReadExisting reads them back, skipping host-local's
// other files.
func TestWriteAndReadExisting(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "net")
	unlock, err := Lock(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if err := os.WriteFile(filepath.Join(dir, "last_reserved_ip.0"), []byte("10.244.0.9"), 0o600); err != nil {
		t.Fatal(err)
	}
	files := []File{{Addr: netip.MustParseAddr("10.244.0.10"), ContainerID: "aaaa", IfName: "eth0"},
		{Addr: netip.MustParseAddr("fd00::10"), ContainerID: "bbbb", IfName: "eth0"}}
	created, err := Write(dir, files)
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 2 {
		t.Fatalf("created %v", created)
	}
	fi, err := os.Stat(filepath.Join(dir, "10.244.0.10"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("stat: %v %v", fi, err)
	}
	got, err := ReadExisting(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[netip.MustParseAddr("10.244.0.10")] != "aaaa\r\neth0" || got[netip.MustParseAddr("fd00::10")] != "bbbb\r\neth0" {
		t.Fatalf("read back %q", got)
	}
	// A second write of an address that exists fails, overwrites nothing, and removes what it
	// created before the failure.
	again := []File{{Addr: netip.MustParseAddr("10.244.0.11"), ContainerID: "cccc", IfName: "eth0"},
		{Addr: netip.MustParseAddr("10.244.0.10"), ContainerID: "dddd", IfName: "eth0"}}
	if _, err := Write(dir, again); err == nil || !strings.Contains(err.Error(), "nothing was overwritten") {
		t.Fatalf("overwrite: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "10.244.0.10")); string(b) != "aaaa\r\neth0" {
		t.Fatalf("10.244.0.10 holds %q after a refused overwrite", b)
	}
	if _, err := os.Stat(filepath.Join(dir, "10.244.0.11")); !os.IsNotExist(err) {
		t.Fatalf("10.244.0.11 left behind: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if strings.Join(names, " ") != "10.244.0.10 fd00::10 last_reserved_ip.0 lock" {
		t.Fatalf("directory holds %v", names)
	}
	missing, err := ReadExisting(filepath.Join(dir, "none"))
	if err != nil || len(missing) != 0 {
		t.Fatalf("missing dir: %v %v", missing, err)
	}
}

func TestStale(t *testing.T) {
	a := Attachment{ContainerID: "aaaa", IfName: "eth0", Addresses: ips("10.244.0.10", "fd00::10")}
	b := Attachment{ContainerID: "bbbb", IfName: "eth0", Addresses: ips("10.244.0.11")}
	r := Attachment{ContainerID: "rebuilt:u", IfName: "-", Addresses: ips("10.244.0.12"), Rebuilt: true}
	existing := map[netip.Addr]string{
		netip.MustParseAddr("10.244.0.10"): "aaaa\r\neth0",
		netip.MustParseAddr("fd00::10"):    "aaaa\r\neth0",
		netip.MustParseAddr("10.244.0.11"): "cccc\r\neth0", // host-local handed it to another container
		netip.MustParseAddr("10.244.0.12"): "sandbox\r\neth0",
	}
	got := Stale([]Attachment{b, a, r}, existing)
	if fmt.Sprint(got) != "[10.244.0.10 fd00::10]" {
		t.Fatalf("stale %v, want [10.244.0.10 fd00::10]", got)
	}
	if got := Stale(nil, existing); len(got) != 0 {
		t.Fatalf("stale without freed attachments: %v", got)
	}
}

// Release removes only the files naming the freed attachment, and creates nothing.
func TestRelease(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "net")
	if got, err := Release(dir, []Attachment{{ContainerID: "a", IfName: "eth0", Addresses: ips("10.244.0.10")}}); err != nil || len(got) != 0 {
		t.Fatalf("release in a missing directory: %v %v", got, err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("Release created %s", dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]string{"10.244.0.10": "aaaa\r\neth0", "10.244.0.11": "other\r\neth0"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	got, err := Release(dir, []Attachment{{ContainerID: "aaaa", IfName: "eth0", Addresses: ips("10.244.0.10")},
		{ContainerID: "bbbb", IfName: "eth0", Addresses: ips("10.244.0.11")}})
	if err != nil || fmt.Sprint(got) != "[10.244.0.10]" {
		t.Fatalf("released %v %v", got, err)
	}
	left, _ := ReadExisting(dir)
	if len(left) != 1 || left[netip.MustParseAddr("10.244.0.11")] != "other\r\neth0" {
		t.Fatalf("left %q", left)
	}
}
