package previous

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/durable"
	"github.com/ipwarden/ipwarden/internal/handback"
)

// ipwarden's reservations in the previous IPAM's own store (docs/design.md, "What the previous
// IPAM reserved"). Reading the previous IPAM's reservations at an ADD keeps ipwarden off what it
// reserved before the reading; the reservation below keeps the previous IPAM off what ipwarden
// hands out after it: while a node's configuration names "previous", every address ipwarden hands
// out there is first made unavailable in that IPAM's store, under that IPAM's own lock, before
// the ADD answers. An ADD through the previous IPAM that takes its lock late (a runtime still on
// the old configuration) then picks another address.
//
//   - host-local: a file <dataDir>/<network>/<address>, created under host-local's flock (its disk
//     backend creates its own with O_EXCL, so it never picks an address whose file exists). The
//     content is host-local's own for the ipwarden attachment's container and interface,
//     handback.Content, followed by a line break (OwnHostLocalContent): host-local never ends a
//     file with one, so ipwarden recognises its own files, and host-local's matching (the
//     content with spaces trimmed) sees the container's own reservation. So host-local's DEL of
//     that very container, which the plugin runs after the agent's DEL, removes it too, a
//     handback keeps it as the attachment's file, and host-local's DEL of any other container
//     never touches it.
//   - Whereabouts: an allocation in the IPPool whose spec.range contains the address, at its
//     offset, written with an update that carries the object's resourceVersion (Whereabouts
//     commits its own allocations the same way, so one of the two updates fails and reads
//     again). Its id is "ipwarden:<container ID>" (OwnWhereaboutsID), so Whereabouts' DEL (which
//     matches id and interface) never removes it and ipwarden recognises its own; its podref is
//     the pod's "<namespace>/<name>".

// OwnMark ends the content of ipwarden's host-local files.
const OwnMark = handback.LineBreak

// OwnHostLocalContent is the content of ipwarden's reservation file for container id's interface
// ifname.
func OwnHostLocalContent(id, ifname string) string { return handback.Content(id, ifname) + OwnMark }

// IsOwnHostLocal reports whether a host-local file's content is one of ipwarden's reservations.
func IsOwnHostLocal(content string) bool {
	return strings.HasSuffix(content, OwnMark) && strings.TrimSpace(content) != ""
}

// WhereaboutsIDPrefix starts the id of ipwarden's allocations in Whereabouts' IPPools.
const WhereaboutsIDPrefix = "ipwarden:"

// OwnWhereaboutsID is the id of ipwarden's Whereabouts allocation for container id.
func OwnWhereaboutsID(id string) string { return WhereaboutsIDPrefix + strings.TrimSpace(id) }

// Reservation is one address ipwarden makes unavailable in the previous IPAM's store for one
// of its attachments.
type Reservation struct {
	Addr                netip.Addr
	ContainerID, IfName string
	// Pod is the attachment's pod, "<namespace>/<name>" (Whereabouts' podref).
	Pod string
	// Adopted: the address is the pod's own already, adopted from its status (a pod that
	// started through the previous IPAM): the previous IPAM's own reservation of it, if it is
	// still there, is no conflict, and nothing is written over it.
	Adopted bool
}

// TakenError is a reservation refused: the previous IPAM holds Addrs itself. Nothing was written.
type TakenError struct {
	Kind  Kind
	Addrs addr.Set
}

func (e *TakenError) Error() string {
	return fmt.Sprintf("%s reserved %s itself since ipwarden's last reading of its reservations", e.Kind, e.Addrs)
}

// HostLocalPlan is what a reservation does in host-local's directory.
type HostLocalPlan struct {
	// Write: the files to create.
	Write []handback.Named
	// Replace: ipwarden's files of attachments that are gone (a crash between freeing the
	// attachment and removing its file, or between writing the file and journaling its ADD),
	// removed before their address's new file is written.
	Replace []netip.Addr
	// Taken: the addresses host-local reserved itself: the reservation is refused.
	Taken addr.Set
}

// PlanHostLocal decides the reservation of rs in host-local's directory, given its files
// (address -> content, handback.ReadExisting):
//   - no file: write ipwarden's;
//   - ipwarden's file for the same container and interface: kept (a repeated write);
//   - ipwarden's file for another attachment: ipwarden picked the address as free, so no
//     attachment of its uses it any more: replaced;
//   - host-local's own file: taken, unless the address is adopted (the pod's own reservation).
//
// Any taken address refuses the whole reservation (Taken set, nothing to write).
func PlanHostLocal(rs []Reservation, existing map[netip.Addr]string) HostLocalPlan {
	var p HostLocalPlan
	var taken []netip.Addr
	for _, r := range rs {
		a := r.Addr.Unmap()
		want := OwnHostLocalContent(r.ContainerID, r.IfName)
		have, ok := existing[a]
		switch {
		case !ok:
		case have == want:
			continue
		case IsOwnHostLocal(have):
			p.Replace = append(p.Replace, a)
		case r.Adopted:
			continue
		default:
			taken = append(taken, a)
			continue
		}
		p.Write = append(p.Write, handback.Named{Addr: a, Content: want})
	}
	if len(taken) > 0 {
		return HostLocalPlan{Taken: addr.SetOfAddrs(taken...)}
	}
	return p
}

// HostLocalStale returns the addresses of ipwarden's files in host-local's directory that name
// the freed reservations' attachment (exactly ipwarden's content for it): the files to remove.
// host-local's own files, and ipwarden's for other attachments, are kept.
func HostLocalStale(freed []Reservation, existing map[netip.Addr]string) []netip.Addr {
	var out []netip.Addr
	for _, r := range freed {
		a := r.Addr.Unmap()
		if existing[a] == OwnHostLocalContent(r.ContainerID, r.IfName) && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(x, y netip.Addr) int { return x.Compare(y) })
	return out
}

// ReserveHostLocal makes rs unavailable to host-local in dir (<dataDir>/<network>): under
// host-local's lock (waited for until ctx ends) it reads the directory, decides (PlanHostLocal),
// and writes each file durably (handback.WriteFiles: a temporary file synced, linked to its
// name, the directory synced). A taken address returns a *TakenError and writes nothing. dir is
// created as host-local would create it; its dataDir must exist (mounted into the agent).
func ReserveHostLocal(ctx context.Context, dir string, rs []Reservation) error {
	if err := visible(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create host-local's directory %s: %w", dir, err)
	}
	unlock, err := lock(ctx, dir)
	if err != nil {
		return err
	}
	defer unlock()
	existing, err := readFiles(dir, rs)
	if err != nil {
		return fmt.Errorf("read host-local's reservations in %s: %w", dir, err)
	}
	p := PlanHostLocal(rs, existing)
	if !p.Taken.IsEmpty() {
		return &TakenError{Kind: HostLocal, Addrs: p.Taken}
	}
	for _, a := range p.Replace {
		if err := os.Remove(filepath.Join(dir, a.String())); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove ipwarden's stale reservation %s: %w", a, err)
		}
	}
	if len(p.Write) == 0 {
		if len(p.Replace) > 0 {
			return durable.SyncDir(dir)
		}
		return nil
	}
	if _, err := handback.WriteFiles(dir, p.Write); err != nil {
		return fmt.Errorf("write ipwarden's reservation in host-local's directory %s: %w", dir, err)
	}
	return nil
}

// UnreserveHostLocal removes ipwarden's files of the freed reservations from dir, under
// host-local's lock; a missing dir holds none. It returns the addresses removed.
func UnreserveHostLocal(ctx context.Context, dir string, freed []Reservation) ([]netip.Addr, error) {
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	unlock, err := lock(ctx, dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	existing, err := readFiles(dir, freed)
	if err != nil {
		return nil, err
	}
	return handback.RemoveFiles(dir, HostLocalStale(freed, existing))
}

// readFiles reads the files of host-local's directory dir named by rs's addresses (address ->
// content; a missing file is left out): a reservation looks at its own addresses only, so its
// cost does not grow with the directory.
func readFiles(dir string, rs []Reservation) (map[netip.Addr]string, error) {
	out := map[netip.Addr]string{}
	for _, r := range rs {
		a := r.Addr.Unmap()
		b, err := os.ReadFile(filepath.Join(dir, a.String()))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out[a] = string(b)
	}
	return out, nil
}

// visible checks that dir's parent, host-local's dataDir, is there: one this process cannot see
// (not mounted into the agent's container) is an error, never an empty directory.
func visible(dir string) error {
	parent := filepath.Dir(dir)
	if _, err := os.Stat(parent); err != nil {
		return fmt.Errorf("host-local's dataDir %s is not visible to the agent (%v): mount it into the agent's container at the same path", parent, err)
	}
	return nil
}

// WhereaboutsAllocation is one entry of a Whereabouts IPPool's spec.allocations.
type WhereaboutsAllocation struct {
	ID     string `json:"id"`
	PodRef string `json:"podref"`
	IfName string `json:"ifname,omitempty"`
}

// WhereaboutsEdit is what a reservation (or its removal) changes in one IPPool: allocations to
// add (offset -> allocation) and offsets to remove.
type WhereaboutsEdit struct {
	Pool   string // as WhereaboutsPool.Name
	Add    map[string]WhereaboutsAllocation
	Remove []string
}

// PlanWhereabouts decides the reservation of rs in Whereabouts' IPPools (as just read): each
// address goes into the pool whose spec.range contains it, at its offset from the range's
// address, as ipwarden's allocation (id OwnWhereaboutsID, podref the pod, ifname the
// interface). An offset allocated already is kept when it is ipwarden's for the same container,
// replaced when it is ipwarden's for another (ipwarden picked the address as free: no attachment
// of its uses it), and taken when it is Whereabouts' own (unless adopted). An address no pool's
// range contains needs nothing: Whereabouts hands out only from its pools (the first ADD of a
// range Whereabouts never allocated from creates its pool; that is not covered). Any taken
// address refuses the whole reservation (taken set, no edits).
func PlanWhereabouts(rs []Reservation, pools []WhereaboutsPool) (edits []WhereaboutsEdit, taken addr.Set, err error) {
	byPool := map[string]*WhereaboutsEdit{}
	var order []string
	var tk []netip.Addr
	for _, r := range rs {
		a := r.Addr.Unmap()
		i, off, err := whereaboutsPlace(pools, a)
		if err != nil {
			return nil, addr.Set{}, err
		}
		if i < 0 {
			continue
		}
		p := pools[i]
		want := WhereaboutsAllocation{ID: OwnWhereaboutsID(r.ContainerID), PodRef: r.Pod, IfName: r.IfName}
		if have, ok := p.Allocations[off]; ok {
			switch {
			case have.ID == want.ID && have.IfName == want.IfName:
				continue
			case strings.HasPrefix(have.ID, WhereaboutsIDPrefix):
			case r.Adopted:
				continue
			default:
				tk = append(tk, a)
				continue
			}
		}
		e := byPool[p.Name]
		if e == nil {
			e = &WhereaboutsEdit{Pool: p.Name, Add: map[string]WhereaboutsAllocation{}}
			byPool[p.Name] = e
			order = append(order, p.Name)
		}
		e.Add[off] = want
	}
	if len(tk) > 0 {
		return nil, addr.SetOfAddrs(tk...), nil
	}
	for _, n := range order {
		edits = append(edits, *byPool[n])
	}
	return edits, addr.Set{}, nil
}

// PlanWhereaboutsRelease decides the removal of ipwarden's allocations of the freed reservations:
// each offset whose allocation is ipwarden's for the same container and interface. Whereabouts'
// own allocations, and ipwarden's for other attachments, are kept.
func PlanWhereaboutsRelease(freed []Reservation, pools []WhereaboutsPool) ([]WhereaboutsEdit, error) {
	var edits []WhereaboutsEdit
	for i, p := range pools {
		var rm []string
		for _, r := range freed {
			j, off, err := whereaboutsPlace(pools, r.Addr.Unmap())
			if err != nil {
				return nil, err
			}
			if j != i {
				continue
			}
			if have, ok := p.Allocations[off]; ok && have.ID == OwnWhereaboutsID(r.ContainerID) && have.IfName == r.IfName && !slices.Contains(rm, off) {
				rm = append(rm, off)
			}
		}
		if len(rm) > 0 {
			slices.Sort(rm)
			edits = append(edits, WhereaboutsEdit{Pool: p.Name, Remove: rm})
		}
	}
	return edits, nil
}

// whereaboutsPlace returns the index of the first pool whose range contains a and a's offset
// from the range's address (as spec.allocations keys it), or -1.
func whereaboutsPlace(pools []WhereaboutsPool, a netip.Addr) (int, string, error) {
	for i, p := range pools {
		pfx, err := netip.ParsePrefix(p.Range)
		if err != nil {
			return -1, "", fmt.Errorf("the Whereabouts IPPool %s: spec.range %q: %v", p.Name, p.Range, err)
		}
		base := pfx.Addr().Unmap()
		if !pfx.Masked().Contains(a) || base.BitLen() != a.BitLen() || a.Less(base) {
			continue
		}
		off := new(big.Int).Sub(new(big.Int).SetBytes(a.AsSlice()), new(big.Int).SetBytes(base.AsSlice()))
		return i, strconv.FormatUint(off.Uint64(), 10), nil
	}
	return -1, "", nil
}
