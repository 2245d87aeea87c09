// Package journal is the node agent's durable record of its attachments, cooling and releasing
// addresses, and the last holdings and pool settings it saw, in a bbolt database
// (<state-dir>/journal.db).
//
// Every ipam.Change is written in one bbolt transaction and fsynced before Commit returns, so a
// change is recorded whole or not at all whatever kills the process. Commits that arrive while
// one is being written are grouped into the next transaction (group commit): a burst of ADDs
// pays for one fsync per group, not one per ADD, and a lone ADD waits for no timer.
package journal

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ipwarden/ipwarden/internal/durable"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// FileName is the journal's file name inside the state directory.
const FileName = "journal.db"

// formatVersion is the on-disk format; Open refuses other versions, except that it upgrades
// format 1 in place. Format 2 added the bucket of addresses reserved ahead (ipam, ahead.go): an
// agent that reads only format 1 would not know that those addresses may be in use, so it
// refuses the journal (a downgrade rebuilds it from the pods, under the unattributed hold)
// instead of handing them out.
const formatVersion = "2"

// upgradable are the older formats Open upgrades in place: their records mean the same.
var upgradable = []string{"1"}

var (
	bucketMeta        = []byte("meta")
	bucketAttachments = []byte("attachments")
	bucketCooling     = []byte("cooling")
	bucketReleasing   = []byte("releasing")
	bucketHoldings    = []byte("holdings")
	bucketPools       = []byte("pools")
	bucketAhead       = []byte("ahead")
	allBuckets        = [][]byte{bucketMeta, bucketAttachments, bucketCooling, bucketReleasing, bucketHoldings, bucketPools, bucketAhead}

	keyFormat  = []byte("format")
	keyNode    = []byte("node")
	keyCreated = []byte("created")
)

// Options configure Open.
type Options struct {
	// Node is the node the journal belongs to. Open refuses a journal written for another node.
	Node string
	// LockTimeout bounds the wait for the file lock another process holds (default 5 s).
	LockTimeout time.Duration
	// ObserveWrite, if set, receives the duration of every committed transaction.
	ObserveWrite func(time.Duration)
}

// Journal is an open journal. Its methods are safe for concurrent use.
type Journal struct {
	db      *bolt.DB
	path    string
	observe func(time.Duration)
	// Created is when the journal file was first initialized.
	created time.Time

	reqs     chan *commitReq
	mu       sync.RWMutex // held shared while sending to reqs, exclusively to close
	isClosed bool
	closed   chan struct{}
	stopped  chan struct{}

	// broken is set when bbolt panicked during a write (bbolt rolls the transaction back): the
	// file is not to be trusted, every later Commit fails, and brokenCh is closed.
	broken   atomic.Pointer[error]
	brokenCh chan struct{}
	// beforeWrite, if set (tests), runs inside every write transaction.
	beforeWrite func()
}

type commitReq struct {
	ch   ipam.Change
	done chan error
	// lazy: the change may wait up to Linger for company (CommitLazy).
	lazy bool
}

// Linger is how long a lazy change (CommitLazy) waits for another change to share its
// transaction before it is written alone.
const Linger = 10 * time.Millisecond

// Open opens (creating if needed) the journal in dir, which it creates with mode 0700.
func Open(dir string, opts Options) (*Journal, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create state directory %s: %w", dir, err)
	}
	path := filepath.Join(dir, FileName)
	_, statErr := os.Stat(path)
	isNew := errors.Is(statErr, os.ErrNotExist)
	timeout := opts.LockTimeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: timeout, FreelistType: bolt.FreelistMapType})
	if err != nil {
		if errors.Is(err, berrors.ErrTimeout) {
			return nil, fmt.Errorf("open journal %s: another process holds its lock (is another ipwarden agent running on this node?)", path)
		}
		if errors.Is(err, berrors.ErrInvalid) || errors.Is(err, berrors.ErrChecksum) {
			return nil, &DamageError{Reason: ReasonCorrupt, Err: fmt.Errorf("open journal %s: %w", path, err)}
		}
		if errors.Is(err, berrors.ErrVersionMismatch) {
			return nil, &DamageError{Reason: ReasonIncompatibleVersion, Err: fmt.Errorf("open journal %s: %w", path, err)}
		}
		return nil, fmt.Errorf("open journal %s: %w", path, err)
	}
	j := &Journal{
		db:       db,
		path:     path,
		observe:  opts.ObserveWrite,
		reqs:     make(chan *commitReq, 256),
		closed:   make(chan struct{}),
		stopped:  make(chan struct{}),
		brokenCh: make(chan struct{}),
	}
	if err := db.Update(func(tx *bolt.Tx) error { return j.init(tx, opts.Node) }); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("journal %s: %w", path, err)
	}
	if isNew {
		// bbolt fsyncs the file; the new directory entry needs its own fsync to survive a power loss.
		if err := durable.SyncDir(dir); err != nil {
			_ = db.Close()
			return nil, fmt.Errorf("journal %s: sync directory: %w", path, err)
		}
	}
	go j.committer()
	return j, nil
}

func (j *Journal) init(tx *bolt.Tx, node string) error {
	for _, b := range allBuckets {
		if _, err := tx.CreateBucketIfNotExists(b); err != nil {
			return fmt.Errorf("create bucket %s: %w", b, err)
		}
	}
	meta := tx.Bucket(bucketMeta)
	if f := meta.Get(keyFormat); f == nil {
		now := time.Now().UTC()
		if err := meta.Put(keyFormat, []byte(formatVersion)); err != nil {
			return err
		}
		if err := meta.Put(keyNode, []byte(node)); err != nil {
			return err
		}
		if err := meta.Put(keyCreated, []byte(now.Format(time.RFC3339Nano))); err != nil {
			return err
		}
	} else if slices.Contains(upgradable, string(f)) {
		if err := meta.Put(keyFormat, []byte(formatVersion)); err != nil {
			return err
		}
	} else if string(f) != formatVersion {
		return damaged(ReasonIncompatibleVersion, "journal format %q, this agent reads format %q", f, formatVersion)
	}
	if n := meta.Get(keyNode); node != "" && len(n) > 0 && string(n) != node {
		return fmt.Errorf("it belongs to node %q, not %q: remove it or point --state-dir at this node's own directory", n, node)
	}
	if c := meta.Get(keyCreated); c != nil {
		j.created, _ = time.Parse(time.RFC3339Nano, string(c))
	}
	return nil
}

// Path returns the journal file's path.
func (j *Journal) Path() string { return j.path }

// Created returns when the journal file was initialized.
func (j *Journal) Created() time.Time { return j.created }

// Close waits for pending commits and closes the database.
func (j *Journal) Close() error {
	j.mu.Lock()
	if !j.isClosed {
		j.isClosed = true
		close(j.closed)
	}
	j.mu.Unlock()
	<-j.stopped
	if j.broken.Load() != nil {
		defer func() { _ = recover() }() // bbolt rolled the failed transaction back; be safe anyway
	}
	return j.db.Close()
}

// ErrClosed is returned by Commit after Close.
var ErrClosed = errors.New("journal is closed")

// Commit writes ch durably, in one transaction, and returns once it is on disk.
func (j *Journal) Commit(ch ipam.Change) error { return j.commit(ch, false) }

// CommitLazy writes ch durably and returns once it is on disk, like Commit, but lets it wait up
// to Linger for another change to share its transaction (and its fsyncs): a change whose
// caller does not wait on it, such as a DEL already answered, then costs the next ADD nothing.
// Any Commit arriving meanwhile writes it at once, with the Commit's change.
func (j *Journal) CommitLazy(ch ipam.Change) error { return j.commit(ch, true) }

func (j *Journal) commit(ch ipam.Change, lazy bool) error { return j.Submit(ch, lazy)() }

// Submit queues ch as Commit (lazy: CommitLazy) does and returns at once; wait returns the
// outcome Commit would have, once the change is on disk. A change submitted before Close is
// written by Close. (The agent's simulation submits the writes in flight when it stops the
// agent, so that Close, not the simulation, decides their outcome.)
func (j *Journal) Submit(ch ipam.Change, lazy bool) (wait func() error) {
	if ch.IsEmpty() {
		return func() error { return nil }
	}
	r := &commitReq{ch: ch, done: make(chan error, 1), lazy: lazy}
	j.mu.RLock()
	if j.isClosed {
		j.mu.RUnlock()
		return func() error { return ErrClosed }
	}
	j.reqs <- r // the committer drains reqs until Close, which waits for this send
	j.mu.RUnlock()
	return func() error { return <-r.done }
}

// committer writes queued changes, as many as are waiting per transaction. A group of lazy
// changes only waits up to Linger for a change that is not lazy, which it then joins.
func (j *Journal) committer() {
	defer close(j.stopped)
	for {
		var first *commitReq
		select {
		case first = <-j.reqs:
		case <-j.closed:
			// Drain what was queued before Close.
			for {
				select {
				case r := <-j.reqs:
					j.write([]*commitReq{r})
				default:
					return
				}
			}
		}
		group := []*commitReq{first}
		if first.lazy {
			group = j.linger(group)
		}
	gather:
		for len(group) < maxGroup {
			select {
			case r := <-j.reqs:
				group = append(group, r)
			default:
				break gather
			}
		}
		j.write(group)
	}
}

// maxGroup bounds the changes written in one transaction.
const maxGroup = 512

// linger waits, up to Linger, for a change that is not lazy to join group (all lazy so far),
// collecting the lazy ones that come meanwhile. Close ends the wait.
func (j *Journal) linger(group []*commitReq) []*commitReq {
	timer := time.NewTimer(Linger)
	defer timer.Stop()
	for len(group) < maxGroup {
		select {
		case r := <-j.reqs:
			group = append(group, r)
			if !r.lazy {
				return group
			}
		case <-timer.C:
			return group
		case <-j.closed:
			return group
		}
	}
	return group
}

func (j *Journal) write(group []*commitReq) {
	if b := j.broken.Load(); b != nil {
		for _, r := range group {
			r.done <- *b
		}
		return
	}
	start := time.Now()
	err := j.update(group)
	if j.broken.Load() != nil {
		for _, r := range group {
			r.done <- err
		}
		return
	}
	if err != nil && len(group) > 1 {
		// One bad change must not fail the others: write them one by one.
		for _, r := range group {
			j.write([]*commitReq{r})
		}
		return
	}
	if j.observe != nil {
		j.observe(time.Since(start))
	}
	if err != nil {
		err = fmt.Errorf("write journal %s: %w", j.path, err)
	}
	for _, r := range group {
		r.done <- err
	}
}

// update writes group in one transaction. A panic of bbolt (a page damaged after the journal
// was loaded) or a memory fault on its mapping breaks the journal instead of the process.
func (j *Journal) update(group []*commitReq) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = j.breakDown(fmt.Errorf("journal %s is damaged: bbolt failed writing it: %v", j.path, r))
		}
	}()
	return j.db.Update(func(tx *bolt.Tx) error {
		if j.beforeWrite != nil {
			j.beforeWrite()
		}
		for _, r := range group {
			if err := apply(tx, r.ch); err != nil {
				return err
			}
		}
		return nil
	})
}

// breakDown marks the journal broken: in memory, and with a marker file next to it so that the
// next start moves the file aside (OpenOrRecover) instead of failing on it again.
func (j *Journal) breakDown(err error) error {
	marker := j.path + brokenSuffix
	if werr := os.WriteFile(marker, []byte(err.Error()+"\n"), 0o600); werr == nil {
		_ = durable.SyncDir(filepath.Dir(j.path))
	}
	j.broken.Store(&err)
	close(j.brokenCh)
	return err
}

// Broken is closed when the journal broke (bbolt failed writing it); the agent must restart,
// which moves the file aside.
func (j *Journal) Broken() <-chan struct{} { return j.brokenCh }

// BrokenErr says why the journal broke, or nil.
func (j *Journal) BrokenErr() error {
	if b := j.broken.Load(); b != nil {
		return *b
	}
	return nil
}

// Key encodings: attachments by "containerID\x00ifname", addresses by "pool\x00addr".
func attKey(k ipam.Key) []byte { return []byte(k.ContainerID + "\x00" + k.IfName) }

func addrKey(pool string, a netip.Addr) []byte { return []byte(pool + "\x00" + a.String()) }

func splitKey(k []byte) (string, string, error) {
	a, b, ok := bytes.Cut(k, []byte{0})
	if !ok {
		return "", "", fmt.Errorf("malformed key %q", k)
	}
	return string(a), string(b), nil
}

// record types: what the values hold, versioned by field names only.
type coolingValue struct {
	FreedAt time.Time `json:"freedAt"`
}

type releasingValue struct {
	Since time.Time `json:"since"`
}

type holdingValue struct {
	Addresses []string `json:"addresses"`
}

// attachmentValue is an attachment as stored; it adds the time of the last write.
type attachmentValue struct {
	ipam.Attachment
	Updated time.Time `json:"updated"`
}

func apply(tx *bolt.Tx, ch ipam.Change) error {
	atts, cool, rel := tx.Bucket(bucketAttachments), tx.Bucket(bucketCooling), tx.Bucket(bucketReleasing)
	hold, pools := tx.Bucket(bucketHoldings), tx.Bucket(bucketPools)
	now := time.Now().UTC()
	for _, k := range ch.DeleteAttachments {
		if err := atts.Delete(attKey(k)); err != nil {
			return err
		}
	}
	for _, a := range ch.PutAttachments {
		if err := putJSON(atts, attKey(a.Key), attachmentValue{Attachment: a, Updated: now}); err != nil {
			return err
		}
	}
	for _, a := range ch.DeleteCooling {
		if err := cool.Delete(addrKey(a.Pool, a.Addr)); err != nil {
			return err
		}
	}
	for _, c := range ch.PutCooling {
		if err := putJSON(cool, addrKey(c.Pool, c.Addr), coolingValue{FreedAt: c.FreedAt}); err != nil {
			return err
		}
	}
	for _, a := range ch.DeleteReleasing {
		if err := rel.Delete(addrKey(a.Pool, a.Addr)); err != nil {
			return err
		}
	}
	for _, r := range ch.PutReleasing {
		if err := putJSON(rel, addrKey(r.Pool, r.Addr), releasingValue{Since: r.Since}); err != nil {
			return err
		}
	}
	for _, p := range ch.DeleteHoldings {
		if err := hold.Delete([]byte(p)); err != nil {
			return err
		}
	}
	for _, h := range ch.PutHoldings {
		if err := putJSON(hold, []byte(h.Pool), holdingValue{Addresses: h.Addresses.Strings()}); err != nil {
			return err
		}
	}
	ahead := tx.Bucket(bucketAhead)
	for _, a := range ch.DeleteAhead {
		if err := ahead.Delete(addrKey(a.Pool, a.Addr)); err != nil {
			return err
		}
	}
	for _, a := range ch.PutAhead {
		if err := ahead.Put(addrKey(a.Pool, a.Addr), []byte("{}")); err != nil {
			return err
		}
	}
	for _, p := range ch.DeletePools {
		if err := pools.Delete([]byte(p)); err != nil {
			return err
		}
	}
	for _, p := range ch.PutPools {
		if err := putJSON(pools, []byte(p.Name), p); err != nil {
			return err
		}
	}
	if ch.PutMark != nil {
		if err := putJSON(tx.Bucket(bucketMeta), keyRecordMark, *ch.PutMark); err != nil {
			return err
		}
	}
	if ch.PutConfigPools != nil {
		if err := putJSON(tx.Bucket(bucketMeta), keyConfigPools, *ch.PutConfigPools); err != nil {
			return err
		}
	}
	if ch.ClearHandback {
		if err := tx.Bucket(bucketMeta).Delete(keyHandback); err != nil {
			return err
		}
	}
	if ch.PutHandback != nil {
		if err := putJSON(tx.Bucket(bucketMeta), keyHandback, *ch.PutHandback); err != nil {
			return err
		}
	}
	return nil
}

// keyHandback (in the meta bucket) holds the ipam.HandbackMark while the node is handed back to
// another IPAM. Journals without it load none.
var keyHandback = []byte("handback")

// keyConfigPools (in the meta bucket) holds the pod network configuration's "pools" the last
// ADD brought (ipam.Snapshot.ConfigPools). Journals without it load none.
var keyConfigPools = []byte("configPools")

// keyRecordMark (in the meta bucket) holds the ipam.RecordMark: the NodeIPAllocation the node
// last wrote. Journals without it load a zero mark.
var keyRecordMark = []byte("recordMark")

func putJSON(b *bolt.Bucket, k []byte, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode %q: %w", k, err)
	}
	return b.Put(k, data)
}

// Load reads the whole journal. A record it cannot decode fails the load with its key: the
// agent must not serve from a journal it only partly understands.
func (j *Journal) Load() (ipam.Snapshot, error) {
	var snap ipam.Snapshot
	err := j.db.View(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketAttachments).ForEach(func(k, v []byte) error {
			var a attachmentValue
			if err := json.Unmarshal(v, &a); err != nil {
				return fmt.Errorf("attachment %q: %w", k, err)
			}
			cid, ifn, err := splitKey(k)
			if err != nil {
				return err
			}
			a.Key = ipam.Key{ContainerID: cid, IfName: ifn}
			snap.Attachments = append(snap.Attachments, a.Attachment)
			return nil
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketCooling).ForEach(func(k, v []byte) error {
			pool, a, err := decodeAddrKey(k)
			if err != nil {
				return err
			}
			var c coolingValue
			if err := json.Unmarshal(v, &c); err != nil {
				return fmt.Errorf("cooling %q: %w", k, err)
			}
			snap.Cooling = append(snap.Cooling, ipam.Cooling{Pool: pool, Addr: a, FreedAt: c.FreedAt})
			return nil
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketReleasing).ForEach(func(k, v []byte) error {
			pool, a, err := decodeAddrKey(k)
			if err != nil {
				return err
			}
			var r releasingValue
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("releasing %q: %w", k, err)
			}
			snap.Releasing = append(snap.Releasing, ipam.Releasing{Pool: pool, Addr: a, Since: r.Since})
			return nil
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketHoldings).ForEach(func(k, v []byte) error {
			var h holdingValue
			if err := json.Unmarshal(v, &h); err != nil {
				return fmt.Errorf("holding %q: %w", k, err)
			}
			s, err := addr.ParseSet(h.Addresses)
			if err != nil {
				return fmt.Errorf("holding %q: %w", k, err)
			}
			snap.Holdings = append(snap.Holdings, ipam.Holding{Pool: string(k), Addresses: s})
			return nil
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketAhead).ForEach(func(k, _ []byte) error {
			pool, a, err := decodeAddrKey(k)
			if err != nil {
				return err
			}
			snap.Ahead = append(snap.Ahead, ipam.Address{Pool: pool, Addr: a})
			return nil
		}); err != nil {
			return err
		}
		if v := tx.Bucket(bucketMeta).Get(keyRecordMark); v != nil {
			if err := json.Unmarshal(v, &snap.Mark); err != nil {
				return fmt.Errorf("record mark: %w", err)
			}
		}
		if v := tx.Bucket(bucketMeta).Get(keyHandback); v != nil {
			var m ipam.HandbackMark
			if err := json.Unmarshal(v, &m); err != nil {
				return fmt.Errorf("handback mark: %w", err)
			}
			snap.Handback = &m
		}
		if v := tx.Bucket(bucketMeta).Get(keyConfigPools); v != nil {
			if err := json.Unmarshal(v, &snap.ConfigPools); err != nil {
				return fmt.Errorf("config pools: %w", err)
			}
		}
		return tx.Bucket(bucketPools).ForEach(func(k, v []byte) error {
			var p ipam.Pool
			if err := json.Unmarshal(v, &p); err != nil {
				return fmt.Errorf("pool %q: %w", k, err)
			}
			snap.Pools = append(snap.Pools, p)
			return nil
		})
	})
	if err != nil {
		return ipam.Snapshot{}, fmt.Errorf("load journal %s: %w", j.path, err)
	}
	snap.Sort()
	return snap, nil
}

func decodeAddrKey(k []byte) (string, netip.Addr, error) {
	pool, s, err := splitKey(k)
	if err != nil {
		return "", netip.Addr{}, err
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return "", netip.Addr{}, fmt.Errorf("key %q: %w", strings.ReplaceAll(string(k), "\x00", "/"), err)
	}
	return pool, a, nil
}

// Verify runs bbolt's consistency check over the whole file and returns the problems found.
func (j *Journal) Verify() []error {
	var errs []error
	_ = j.db.View(func(tx *bolt.Tx) error {
		for err := range tx.Check() {
			errs = append(errs, err)
		}
		return nil
	})
	return errs
}
