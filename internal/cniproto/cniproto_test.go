package cniproto

import (
	"bytes"
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"
)

func TestCallRoundTrip(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "a.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			req, err := ReadRequest(c)
			resp := &Response{Node: string(req.Op) + "/" + req.ContainerID}
			if err != nil {
				resp = &Response{Error: &Error{Code: CodeInternal, Msg: err.Error()}}
			}
			_ = WriteResponse(c, resp)
			c.Close()
		}
	}()
	resp, err := Call(context.Background(), sock, Request{Op: OpAdd, ContainerID: "c1"})
	if err != nil || resp.AsError() != nil || resp.Node != "ADD/c1" {
		t.Fatalf("Call = %+v, %v", resp, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := Call(ctx, filepath.Join(t.TempDir(), "none.sock"), Request{Op: OpAdd}); !IsUnreachable(err) {
		t.Fatalf("missing socket: %v", err)
	}
}

func TestReadRequestRefusesOtherVersions(t *testing.T) {
	_, err := ReadRequest(bytes.NewReader([]byte(`{"version":2,"op":"ADD"}`)))
	if e, ok := err.(*Error); !ok || e.Code != CodeIncompatibleVersion {
		t.Fatalf("version 2: %v", err)
	}
}

// FuzzReadRequest: any bytes on the socket give a request or an error, never a panic.
func FuzzReadRequest(f *testing.F) {
	f.Add([]byte(`{"version":1,"op":"ADD","containerID":"c","ifname":"eth0","pools":["a"]}`))
	f.Add([]byte(`{"version":1,"op":"GC","validAttachments":[{"containerID":"c","ifname":"eth0"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := ReadRequest(bytes.NewReader(data))
		if err == nil && req.Version != Version {
			t.Fatalf("accepted version %d", req.Version)
		}
	})
}
