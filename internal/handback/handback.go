// Package handback hands a node back from ipwarden to host-local, the IPAM it may have taken the
// node over from ("going back", docs/operations.md): it writes host-local's reservation files
// for the addresses ipwarden's attachments on the node still use, so host-local, once the node's
// CNI configuration names it again, never hands one of them to a new pod, and frees each at its
// pod's DEL (host-local's ReleaseByID matches the file's container ID and interface).
//
// Every decision is a pure function (ParseTarget, Check, Plan); Lock, ReadExisting and Write are
// the thin IO around them. Only host-local can be handed back to: its reservations are files on
// the node, which ipwarden can write. Any other IPAM (Whereabouts keeps its reservations in the
// cluster's IPPool objects) is refused: drain the node instead.
package handback

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// MaxConfig bounds the host-local ipam object handed to ParseTarget (and carried in the agent
// request): a host-local object with a few range sets is a few hundred bytes.
const MaxConfig = 16 << 10

// DefaultDataDir is host-local's dataDir when its configuration names none.
const DefaultDataDir = "/var/lib/cni/networks"

// LineBreak separates a reservation file's container ID and interface name, as host-local's
// disk backend writes them (backend/disk: Reserve writes strings.TrimSpace(id)+LineBreak+ifname).
const LineBreak = "\r\n"

// Range is one range of host-local's configuration, canonical as host-local makes it: Start,
// End and Gateway are set.
type Range struct {
	Subnet     netip.Prefix
	Start, End netip.Addr
	Gateway    netip.Addr
}

// Contains reports whether host-local may hand out a from r (the gateway aside): a inside the
// subnet and between Start and End.
func (r Range) Contains(a netip.Addr) bool {
	a = a.Unmap()
	return r.Subnet.Contains(a) && r.Start.Compare(a) <= 0 && a.Compare(r.End) <= 0
}

func (r Range) String() string { return fmt.Sprintf("%s-%s of %s", r.Start, r.End, r.Subnet) }

// Target is the host-local configuration a node is handed back to.
type Target struct {
	// Ranges are its range sets (the legacy top-level subnet first, as host-local orders them).
	Ranges [][]Range
	// DataDir is its "dataDir" ("" when it names none: DefaultDataDir).
	DataDir string
}

// Dir is where host-local keeps the reservations of network: <dataDir>/<network>.
func (t Target) Dir(network string) string {
	d := t.DataDir
	if d == "" {
		d = DefaultDataDir
	}
	return strings.TrimRight(d, "/") + "/" + network
}

// find returns the range containing a, or false.
func (t Target) find(a netip.Addr) (Range, bool) {
	for _, set := range t.Ranges {
		for _, r := range set {
			if r.Contains(a) {
				return r, true
			}
		}
	}
	return Range{}, false
}

// UnsupportedError refuses a handback to an IPAM other than host-local.
type UnsupportedError struct{ Type string }

func (e *UnsupportedError) Error() string {
	why := "ipwarden can write only host-local's reservations (files on the node)"
	if e.Type == "whereabouts" {
		why = "Whereabouts keeps its reservations in the cluster's Whereabouts IPPool objects, which ipwarden does not write, " +
			"so Whereabouts would hand the addresses of the node's running pods to new pods"
	}
	return fmt.Sprintf("cannot hand the node back to IPAM type %q: %s; drain the node (kubectl drain) so no pod holds an address from ipwarden, "+
		"then switch its CNI configuration back", e.Type, why)
}

// hostLocalJSON is host-local's ipam object, the fields the handback reads.
type hostLocalJSON struct {
	Type       string        `json:"type"`
	DataDir    string        `json:"dataDir"`
	Ranges     [][]rangeJSON `json:"ranges"`
	Subnet     string        `json:"subnet"`
	RangeStart string        `json:"rangeStart"`
	RangeEnd   string        `json:"rangeEnd"`
	Gateway    string        `json:"gateway"`
}

type rangeJSON struct {
	Subnet     string `json:"subnet"`
	RangeStart string `json:"rangeStart"`
	RangeEnd   string `json:"rangeEnd"`
	Gateway    string `json:"gateway"`
}

// ParseTarget reads the ipam object of the CNI configuration the node goes back to. It must be
// host-local (an *UnsupportedError otherwise) with at least one range; the ranges are checked
// and completed as host-local does (Range.Canonicalize): the subnet has no host bits and at
// least 4 addresses, the gateway defaults to the subnet's first address, the start to the
// same, the end to the subnet's last address (IPv4: the one before the broadcast address), and
// start and end lie inside the subnet.
func ParseTarget(raw []byte) (Target, error) {
	if len(raw) > MaxConfig {
		return Target{}, fmt.Errorf("the ipam configuration has %d bytes, at most %d", len(raw), MaxConfig)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	var c hostLocalJSON
	if err := dec.Decode(&c); err != nil {
		return Target{}, fmt.Errorf("the ipam configuration is not a JSON object: %w", err)
	}
	if dec.More() {
		return Target{}, errors.New("the ipam configuration has data after its JSON object")
	}
	switch c.Type {
	case "host-local":
	case "":
		return Target{}, errors.New(`the ipam configuration has no "type": give host-local's ipam object, e.g. {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]]}`)
	default:
		return Target{}, &UnsupportedError{Type: c.Type}
	}
	t := Target{DataDir: c.DataDir}
	if c.Subnet != "" {
		r, err := canonical(rangeJSON{Subnet: c.Subnet, RangeStart: c.RangeStart, RangeEnd: c.RangeEnd, Gateway: c.Gateway})
		if err != nil {
			return Target{}, fmt.Errorf("the top-level subnet: %w", err)
		}
		t.Ranges = append(t.Ranges, []Range{r})
	}
	for i, set := range c.Ranges {
		if len(set) == 0 {
			return Target{}, fmt.Errorf("range set %d is empty", i)
		}
		var rs []Range
		for j, rj := range set {
			r, err := canonical(rj)
			if err != nil {
				return Target{}, fmt.Errorf("range set %d, range %d: %w", i, j, err)
			}
			rs = append(rs, r)
		}
		t.Ranges = append(t.Ranges, rs)
	}
	if len(t.Ranges) == 0 {
		return Target{}, errors.New(`the host-local configuration has no ranges ("ranges" or "subnet")`)
	}
	return t, nil
}

func canonical(rj rangeJSON) (Range, error) {
	var r Range
	if rj.Subnet == "" {
		return r, errors.New(`no "subnet"`)
	}
	p, err := netip.ParsePrefix(rj.Subnet)
	if err != nil {
		return r, fmt.Errorf("subnet: %w", err)
	}
	if p.Addr().Is4In6() {
		return r, fmt.Errorf("subnet %s: give an IPv4 subnet in IPv4 notation", rj.Subnet)
	}
	if p.Masked() != p {
		return r, fmt.Errorf("subnet %s has host bits set (the network address is %s)", rj.Subnet, p.Masked().Addr())
	}
	if p.Bits() > p.Addr().BitLen()-2 {
		return r, fmt.Errorf("subnet %s is too small to allocate from", p)
	}
	r.Subnet = p
	addrIn := func(what, s string, def netip.Addr) (netip.Addr, error) {
		if s == "" {
			return def, nil
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return a, fmt.Errorf("%s: %w", what, err)
		}
		a = a.Unmap()
		if !p.Contains(a) {
			return a, fmt.Errorf("%s %s is not in subnet %s", what, a, p)
		}
		return a, nil
	}
	first := p.Addr().Next()
	// host-local does not require the gateway inside the subnet; one elsewhere is simply never
	// one of the range's addresses.
	r.Gateway = first
	if rj.Gateway != "" {
		if r.Gateway, err = netip.ParseAddr(rj.Gateway); err != nil {
			return r, fmt.Errorf("gateway: %w", err)
		}
		r.Gateway = r.Gateway.Unmap()
	}
	if r.Start, err = addrIn("rangeStart", rj.RangeStart, first); err != nil {
		return r, err
	}
	if r.End, err = addrIn("rangeEnd", rj.RangeEnd, lastAddr(p)); err != nil {
		return r, err
	}
	if r.End.Less(r.Start) {
		return r, fmt.Errorf("rangeEnd %s is before rangeStart %s", r.End, r.Start)
	}
	return r, nil
}

// lastAddr is host-local's default range end: the subnet's last address, for IPv4 the one before
// the broadcast address.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	bits := p.Bits()
	for i := range b {
		for k := 0; k < 8; k++ {
			if i*8+k >= bits {
				b[i] |= 1 << (7 - k)
			}
		}
	}
	a, _ := netip.AddrFromSlice(b)
	if a.Is4() {
		a = a.Prev()
	}
	return a
}

// Attachment is one of ipwarden's attachments on the node, as the handback sees it.
type Attachment struct {
	ContainerID, IfName string
	// Pod is "namespace/name" ("" when unknown).
	Pod       string
	Addresses []netip.Addr
	// Rebuilt: recorded from the pod's status.podIPs (taken over from the previous IPAM, or a
	// lost journal); its container ID is unknown.
	Rebuilt bool
}

func (a Attachment) who() string {
	if a.Pod != "" {
		return "pod " + a.Pod
	}
	return "container " + a.ContainerID + " interface " + a.IfName
}

// File is one reservation file to write: <dir>/<Addr> holding Content.
type File struct {
	Addr                netip.Addr
	ContainerID, IfName string
	Pod                 string
}

// Content is what host-local writes for the reservation, and what its ReleaseByID matches.
func (f File) Content() string { return Content(f.ContainerID, f.IfName) }

// Content is a reservation file's content for container id's interface ifname.
func Content(id, ifname string) string { return strings.TrimSpace(id) + LineBreak + ifname }

// RefusedError is a handback refused: nothing was written. Problems name each pod and address
// that makes it unsafe.
type RefusedError struct {
	Problems []string
}

func (e *RefusedError) Error() string {
	return "handback refused, nothing written: " + strings.Join(e.Problems, "; ")
}

// Check decides what can be decided without host-local's files: every address ipwarden's
// attachments use must be one host-local could hand out from target (inside a range, and not a
// range's gateway). An address outside would be handed by host-local to nobody but also freed
// by nobody, and ipwarden could no longer answer for it: refused, naming the pods and addresses.
func Check(atts []Attachment, target Target) error {
	var problems []string
	for _, a := range atts {
		for _, ip := range a.Addresses {
			r, ok := target.find(ip)
			switch {
			case !ok:
				problems = append(problems, fmt.Sprintf("%s uses %s, outside every range of the host-local configuration (%s)", a.who(), ip, rangesString(target)))
			case r.Gateway == ip.Unmap():
				problems = append(problems, fmt.Sprintf("%s uses %s, the gateway of host-local's range %s", a.who(), ip, r))
			}
		}
	}
	if len(problems) > 0 {
		return &RefusedError{Problems: problems}
	}
	return nil
}

func rangesString(t Target) string {
	var parts []string
	for _, set := range t.Ranges {
		for _, r := range set {
			parts = append(parts, r.String())
		}
	}
	return strings.Join(parts, ", ")
}

// Plan decides the reservation files to write for atts, given host-local's existing files
// (address -> content) in the network's directory: Check first, then per address
//   - no file: write one holding the attachment's container ID and interface;
//   - a file with that same content (an earlier handback, or host-local's own reservation): keep it;
//   - a file for another container: refused, naming it (host-local believes it handed the
//     address to that container; overwriting its file would let one of them lose it);
//   - an attachment rebuilt from its pod's status (container ID unknown): the file host-local
//     made before ipwarden took the node over must still be there (its pod's DEL will free it);
//     without one, refused: ipwarden cannot write a file host-local would ever free.
//
// The files come sorted by address. Any problem refuses the whole handback (a *RefusedError or
// Check's error): nothing is to be written.
func Plan(atts []Attachment, target Target, existing map[netip.Addr]string) ([]File, error) {
	if err := Check(atts, target); err != nil {
		return nil, err
	}
	var files []File
	var problems []string
	seen := map[netip.Addr]string{}
	for _, a := range atts {
		for _, ip := range a.Addresses {
			ip = ip.Unmap()
			if other, dup := seen[ip]; dup {
				problems = append(problems, fmt.Sprintf("%s and %s both use %s", other, a.who(), ip))
				continue
			}
			seen[ip] = a.who()
			have, exists := existing[ip]
			if a.Rebuilt {
				if !exists {
					problems = append(problems, fmt.Sprintf("%s uses %s, which ipwarden recorded from the pod's status (it does not know the pod's sandbox ID) "+
						"and host-local has no reservation for: host-local could not free one at the pod's DEL; delete the pod first", a.who(), ip))
				}
				continue
			}
			want := Content(a.ContainerID, a.IfName)
			if exists {
				if strings.TrimSpace(have) != strings.TrimSpace(want) {
					id, _, _ := strings.Cut(strings.TrimSpace(have), "\n")
					problems = append(problems, fmt.Sprintf("%s uses %s, which host-local already reserves for container %q (file %s): "+
						"host-local believes it handed the address out; find that container before going back", a.who(), ip, strings.TrimSpace(id), ip))
				}
				continue
			}
			files = append(files, File{Addr: ip, ContainerID: strings.TrimSpace(a.ContainerID), IfName: a.IfName, Pod: a.Pod})
		}
	}
	if len(problems) > 0 {
		return nil, &RefusedError{Problems: problems}
	}
	slices.SortFunc(files, func(x, y File) int { return x.Addr.Compare(y.Addr) })
	return files, nil
}

// Stale decides which of host-local's reservation files name attachments that are gone: the
// addresses of freed whose file holds exactly that attachment's container ID and interface.
// Those files are the handback's (or host-local's own) for a container that no longer exists:
// host-local would never free them, since no DEL for that container will reach it. A file naming
// another container (host-local handed the address out again) is kept. Sorted by address.
func Stale(freed []Attachment, existing map[netip.Addr]string) []netip.Addr {
	var out []netip.Addr
	for _, a := range freed {
		if a.Rebuilt {
			continue // its container ID is unknown: its file is host-local's own, freed by the pod's DEL
		}
		want := strings.TrimSpace(Content(a.ContainerID, a.IfName))
		for _, ip := range a.Addresses {
			ip = ip.Unmap()
			if have, ok := existing[ip]; ok && strings.TrimSpace(have) == want && !slices.Contains(out, ip) {
				out = append(out, ip)
			}
		}
	}
	slices.SortFunc(out, func(x, y netip.Addr) int { return x.Compare(y) })
	return out
}
