package journal

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ipwarden/ipwarden/internal/durable"
)

// HoldFileName marks, in the state directory, an unattributed hold in progress (see ipam.StartHold)
// with its deadline, so that an agent restarted during the hold holds again: its journal is no
// longer empty by then, but the owners of the held addresses are still unknown.
const HoldFileName = "rebuild-hold"

// MarkHold records durably that a hold runs until until.
func MarkHold(dir string, until time.Time) error {
	path := filepath.Join(dir, HoldFileName)
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(until.UTC().Format(time.RFC3339Nano) + "\n"); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return durable.SyncDir(dir)
}

// HeldUntil returns the deadline of a hold recorded in dir. An unreadable marker counts as a hold
// of unknown deadline: the caller holds for its full --rebuild-hold (zero time, true).
func HeldUntil(dir string) (time.Time, bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, HoldFileName))
	if errors.Is(err, os.ErrNotExist) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, true, err
	}
	t, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(string(b)))
	if err != nil {
		return time.Time{}, true, fmt.Errorf("%s: %w", HoldFileName, err)
	}
	return t, true, nil
}

// ClearHold removes the hold marker.
func ClearHold(dir string) error {
	if err := os.Remove(filepath.Join(dir, HoldFileName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return durable.SyncDir(dir)
}
