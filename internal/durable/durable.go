// Package durable holds the file-system steps that make a node's records survive a crash.
package durable

import "os"

// SyncDir fsyncs the directory dir, so that files created, renamed or removed in it survive a
// crash (their contents need their own sync).
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
