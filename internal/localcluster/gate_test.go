package localcluster

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// A Gate opens only while someone reads it, and then ends the read.
func TestGateOpensForAReader(t *testing.T) {
	g, err := NewGate(filepath.Join(t.TempDir(), "gate"))
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Open(); err == nil {
		t.Fatal("Open succeeded with no reader: a test would think the plugin went through")
	}
	read := make(chan error, 1)
	go func() {
		f, err := os.Open(string(g)) // blocks until a writer opens it
		if err == nil {
			_, err = io.ReadAll(f)
			f.Close()
		}
		read <- err
	}()
	if err := WaitFor(context.Background(), 10*time.Second, 5*time.Millisecond, g.Open); err != nil {
		t.Fatalf("Open with a reader: %v", err)
	}
	if err := <-read; err != nil {
		t.Fatalf("the reader: %v", err)
	}
}
