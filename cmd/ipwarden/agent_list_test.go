package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// `ipwarden agent list` shows the unattributed hold after a rebuild: how many addresses, until
// when, and which pods it waits for.
func TestPrintListShowsTheHold(t *testing.T) {
	resp := &cniproto.Response{Node: "n1",
		Pools: []cniproto.PoolStatus{{Pool: "v4", Served: true, Held: 8, InUse: 1, Adopted: 1, Unattributed: 7}},
		Hold: &cniproto.Hold{Until: time.Date(2026, 1, 1, 0, 5, 0, 0, time.UTC), Addresses: 7,
			WaitingFor: []string{"default/web"}, MoreWaiting: 2}}
	var b bytes.Buffer
	if err := printList(&b, resp); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"UNATTRIBUTED", "ADOPTED", "PREVIOUS", "HOLD 7 addresses of unknown owner", "2026-01-01T00:05:00Z", "waiting for default/web and 2 more"} {
		if !strings.Contains(out, want) {
			t.Fatalf("output lacks %q:\n%s", want, out)
		}
	}
	b.Reset()
	resp.Hold = nil
	_ = printList(&b, resp)
	if strings.Contains(b.String(), "HOLD") {
		t.Fatalf("a hold shown without one:\n%s", b.String())
	}
}

// `ipwarden agent list` shows a handback: to what, since when, and how to undo it.
func TestPrintListShowsTheHandback(t *testing.T) {
	resp := &cniproto.Response{Node: "n1", Handback: &cniproto.HandbackStatus{Marked: true, At: time.Date(2026, 1, 1, 0, 5, 0, 0, time.UTC),
		To: "host-local", Network: "net", Dir: "/var/lib/cni/networks/net"}}
	var b bytes.Buffer
	if err := printList(&b, resp); err != nil {
		t.Fatal(err)
	}
	want := "HANDED BACK to host-local at 2026-01-01T00:05:00Z (network net, reservation files in /var/lib/cni/networks/net): every ADD is refused; undo: ipwarden agent handback --undo"
	if !strings.Contains(b.String(), want) {
		t.Fatalf("output lacks %q:\n%s", want, b.String())
	}
	b.Reset()
	resp.Handback = nil
	_ = printList(&b, resp)
	if strings.Contains(b.String(), "HANDED BACK") {
		t.Fatalf("a handback shown without one:\n%s", b.String())
	}
}

// `ipwarden agent list` shows the IPAMClaim of each attachment that has one.
func TestPrintListShowsClaims(t *testing.T) {
	resp := &cniproto.Response{Node: "n1", Attachments: []cniproto.Attachment{
		{ContainerID: "src", IfName: "eth0", Pod: cniproto.Pod{Namespace: "ns", Name: "virt-launcher-a"}, IPs: []cniproto.IP{{Address: "10.1.0.9/16"}},
			Claim: &cniproto.Claim{Namespace: "ns", Name: "vm-a", UID: "u1"}},
		{ContainerID: "tgt", IfName: "eth0", Pod: cniproto.Pod{Namespace: "ns", Name: "virt-launcher-b"}, IPs: []cniproto.IP{{Address: "10.1.0.9/16"}},
			Claim: &cniproto.Claim{Namespace: "ns", Name: "vm-a", UID: "u1", MigrationTarget: true}},
	}}
	var b bytes.Buffer
	if err := printList(&b, resp); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"IPAMClaim ns/vm-a\n", "IPAMClaim ns/vm-a (migration target)"} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, b.String())
		}
	}
}
