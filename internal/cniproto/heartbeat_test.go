package cniproto

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeAgent serves one connection on a unix socket with serve.
func fakeAgent(t *testing.T, serve func(conn net.Conn)) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "a.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		serve(c)
	}()
	return sock
}

func shorten(t *testing.T) {
	oh, os := heartbeatEvery, silenceLimit
	heartbeatEvery, silenceLimit = 50*time.Millisecond, 400*time.Millisecond
	t.Cleanup(func() { heartbeatEvery, silenceLimit = oh, os })
}

// An agent that accepts but never answers (paused: the kernel accepts for it) gives a
// SilentError naming its socket after the silence limit, not after the caller's own timeout.
func TestCallGivesUpOnASilentAgent(t *testing.T) {
	shorten(t)
	paused := make(chan struct{}) // the fake agent holds its connection until the test ends
	t.Cleanup(func() { close(paused) })
	for _, tc := range []struct {
		name  string
		serve func(net.Conn)
		acked bool
	}{
		{"never reads", func(c net.Conn) { <-paused }, false},
		{"acknowledges, then stops", func(c net.Conn) {
			_, _ = ReadRequest(c)
			_, _ = c.Write([]byte(" "))
			<-paused
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := fakeAgent(t, tc.serve)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_, err := Call(ctx, sock, Request{Op: OpAdd, ContainerID: "c", IfName: "eth0"})
			var se *SilentError
			if !errors.As(err, &se) || se.Acked != tc.acked || !strings.Contains(err.Error(), sock) {
				t.Fatalf("Call = %v; want a SilentError (acked %v) naming %s", err, tc.acked, sock)
			}
		})
	}
}

// An agent that takes longer than the silence limit but sends heartbeats meanwhile is waited for.
func TestCallWaitsForAHeartbeatingAgent(t *testing.T) {
	shorten(t)
	sock := fakeAgent(t, func(c net.Conn) {
		if _, err := ReadRequest(c); err != nil {
			return
		}
		stop := WriteHeartbeats(c)
		time.Sleep(3 * silenceLimit) // an ADD waiting for addresses
		stop()
		_ = json.NewEncoder(c).Encode(Response{Node: "n1"})
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp, err := Call(ctx, sock, Request{Op: OpAdd, ContainerID: "c", IfName: "eth0"})
	if err != nil || resp.Node != "n1" {
		t.Fatalf("Call = %+v, %v", resp, err)
	}
}
