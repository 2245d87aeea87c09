package handback

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"

	"github.com/ipwarden/ipwarden/internal/durable"
)

// maxFile bounds a reservation file ReadExisting reads: a container ID, CRLF and an interface name.
const maxFile = 4 << 10

// maxFiles bounds the reservation files ReadExisting reads from one directory.
const maxFiles = 1 << 16

// Lock takes host-local's lock on dir (the file dir/lock, flock'ed as host-local's disk backend
// does), creating dir as host-local would (0755), so no host-local ADD or DEL runs between reading
// the existing files and writing the new ones. unlock releases it.
func Lock(dir string) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create host-local's directory: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open host-local's lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("take host-local's lock %s: %w", f.Name(), err)
	}
	return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
}

// ReadExisting reads host-local's reservation files in dir: the files named by an address, with
// their contents. A missing dir holds none. Other files (lock, last_reserved_ip.N) are skipped.
func ReadExisting(dir string) (map[netip.Addr]string, error) {
	out := map[netip.Addr]string{}
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return nil, err
	}
	if len(ents) > maxFiles {
		return nil, fmt.Errorf("%s has %d entries, more than the %d the handback reads", dir, len(ents), maxFiles)
	}
	for _, e := range ents {
		a, err := netip.ParseAddr(e.Name())
		if err != nil || !e.Type().IsRegular() {
			continue
		}
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		b, err := io.ReadAll(io.LimitReader(f, maxFile))
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", f.Name(), err)
		}
		out[a.Unmap()] = string(b)
	}
	return out, nil
}

// Write writes files into dir, each atomically and durably: into a temporary file in dir, synced,
// then linked to its address's name, which fails if that name exists (a reservation is never
// overwritten), then the directory is synced. It returns the paths it created; on an error it has
// removed them again. The caller holds Lock(dir).
func Write(dir string, files []File) (created []string, err error) {
	named := make([]Named, len(files))
	for i, f := range files {
		named[i] = Named{Addr: f.Addr, Content: f.Content()}
	}
	return WriteFiles(dir, named)
}

// Named is one reservation file with its content as given (package previous writes ipwarden's
// own, marked, content with it).
type Named struct {
	Addr    netip.Addr
	Content string
}

// WriteFiles is Write with each file's content given.
func WriteFiles(dir string, files []Named) (created []string, err error) {
	defer func() {
		if err != nil {
			for _, p := range created {
				_ = os.Remove(p)
			}
			created = nil
			_ = durable.SyncDir(dir)
		}
	}()
	for _, f := range files {
		final := filepath.Join(dir, f.Addr.String())
		if err := writeOne(dir, final, f.Content); err != nil {
			return created, err
		}
		created = append(created, final)
	}
	if err := durable.SyncDir(dir); err != nil {
		return created, fmt.Errorf("sync %s: %w", dir, err)
	}
	return created, nil
}

func writeOne(dir, final, content string) error {
	tmp, err := os.CreateTemp(dir, ".ipwarden-handback-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.WriteString(content); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("sync %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Link(tmp.Name(), final); err != nil {
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("host-local's reservation %s appeared while it was written; nothing was overwritten", final)
		}
		return fmt.Errorf("create %s: %w", final, err)
	}
	return nil
}

// Release removes host-local's reservation files in dir that name freed attachments (Stale),
// under host-local's lock, and returns the addresses it removed. A missing dir holds none (it is
// not created).
func Release(dir string, freed []Attachment) ([]netip.Addr, error) {
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	unlock, err := Lock(dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	existing, err := ReadExisting(dir)
	if err != nil {
		return nil, err
	}
	return RemoveFiles(dir, Stale(freed, existing))
}

// RemoveFiles removes the reservation files of ips from host-local's directory dir (a file
// already gone is no error) and syncs the directory, so the removals survive a crash. The caller
// holds host-local's lock (Lock). It returns the addresses whose files it removed.
func RemoveFiles(dir string, ips []netip.Addr) ([]netip.Addr, error) {
	var removed []netip.Addr
	for _, ip := range ips {
		if err := os.Remove(filepath.Join(dir, ip.String())); err != nil && !errors.Is(err, os.ErrNotExist) {
			return removed, err
		}
		removed = append(removed, ip)
	}
	if len(removed) > 0 {
		if err := durable.SyncDir(dir); err != nil {
			return removed, err
		}
	}
	return removed, nil
}
