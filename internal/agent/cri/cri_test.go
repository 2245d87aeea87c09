package cri

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// fakeRuntime answers the two read-only calls the reader makes, over a real gRPC unix socket; the
// real containerd is asked in the real-node suite (test/node).
type fakeRuntime struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	items     []*runtimeapi.PodSandbox
	ips       map[string][]string
	statusErr string // the sandbox whose status fails
}

func (f *fakeRuntime) ListPodSandbox(context.Context, *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	return &runtimeapi.ListPodSandboxResponse{Items: f.items}, nil
}

func (f *fakeRuntime) PodSandboxStatus(_ context.Context, r *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	if r.PodSandboxId == f.statusErr {
		return nil, errors.New("sandbox vanished")
	}
	st := &runtimeapi.PodSandboxStatus{Id: r.PodSandboxId, State: runtimeapi.PodSandboxState_SANDBOX_READY}
	for _, it := range f.items {
		if it.Id == r.PodSandboxId {
			st.State = it.State
		}
	}
	if ips := f.ips[r.PodSandboxId]; len(ips) > 0 {
		st.Network = &runtimeapi.PodSandboxNetworkStatus{Ip: ips[0]}
		for _, ip := range ips[1:] {
			st.Network.AdditionalIps = append(st.Network.AdditionalIps, &runtimeapi.PodIP{Ip: ip})
		}
	}
	return &runtimeapi.PodSandboxStatusResponse{Status: st}, nil
}

func serve(t *testing.T, f *fakeRuntime) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cri.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, f)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return sock
}

func TestRead(t *testing.T) {
	meta := func(name string) *runtimeapi.PodSandboxMetadata {
		return &runtimeapi.PodSandboxMetadata{Namespace: "ns", Name: name, Uid: "uid-" + name}
	}
	f := &fakeRuntime{
		items: []*runtimeapi.PodSandbox{
			{Id: "sb-web", Metadata: meta("web"), State: runtimeapi.PodSandboxState_SANDBOX_READY},
			{Id: "sb-old", Metadata: meta("db"), State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY},
			{Id: "sb-host", Metadata: meta("host"), State: runtimeapi.PodSandboxState_SANDBOX_READY},
		},
		ips: map[string][]string{"sb-web": {"10.0.0.5", "fd00::5"}, "sb-old": {"10.0.0.6"}},
	}
	r, err := New(serve(t, f), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ev, err := r.Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !ev.Known || len(ev.Sandboxes) != 3 {
		t.Fatalf("reading %+v", ev)
	}
	if got := ev.ReadyIPs("uid-web"); !slices.Equal(got, []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")}) {
		t.Fatalf("web's ready addresses %v", got)
	}
	if got := ev.ReadyIPs("uid-db"); len(got) != 0 || !ev.Shows("uid-db") || !ev.Uses().Contains(netip.MustParseAddr("10.0.0.6")) {
		t.Fatalf("a sandbox that is not ready is shown and its address used, never proven ready: %v", got)
	}
	if !ev.Shows("uid-host") || ev.Shows("uid-none") {
		t.Fatal("Shows")
	}

	// One status that fails makes the whole reading fail: a partial one would show a pod missing.
	f.statusErr = "sb-old"
	if ev, err := r.Read(context.Background()); err == nil || ev.Known {
		t.Fatalf("a failed status read gave %+v, %v", ev, err)
	}
}

func TestReadWithoutARuntime(t *testing.T) {
	var none *Reader
	if ev, err := none.Read(context.Background()); !errors.Is(err, ErrNotConfigured) || ev.Known {
		t.Fatalf("no socket: %+v %v", ev, err)
	}
	r, err := New(filepath.Join(t.TempDir(), "absent.sock"), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if ev, err := r.Read(context.Background()); err == nil || ev.Known {
		t.Fatalf("a socket nobody answers on: %+v %v", ev, err)
	}
	if _, err := New("tcp://10.0.0.1:1234", 0); err == nil {
		t.Fatal("a TCP endpoint was accepted")
	}
	if r, err := New("", 0); r != nil || err != nil {
		t.Fatal("an empty endpoint configures nothing")
	}
}
