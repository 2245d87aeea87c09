package journal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"github.com/ipwarden/ipwarden/internal/durable"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// Reasons a journal is damaged (the reason label of ipwarden_agent_journal_recovered_total).
const (
	// ReasonTruncated: the file is shorter than its own meta page says (mapping it would SIGBUS).
	ReasonTruncated = "truncated"
	// ReasonCorrupt: no valid meta page, a page that panics bbolt, or a record that does not decode.
	ReasonCorrupt = "corrupt"
	// ReasonIncompatibleVersion: a bbolt file version or a journal format this agent does not read.
	ReasonIncompatibleVersion = "incompatible_version"
)

// DamageError says why a journal file cannot be used. OpenOrRecover moves such a file aside.
type DamageError struct {
	Reason string
	Err    error
}

func (e *DamageError) Error() string { return e.Reason + ": " + e.Err.Error() }

func (e *DamageError) Unwrap() error { return e.Err }

func damaged(reason, format string, args ...any) *DamageError {
	return &DamageError{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// Recovery reports a damaged journal that OpenOrRecover moved aside.
type Recovery struct {
	Reason string
	// Problem says what was wrong with the file.
	Problem string
	// MovedTo is where the damaged file now is.
	MovedTo string
}

// bbolt's on-disk meta page (go.etcd.io/bbolt/internal/common: Page header, then Meta).
const (
	boltMagic      = 0xED0CDAED
	boltVersion    = 2
	pageHeaderSize = 16
	metaSize       = 64 // magic, version, pageSize, flags (4 each), root (16), freelist, pgid, txid, checksum (8 each)
	checksumOffset = 56
)

// boltMeta is the part of a bbolt meta page CheckFile reads.
type boltMeta struct {
	pageSize uint32
	pgid     uint64 // high water mark: the file holds pages [0, pgid)
	txid     uint64
}

// parseMeta decodes the meta page whose page starts at buf[0]. It returns a DamageError for a
// bad magic, version or checksum.
func parseMeta(buf []byte) (boltMeta, *DamageError) {
	if len(buf) < pageHeaderSize+metaSize {
		return boltMeta{}, damaged(ReasonTruncated, "meta page cut short")
	}
	m := buf[pageHeaderSize : pageHeaderSize+metaSize]
	le := binary.NativeEndian // bbolt writes its structs in the machine's byte order
	if le.Uint32(m[0:]) != boltMagic {
		return boltMeta{}, damaged(ReasonCorrupt, "meta page has no bbolt magic number")
	}
	if v := le.Uint32(m[4:]); v != boltVersion {
		return boltMeta{}, damaged(ReasonIncompatibleVersion, "bbolt file version %d, this agent reads version %d", v, boltVersion)
	}
	h := fnv.New64a()
	_, _ = h.Write(m[:checksumOffset])
	if h.Sum64() != le.Uint64(m[checksumOffset:]) {
		return boltMeta{}, damaged(ReasonCorrupt, "meta page checksum mismatch")
	}
	return boltMeta{pageSize: le.Uint32(m[8:]), pgid: le.Uint64(m[40:]), txid: le.Uint64(m[48:])}, nil
}

// CheckFile checks a journal file's structure before bbolt maps it: the file must hold a valid
// meta page (magic, version, checksum), a sane page size, and every page up to its high water
// mark. bbolt maps the file and a page past the end of a truncated file kills the process with
// SIGBUS, so this must pass before Open. A nil error means bbolt may open it; the records are
// checked by loading them (see OpenOrRecover).
func CheckFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	return checkHeader(f, fi.Size())
}

func checkHeader(r io.ReaderAt, size int64) error {
	if size == 0 {
		return damaged(ReasonTruncated, "the file is empty")
	}
	read := func(off int64) []byte {
		buf := make([]byte, pageHeaderSize+metaSize)
		n, _ := r.ReadAt(buf, off)
		return buf[:n]
	}
	m0, err0 := parseMeta(read(0))
	// The second meta page starts one page in; without a valid first meta page, try the page
	// sizes bbolt itself tries.
	var sizes []int64
	if err0 == nil {
		sizes = []int64{int64(m0.pageSize)}
	} else {
		for i := range 15 {
			sizes = append(sizes, 1024<<i)
		}
	}
	var m1 boltMeta
	err1 := damaged(ReasonTruncated, "the file ends before the second meta page")
	for _, ps := range sizes {
		if ps >= size {
			break
		}
		m, err := parseMeta(read(ps))
		if err == nil {
			m1, err1 = m, nil
			break
		}
		if err1.Reason == ReasonTruncated {
			err1 = err
		}
	}
	var m boltMeta
	switch {
	case err0 == nil && err1 == nil:
		m = m0
		if m1.txid > m0.txid {
			m = m1
		}
	case err0 == nil:
		m = m0
	case err1 == nil:
		m = m1
	case err0.Reason == ReasonIncompatibleVersion:
		return err0
	case err1.Reason == ReasonIncompatibleVersion:
		return err1
	default:
		return damaged(err0.Reason, "no valid meta page (first: %v; second: %v)", err0.Err, err1.Err)
	}
	ps := int64(m.pageSize)
	if ps < 512 || ps > 1<<20 || ps&(ps-1) != 0 {
		return damaged(ReasonCorrupt, "implausible page size %d", ps)
	}
	if m.pgid < 2 || m.pgid > uint64(1<<40)/uint64(ps) {
		return damaged(ReasonCorrupt, "implausible high water mark of %d pages", m.pgid)
	}
	if need := int64(m.pgid) * ps; size < need {
		return damaged(ReasonTruncated, "the file has %d bytes, its meta page says it holds %d pages of %d bytes (%d bytes)",
			size, m.pgid, ps, need)
	}
	return nil
}

// brokenSuffix names the marker a journal leaves when bbolt failed writing it (see breakDown).
const brokenSuffix = ".broken"

// OpenOrRecover opens the journal in dir like Open and loads it. A journal file that is damaged
// (truncated, corrupt pages or records, or a format or bbolt version this agent does not read) is
// renamed to journal.db.damaged-<UTC timestamp> and a new, empty journal is opened in its place;
// the returned Recovery says why. The caller then rebuilds from the pods. Errors that are not
// damage (the lock is held by another agent, the journal belongs to another node, the disk) are
// returned as before and nothing is moved.
func OpenOrRecover(dir string, opts Options, now time.Time) (*Journal, ipam.Snapshot, *Recovery, error) {
	path := filepath.Join(dir, FileName)
	j, snap, err := openAndLoad(dir, path, opts)
	var de *DamageError
	if !errors.As(err, &de) {
		return j, snap, nil, err
	}
	aside := fmt.Sprintf("%s.damaged-%s", path, now.UTC().Format("20060102T150405.000000000Z"))
	if rerr := os.Rename(path, aside); rerr != nil {
		return nil, ipam.Snapshot{}, nil, fmt.Errorf("journal %s is damaged (%v) and cannot be moved aside: %w", path, de, rerr)
	}
	if rerr := os.Remove(path + brokenSuffix); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		return nil, ipam.Snapshot{}, nil, fmt.Errorf("journal %s: remove %s: %w", path, path+brokenSuffix, rerr)
	}
	if serr := durable.SyncDir(dir); serr != nil {
		return nil, ipam.Snapshot{}, nil, fmt.Errorf("journal %s: sync directory after moving it aside: %w", path, serr)
	}
	rec := &Recovery{Reason: de.Reason, Problem: de.Err.Error(), MovedTo: aside}
	j, snap, err = openAndLoad(dir, path, opts)
	if err != nil {
		return nil, ipam.Snapshot{}, rec, err
	}
	return j, snap, rec, nil
}

// openAndLoad checks the file, opens it and loads it, turning a panic of bbolt on a damaged file
// (and a memory fault on its mapping) into a DamageError.
func openAndLoad(dir, path string, opts Options) (j *Journal, snap ipam.Snapshot, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, snap, fmt.Errorf("create state directory %s: %w", dir, err)
	}
	if b, err := os.ReadFile(path + brokenSuffix); err == nil {
		if _, serr := os.Stat(path); serr == nil {
			return nil, snap, damaged(ReasonCorrupt, "an earlier run could not write it: %s", strings.TrimSpace(string(b)))
		}
		_ = os.Remove(path + brokenSuffix)
	}
	if err := CheckFile(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		var de *DamageError
		if errors.As(err, &de) {
			return nil, snap, err
		}
		return nil, snap, fmt.Errorf("read journal %s: %w", path, err)
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if j != nil {
				j.abandon()
			}
			j, snap, err = nil, ipam.Snapshot{}, damaged(ReasonCorrupt, "bbolt failed on the file: %v", r)
		}
	}()
	j, err = Open(dir, opts)
	if err != nil {
		return nil, snap, err
	}
	snap, err = j.Load()
	if err != nil {
		_ = j.Close()
		return nil, snap, &DamageError{Reason: ReasonCorrupt, Err: err}
	}
	return j, snap, nil
}

// abandon closes what it can of a journal whose database panicked.
func (j *Journal) abandon() {
	defer func() { _ = recover() }()
	_ = j.Close()
}
