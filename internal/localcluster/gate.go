package localcluster

import (
	"os"
	"syscall"
)

// Gate is a FIFO a slow test plugin blocks on (reading it) until the test opens it: the tests
// hold a previous IPAM's ADD answer across a switch with it.
type Gate string

// NewGate makes the FIFO at path.
func NewGate(path string) (Gate, error) {
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		return "", err
	}
	return Gate(path), nil
}

// Open lets the reader's read end. It never blocks: with no reader (the plugin not there yet,
// or gone) it fails at once (ENXIO), so callers retry it until it succeeds.
func (g Gate) Open() error {
	f, err := os.OpenFile(string(g), os.O_WRONLY|syscall.O_NONBLOCK, 0)
	if err == nil {
		f.Close()
	}
	return err
}
