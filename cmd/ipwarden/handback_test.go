package main

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

type nopJournal struct{}

func (nopJournal) Commit(ipam.Change) error { return nil }

// serveAgent serves a real agent Service (journal in memory) on a socket in a temporary
// directory, holding 10.1.0.10-20 of pool v4.
func serveAgent(t *testing.T) (*agent.Service, string) {
	t.Helper()
	pool := ipam.Pool{Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/24")}, Gateway: netip.MustParseAddr("10.1.0.1"),
		Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32}}
	svc := agent.NewService(ipam.New("n1"), nopJournal{}, agent.ServiceOptions{Node: "n1", AddressWait: 100 * time.Millisecond, Log: logr.Discard()})
	if err := svc.SetPools([]ipam.Pool{pool}, []string{"v4"}); err != nil {
		t.Fatal(err)
	}
	if err := svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.10-10.1.0.20")}, agent.RecordOf{}); err != nil {
		t.Fatal(err)
	}
	svc.SetReady(true)
	sock := filepath.Join(t.TempDir(), "run", "agent.sock")
	l, err := agent.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agent.Serve(ctx, l, svc, 10*time.Second, logr.Discard()) }()
	t.Cleanup(func() { cancel(); <-done })
	return svc, sock
}

func add(t *testing.T, svc *agent.Service, cid string) *cniproto.Response {
	t.Helper()
	return svc.Handle(context.Background(), cniproto.Request{Op: cniproto.OpAdd, ContainerID: cid, IfName: "eth0", Network: "net",
		Pod: cniproto.Pod{Namespace: "ns", Name: "pod-" + cid, UID: "uid-" + cid}})
}

func files(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return "(no directory)"
	}
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, e.Name()+"="+strings.ReplaceAll(string(b), "\r\n", "\\r\\n"))
	}
	return strings.Join(out, " ")
}

// `ipwarden agent handback` against a real agent: refusals write nothing and leave ADD served;
// a handback writes host-local's files for every attachment and the agent refuses ADD after it;
// --undo serves ADD again and leaves the files.
func TestAgentHandbackCommand(t *testing.T) {
	svc, sock := serveAgent(t)
	for _, c := range []string{"c1", "c2"} {
		if r := add(t, svc, c); r.Error != nil {
			t.Fatal(r.Error)
		}
	}
	dataDir := t.TempDir()
	dir := filepath.Join(dataDir, "net")
	to := func(start, end string) string {
		return `{"type": "host-local", "dataDir": "` + dataDir + `", "ranges": [[{"subnet": "10.1.0.0/24", "rangeStart": "` + start + `", "rangeEnd": "` + end + `"}]]}`
	}
	ctx := context.Background()
	var out bytes.Buffer

	// An address outside the range: refused, nothing written, ADD still served.
	err := runHandback(ctx, &out, sock, to("10.1.0.11", "10.1.0.20"), "net", false)
	if err == nil || !strings.Contains(err.Error(), "pod ns/pod-c1 uses 10.1.0.10, outside every range") {
		t.Fatalf("handback with 10.1.0.10 outside: %v", err)
	}
	if got := files(t, dir); got != "(no directory)" {
		t.Fatalf("a refused handback wrote %s", got)
	}
	// Not host-local: refused, naming the drain.
	if err := runHandback(ctx, &out, sock, `{"type": "whereabouts", "range": "10.1.0.0/24"}`, "net", false); err == nil ||
		!strings.Contains(err.Error(), "drain the node") {
		t.Fatalf("handback to whereabouts: %v", err)
	}
	// host-local already reserves 10.1.0.11 for another container: refused, the file untouched.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "10.1.0.11"), []byte("other\r\neth0"), 0o600); err != nil {
		t.Fatal(err)
	}
	err = runHandback(ctx, &out, sock, to("10.1.0.10", "10.1.0.20"), "net", false)
	if err == nil || !strings.Contains(err.Error(), `which host-local already reserves for container "other"`) {
		t.Fatalf("handback over another container's reservation: %v", err)
	}
	if got := files(t, dir); got != `10.1.0.11=other\r\neth0` {
		t.Fatalf("after a refused handback host-local's directory holds %s", got)
	}
	if r := add(t, svc, "c3"); r.Error != nil {
		t.Fatalf("ADD after refused handbacks: %v", r.Error)
	}
	if err := os.Remove(filepath.Join(dir, "10.1.0.11")); err != nil {
		t.Fatal(err)
	}

	// The dry run writes nothing.
	out.Reset()
	if err := runHandback(ctx, &out, sock, to("10.1.0.10", "10.1.0.20"), "net", true); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "would write 3 reservation files") || files(t, dir) != "" {
		t.Fatalf("dry run: %s; directory %s", out.String(), files(t, dir))
	}

	out.Reset()
	if err := runHandback(ctx, &out, sock, to("10.1.0.10", "10.1.0.20"), "net", false); err != nil {
		t.Fatal(err)
	}
	want := `10.1.0.10=c1\r\neth0 10.1.0.11=c2\r\neth0 10.1.0.12=c3\r\neth0 lock=`
	if got := files(t, dir); got != want {
		t.Fatalf("host-local's directory after the handback: %s, want %s", got, want)
	}
	if !strings.Contains(out.String(), "node handed back to host-local") {
		t.Fatalf("output: %s", out.String())
	}
	r := add(t, svc, "c4")
	if r.Error == nil || r.Error.Code != cniproto.CodeHandedBack || !strings.Contains(r.Error.Msg, "handed back to host-local at") {
		t.Fatalf("ADD after the handback: %+v", r.Error)
	}
	// Running it again changes nothing: the files are there, identical.
	if err := runHandback(ctx, &out, sock, to("10.1.0.10", "10.1.0.20"), "net", false); err != nil {
		t.Fatalf("second handback: %v", err)
	}
	if got := files(t, dir); got != want {
		t.Fatalf("after a second handback: %s", got)
	}

	out.Reset()
	if err := runHandbackUndo(ctx, &out, sock); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "undone") {
		t.Fatalf("undo output: %s", out.String())
	}
	if r := add(t, svc, "c4"); r.Error != nil {
		t.Fatalf("ADD after the undo: %v", r.Error)
	}
	if got := files(t, dir); got != want {
		t.Fatalf("the undo changed the files: %s", got)
	}
	out.Reset()
	if err := runHandbackUndo(ctx, &out, sock); err != nil || !strings.Contains(out.String(), "nothing to undo") {
		t.Fatalf("second undo: %v %s", err, out.String())
	}
}

// A file written for an attachment the agent no longer lists after the write (its pod was
// deleted between the agent's answer and the write) is removed again; the others stay.
func TestReleaseGone(t *testing.T) {
	dir := t.TempDir()
	for name, c := range map[string]string{"10.1.0.10": "c1\r\neth0", "10.1.0.11": "c2\r\neth0"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	before := &cniproto.HandbackStatus{Attachments: []cniproto.HandbackAttachment{
		{ContainerID: "c1", IfName: "eth0", Addresses: []string{"10.1.0.10"}},
		{ContainerID: "c2", IfName: "eth0", Addresses: []string{"10.1.0.11"}}}}
	now := &cniproto.HandbackStatus{Attachments: before.Attachments[1:]}
	removed, err := releaseGone(before, now, dir)
	if err != nil || len(removed) != 1 || removed[0].String() != "10.1.0.10" {
		t.Fatalf("removed %v, %v", removed, err)
	}
	if got := files(t, dir); got != `10.1.0.11=c2\r\neth0 lock=` {
		t.Fatalf("left %s", got)
	}
}
