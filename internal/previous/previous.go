// Package previous reads what the IPAM a node ran before ipwarden (the CNI configuration's
// "previous" object) has reserved, so the agent keeps those addresses out of use until that IPAM
// releases them (docs/design.md, "Taking over from another IPAM": the previous IPAM's
// reservations). A pod whose ADD went through the previous IPAM just before the node switched to
// ipwarden uses its address before its status.podIPs shows it; its reservation is the only
// record of it until then.
//
// What the previous IPAM reserved is read where it keeps it:
//   - host-local: one file per address in <dataDir>/<network>, read under host-local's own
//     lock (flock on <dataDir>/<network>/lock, as its disk backend takes it), so a host-local
//     ADD or DEL is wholly before or wholly after the read;
//   - Whereabouts: the allocations of its IPPool objects (whereabouts.cni.cncf.io/v1alpha1),
//     read from the API server (a fresh list, not a cache), whose update is the commit of every
//     Whereabouts allocation.
//
// The decisions (which file names and allocations are reservations, what a configuration names)
// are pure functions with table tests; ReadHostLocal is the thin IO around them.
package previous

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// MaxConfig bounds the "previous" object the plugin forwards with an ADD: an IPAM configuration
// is a few hundred bytes.
const MaxConfig = 16 << 10

// DefaultHostLocalDataDir is host-local's dataDir when its configuration names none.
const DefaultHostLocalDataDir = "/var/lib/cni/networks"

// maxEntries bounds the directory entries ReadHostLocal reads: host-local keeps one file per
// address it reserved (a node runs at most a few hundred pods).
const maxEntries = 1 << 16

// Kind says where an IPAM type keeps its reservations.
type Kind int

const (
	// Unreadable: a type whose reservations ipwarden cannot read (anything but host-local and
	// Whereabouts). Nothing is kept out of use for it; docs/operations.md says what to do.
	Unreadable Kind = iota
	// HostLocal: files on the node (Source.Dir).
	HostLocal
	// Whereabouts: IPPool objects in the cluster.
	Whereabouts
)

func (k Kind) String() string {
	switch k {
	case HostLocal:
		return "host-local"
	case Whereabouts:
		return "whereabouts"
	}
	return "unreadable"
}

// Source is where the previous IPAM of one CNI network keeps its reservations.
type Source struct {
	Kind Kind
	// Type is the configuration's "type".
	Type string
	// Dir is host-local's directory of the network's reservations: <dataDir>/<network>.
	Dir string
	// DataDir is host-local's dataDir (DefaultHostLocalDataDir when the configuration names none).
	DataDir string
}

// NodeLocal reports whether the reservations belong to this node alone (host-local's files): the
// agent claims those in its pools that the node does not hold, so no other node is granted them.
// Whereabouts' reservations are the cluster's, of pods on any node.
func (s Source) NodeLocal() bool { return s.Kind == HostLocal }

// Parse reads the "previous" object (the previous IPAM's ipam object) of the CNI network named
// network. host-local's directory is <dataDir>/<network>, as host-local makes it.
func Parse(raw []byte, network string) (Source, error) {
	if len(raw) > MaxConfig {
		return Source{}, fmt.Errorf("the previous IPAM's configuration has %d bytes, at most %d", len(raw), MaxConfig)
	}
	var obj struct {
		Type    string `json:"type"`
		DataDir string `json:"dataDir"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil {
		return Source{}, fmt.Errorf("the previous IPAM's configuration is not a JSON object: %v", err)
	}
	if obj.Type == "" {
		return Source{}, errors.New(`the previous IPAM's configuration has no "type"`)
	}
	src := Source{Type: obj.Type}
	switch obj.Type {
	case "host-local":
		if network == "" || strings.ContainsAny(network, `/\`) || network == "." || network == ".." {
			return Source{}, fmt.Errorf("host-local keeps its reservations in <dataDir>/<network name>, and the network name %q is not a directory name", network)
		}
		src.Kind, src.DataDir = HostLocal, obj.DataDir
		if src.DataDir == "" {
			src.DataDir = DefaultHostLocalDataDir
		}
		if !filepath.IsAbs(src.DataDir) {
			return Source{}, fmt.Errorf("host-local's dataDir %q is not an absolute path", obj.DataDir)
		}
		src.Dir = filepath.Join(src.DataDir, network)
	case "whereabouts":
		src.Kind = Whereabouts
	}
	return src, nil
}

// HostLocalReserved returns the addresses host-local's directory entries name: each reservation
// is a regular file named by its address (backend/disk: Reserve); the lock, last_reserved_ip.<n>
// and anything else are not reservations, nor are ipwarden's own files (reserve.go): their
// address is ipwarden's, in use by the attachment the file names or, if that attachment is gone
// (a crash before the file's removal), free for ipwarden's next ADD, which replaces the file.
func HostLocalReserved(entries []Entry) addr.Set {
	var as []netip.Addr
	for _, e := range entries {
		if !e.Regular || e.Own {
			continue
		}
		a, err := netip.ParseAddr(e.Name)
		if err != nil || a.Zone() != "" {
			continue
		}
		as = append(as, a.Unmap())
	}
	return addr.SetOfAddrs(as...)
}

// Entry is one directory entry of host-local's directory.
type Entry struct {
	Name    string
	Regular bool
	// Own: the file is one of ipwarden's reservations (IsOwnHostLocal).
	Own bool
}

// ReadHostLocal reads host-local's reservations in dir under host-local's lock. A missing dir
// holds none (host-local has reserved nothing on this network), but only if its parent (the
// dataDir) is there: a dataDir this process cannot see (not mounted into the agent's container)
// is an error, never an empty reading.
//
// The lock is waited for until ctx ends: host-local holds it for milliseconds per ADD or DEL, and
// a host-local that hangs holding it must not hang the agent's ADDs with it.
func ReadHostLocal(ctx context.Context, dir string) (addr.Set, error) {
	return ReadHostLocalKnown(ctx, dir, nil)
}

// ReadHostLocalKnown is ReadHostLocal with known, what earlier readings of dir found of each
// file (name -> whether it is ipwarden's own), updated in place: a file already known is not
// opened again, so a reading costs a directory listing plus one small read per new file. A name
// gone from the listing is forgotten. Knowing a file by its name alone is safe both ways: a name
// ipwarden's file took over from host-local's counts as host-local's, and its address is in use
// by ipwarden's attachment anyway; a name host-local's file took over from ipwarden's counts as
// ipwarden's, and ipwarden's reservation of that address, which reads that very file under the
// lock, finds it host-local's and picks another (TakenError). Nil known reads every file.
func ReadHostLocalKnown(ctx context.Context, dir string, known map[string]bool) (addr.Set, error) {
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		parent := filepath.Dir(dir)
		if _, perr := os.Stat(parent); perr != nil {
			return addr.Set{}, fmt.Errorf("host-local's dataDir %s is not visible to the agent (%v): mount it into the agent's container at the same path", parent, perr)
		}
		return addr.Set{}, nil
	} else if err != nil {
		return addr.Set{}, fmt.Errorf("read host-local's reservations in %s: %w", dir, err)
	}
	unlock, err := lock(ctx, dir)
	if err != nil {
		return addr.Set{}, err
	}
	defer unlock()
	ents, err := os.ReadDir(dir)
	if err != nil {
		return addr.Set{}, fmt.Errorf("read host-local's reservations in %s: %w", dir, err)
	}
	if len(ents) > maxEntries {
		return addr.Set{}, fmt.Errorf("%s has %d entries, more than the %d the agent reads", dir, len(ents), maxEntries)
	}
	es := make([]Entry, len(ents))
	seen := make(map[string]bool, len(ents))
	for i, e := range ents {
		es[i] = Entry{Name: e.Name(), Regular: e.Type().IsRegular()}
		if _, err := netip.ParseAddr(e.Name()); err != nil || !es[i].Regular {
			continue
		}
		seen[e.Name()] = true
		own, ok := known[e.Name()]
		if !ok {
			if own, err = ownFile(filepath.Join(dir, e.Name())); err != nil {
				return addr.Set{}, fmt.Errorf("read host-local's reservations in %s: %w", dir, err)
			}
			if known != nil {
				known[e.Name()] = own
			}
		}
		es[i].Own = own
	}
	for n := range known {
		if !seen[n] {
			delete(known, n)
		}
	}
	return HostLocalReserved(es), nil
}

// ownFile reports whether the reservation file at path is one of ipwarden's: it reads its last
// bytes only (a container ID, a line break and an interface name are at most a few hundred).
func ownFile(path string) (bool, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	b := make([]byte, 512)
	n, err := f.Read(b)
	if err != nil && !errors.Is(err, io.EOF) {
		return false, err
	}
	return IsOwnHostLocal(string(b[:n])), nil
}

// lock takes host-local's lock on dir: an exclusive flock on dir/lock, as host-local's disk
// backend takes it for every ADD, DEL and GC (it creates the file as host-local would). It tries
// without blocking, again after a pause growing from 1 ms to 20 ms, until ctx ends.
func lock(ctx context.Context, dir string) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open host-local's lock: %w", err)
	}
	pause := time.Millisecond
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("take host-local's lock %s: %w", f.Name(), err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("host-local's lock %s is held by another process (a host-local ADD or DEL) and was not released in time: %w", f.Name(), ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, 20*time.Millisecond)
	}
}

// WhereaboutsPool is the part of a Whereabouts IPPool object (whereabouts.cni.cncf.io/v1alpha1)
// that says what it reserves: spec.range and the keys of spec.allocations.
type WhereaboutsPool struct {
	Name  string
	Range string
	// Offsets are the keys of spec.allocations: each reserved address's offset from the
	// address spec.range is written with (Whereabouts' toIPReservationList).
	Offsets []string
	// Allocations are spec.allocations' entries, by offset.
	Allocations map[string]WhereaboutsAllocation
}

// WhereaboutsPoolOf reads a Whereabouts IPPool object in its JSON form (as an unstructured
// object holds it).
func WhereaboutsPoolOf(obj map[string]any) WhereaboutsPool {
	meta, _ := obj["metadata"].(map[string]any)
	spec, _ := obj["spec"].(map[string]any)
	p := WhereaboutsPool{}
	p.Name, _ = meta["name"].(string)
	p.Range, _ = spec["range"].(string)
	allocs, _ := spec["allocations"].(map[string]any)
	for off, v := range allocs {
		p.Offsets = append(p.Offsets, off)
		m, _ := v.(map[string]any)
		var a WhereaboutsAllocation
		a.ID, _ = m["id"].(string)
		a.PodRef, _ = m["podref"].(string)
		a.IfName, _ = m["ifname"].(string)
		if p.Allocations == nil {
			p.Allocations = map[string]WhereaboutsAllocation{}
		}
		p.Allocations[off] = a
	}
	slices.Sort(p.Offsets)
	return p
}

// WhereaboutsReserved returns the addresses Whereabouts' IPPools reserve: spec.range's address
// plus each allocation's offset; ipwarden's own allocations (reserve.go) are not Whereabouts'
// reservations. An IPPool that cannot be read (a bad range or offset) is an
// error: its allocations are reservations the agent cannot place.
//
// OverlappingRangeIPReservation objects are not read: Whereabouts writes one after the IPPool
// update that commits the allocation and deletes it after the update that releases it, so the
// IPPools' allocations already hold every address a pod may have from Whereabouts, and listing
// those objects (one per Whereabouts pod in the cluster) at every ADD would cost far more.
func WhereaboutsReserved(pools []WhereaboutsPool) (addr.Set, error) {
	var as []netip.Addr
	for _, p := range pools {
		pfx, err := netip.ParsePrefix(p.Range)
		if err != nil {
			return addr.Set{}, fmt.Errorf("the Whereabouts IPPool %s: spec.range %q: %v", p.Name, p.Range, err)
		}
		base := pfx.Addr().Unmap()
		n := base.BitLen() / 8
		for _, off := range p.Offsets {
			if strings.HasPrefix(p.Allocations[off].ID, WhereaboutsIDPrefix) {
				continue // ipwarden's own (reserve.go)
			}
			o, err := strconv.ParseUint(off, 10, 64)
			if err != nil {
				return addr.Set{}, fmt.Errorf("the Whereabouts IPPool %s: allocation offset %q is not a number", p.Name, off)
			}
			sum := new(big.Int).Add(new(big.Int).SetBytes(base.AsSlice()), new(big.Int).SetUint64(o))
			if sum.BitLen() > base.BitLen() {
				return addr.Set{}, fmt.Errorf("the Whereabouts IPPool %s: allocation offset %d lies beyond the address space of %s", p.Name, o, p.Range)
			}
			a, _ := netip.AddrFromSlice(sum.FillBytes(make([]byte, n)))
			as = append(as, a)
		}
	}
	return addr.SetOfAddrs(as...), nil
}
