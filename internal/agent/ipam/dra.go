package ipam

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// DRA reservations (docs/design.md, "Addresses the scheduler can see (DRA)").
//
// The kubelet prepares a pod's ResourceClaims (NodePrepareResources) before it creates the pod's
// sandbox, so before the CNI ADD. Prepare reserves one address per allocated device of the
// driver ipam.ipwarden.io: a reservation is an attachment whose Key no CNI request can name
// (ReservationKey: the colon cannot appear in a container ID) and whose DRA says which claim,
// request and device it is for. It is journaled like any attachment, so it survives a restart;
// it holds its address the way an attachment does (in use), so no other ADD is ever handed it.
//
// The ADD of the claim's pod (by pod UID) on the reservation's interface shares the address: its
// attachment lists it, but the reservation stays its owner. The DEL of that attachment frees
// nothing of it (PlanDel skips addresses another key owns); Unprepare (a DEL of the reservation)
// frees it through the pool's cooldown, and is refused while an attachment still uses it. The
// level reconcile (Machine.ReconcileClaims) frees reservations whose claim is gone or no longer
// allocated to the node, under the same condition.

// reservationPrefix starts the container ID of reservation keys.
const reservationPrefix = "dra:"

// ClaimDevice says which claim, request and device of the driver a reservation is for.
type ClaimDevice struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// Request is the claim's request name, Device the allocated device (a slot of Pool).
	Request string `json:"request"`
	Device  string `json:"device"`
	// Interface is the CNI interface (CNI_IFNAME) whose ADD gets the address.
	Interface string `json:"interface"`
}

// String returns "namespace/name (uid) request/device".
func (c ClaimDevice) String() string {
	return fmt.Sprintf("%s/%s (%s) %s/%s", c.Namespace, c.Name, c.UID, c.Request, c.Device)
}

// ReservationKey is the key of the reservation for a claim's (request, device).
func ReservationKey(claimUID, request, device string) Key {
	return Key{ContainerID: reservationPrefix + claimUID + "/" + request, IfName: device}
}

// IsReservation reports whether k is a ReservationKey.
func (k Key) IsReservation() bool { return strings.HasPrefix(k.ContainerID, reservationPrefix) }

// ReserveRequest is a Prepare of one allocated device.
type ReserveRequest struct {
	Claim ClaimDevice
	// Pod is the claim's one reservedFor consumer.
	Pod PodRef
	// Pool is the IPPool the device is a slot of.
	Pool string
}

// ReservationBusyError refuses to release (or move to another pod) a reservation whose address
// an attachment still uses.
type ReservationBusyError struct {
	Key   Key
	Users []Key
}

func (e *ReservationBusyError) Error() string {
	us := make([]string, len(e.Users))
	for i, u := range e.Users {
		us[i] = u.String()
	}
	return fmt.Sprintf("reservation %s: its address is still attached (%s); the CNI DEL comes first", e.Key, strings.Join(us, ", "))
}

// Reserve reserves one address of req.Pool for the claim's device. A repeated Reserve of a known
// reservation returns it unchanged with an empty Change (the kubelet retries Prepare). A new
// reservation is pending like an ADD: the caller journals the Change, then applies the AddPlan
// (ConfirmAdd) or aborts it (AbortAdd). With no address to hand out it returns a *ShortError and
// changes nothing.
func (s *State) Reserve(req ReserveRequest, now time.Time) (Attachment, Change, error) {
	s.observe(now)
	k := ReservationKey(req.Claim.UID, req.Claim.Request, req.Claim.Device)
	if err := s.HandedBackRefusal(); err != nil {
		return Attachment{}, Change{}, err
	}
	if _, inFlight := s.pending[k]; inFlight {
		return Attachment{}, Change{}, &InFlightError{Key: k}
	}
	if a, ok := s.atts[k]; ok {
		if a.Pod.UID == req.Pod.UID && a.DRA != nil && a.DRA.Interface == req.Claim.Interface {
			return *a.clone(), Change{}, nil
		}
		// The claim now serves another pod (a named claim prepared again after its first
		// consumer went), or another interface: the same address, recorded anew, once no
		// attachment uses it.
		if users := s.ReservationUsers(k); len(users) > 0 {
			return Attachment{}, Change{}, &ReservationBusyError{Key: k, Users: users}
		}
		moved := a.clone()
		moved.Pod = req.Pod
		c := req.Claim
		moved.DRA = &c
		s.dropAttachment(k)
		s.putAttachment(moved)
		s.pending[k] = &undo{placeholder: a.clone()}
		return *moved.clone(), Change{PutAttachments: []Attachment{*moved.clone()}}, nil
	}
	p, ok := s.pools[req.Pool]
	if !ok || !p.known || !s.isServed(req.Pool) {
		return Attachment{}, Change{}, &ConfigError{Field: "device", Msg: fmt.Sprintf("device %s is a slot of IPPool %q, which does not serve node %s (pools serving it: %s)",
			req.Claim.Device, req.Pool, s.node, orNone(s.served))}
	}
	a, _, ok := p.next(now, s.reserved(req.Pool))
	if !ok || s.recordMissing {
		return Attachment{}, Change{}, &ShortError{Pools: []string{req.Pool}}
	}
	var ch Change
	u := &undo{}
	if c := p.take(a, k); c != nil {
		u.fromCooling = append(u.fromCooling, *c)
		ch.DeleteCooling = append(ch.DeleteCooling, Address{Pool: c.Pool, Addr: c.Addr})
	}
	c := req.Claim
	att := &Attachment{Key: k, Network: "", Pod: req.Pod, Addresses: []Address{{Pool: req.Pool, Addr: a}}, Created: now, DRA: &c}
	s.putAttachment(att)
	s.pending[k] = u
	delete(s.waiters, k)
	ch.PutAttachments = append(ch.PutAttachments, *att.clone())
	return *att.clone(), ch, nil
}

// Reservations returns the reservations, sorted by key.
func (s *State) Reservations() []Attachment {
	var out []Attachment
	for _, a := range s.atts {
		if a.DRA != nil {
			out = append(out, *a.clone())
		}
	}
	slices.SortFunc(out, func(a, b Attachment) int {
		return cmp.Or(cmp.Compare(a.Key.ContainerID, b.Key.ContainerID), cmp.Compare(a.Key.IfName, b.Key.IfName))
	})
	return out
}

// ReservationUsers returns the attachments that use reservation k's address, sorted.
func (s *State) ReservationUsers(k Key) []Key {
	r, ok := s.atts[k]
	if !ok || r.DRA == nil {
		return nil
	}
	var out []Key
	for _, ak := range s.PodAttachments(r.Pod.UID) {
		a := s.atts[ak]
		if ak == k || a.DRA != nil {
			continue
		}
		if slices.ContainsFunc(a.Addresses, func(ad Address) bool { return slices.Contains(r.Addresses, ad) }) {
			out = append(out, ak)
		}
	}
	return out
}

// reservationPicks returns, per pool, the address a prepared reservation of the ADD's pod holds
// for the ADD's interface: the ADD gets exactly those. Pending reservations (their journal write
// is in flight) are left out: their Prepare has not been answered, so no ADD can follow it yet.
func (s *State) reservationPicks(req AddRequest) map[string]Address {
	if req.Pod.UID == "" {
		return nil
	}
	var out map[string]Address
	for _, k := range s.PodAttachments(req.Pod.UID) {
		a := s.atts[k]
		if a.DRA == nil || a.DRA.Interface != req.Key.IfName || s.pending[k] != nil {
			continue
		}
		for _, ad := range a.Addresses {
			if out == nil {
				out = map[string]Address{}
			}
			if _, dup := out[ad.Pool]; !dup {
				out[ad.Pool] = ad
			}
		}
	}
	return out
}

// reservedForAnother refuses (CNI code 11) the ADD of a pod that uses a ResourceClaim of the
// driver whose reservation for this interface was made for another pod: a named claim shared by
// two pods. The kubelet prepares a claim once per node, so the second pod's ADD is the first the
// agent hears of it; it must not run with an ordinary address that its claim's networkData does
// not name (issue 37). Nothing is taken from the first pod.
func (s *State) reservedForAnother(req AddRequest) error {
	if len(req.Meta.ResourceClaims) == 0 {
		return nil
	}
	var first *Attachment // the lowest claim name, so the message does not change between tries
	for _, a := range s.atts {
		if a.DRA == nil || a.DRA.Interface != req.Key.IfName || a.DRA.Namespace != req.Pod.Namespace ||
			!slices.Contains(req.Meta.ResourceClaims, a.DRA.Name) || a.Pod.UID == req.Pod.UID {
			continue
		}
		if first == nil || a.DRA.Name < first.DRA.Name {
			first = a
		}
	}
	if first == nil {
		return nil
	}
	return &ClaimError{Msg: fmt.Sprintf("ResourceClaim %s/%s's address for interface %s is reserved for pod %s: a claim of the driver ipam.ipwarden.io "+
		"is one pod's address (give each pod its own claim, from a ResourceClaimTemplate)", first.DRA.Namespace, first.DRA.Name, req.Key.IfName, first.Pod)}
}

// withReservationPools returns pools followed by the pools of picks that it lacks, by name.
func withReservationPools(pools []string, picks map[string]Address) []string {
	var extra []string
	for name := range picks {
		if !slices.Contains(pools, name) {
			extra = append(extra, name)
		}
	}
	slices.Sort(extra)
	return append(pools, extra...)
}

// sharesReservation reports whether attachment att may list address ad that reservation owner
// holds: the reservation's pod's own attachment.
func (s *State) sharesReservation(owner Key, att *Attachment, ad Address) bool {
	r := s.atts[owner]
	return r != nil && r.DRA != nil && att.DRA == nil && r.Pod.UID != "" && r.Pod.UID == att.Pod.UID &&
		slices.Contains(r.Addresses, ad)
}

// reservationsFirst returns atts with the reservations first, so Restore gives them their
// addresses before the attachments that share them.
func reservationsFirst(atts []Attachment) []Attachment {
	out := slices.Clone(atts)
	slices.SortStableFunc(out, func(a, b Attachment) int {
		return cmp.Compare(boolInt(a.DRA == nil), boolInt(b.DRA == nil))
	})
	return out
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// ClaimPrefixes returns reservation att's addresses as canonical CIDRs with their pools' prefix
// lengths (what networkData.ips must hold: the API server rejects any other form).
func (s *State) ClaimPrefixes(att Attachment) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(att.Addresses))
	for _, ad := range att.Addresses {
		cfg, _ := s.PoolConfig(ad.Pool)
		out = append(out, cfg.Prefix(ad.Addr))
	}
	return out
}

// ClaimCapacity is what a pool lets the node promise DRA claims: Reserved addresses are held by
// reservations now; Headroom is how many reservations in all the node could hold (the reserved
// ones included): its maxPerNode less the addresses other attachments use and the IPAMClaim-bound
// addresses it holds idle (those it is giving back count as available: the controller takes them
// back within seconds), or, while the pool is exhausted (the controller has nothing more to
// grant), the reserved ones and what the node could hand out now, bound addresses excepted.
type ClaimCapacity struct {
	Pool     string
	Network  string
	IPv4     bool
	Reserved int
	Headroom int
	// MaxPerNode is the pool's maxPerNode (0: none).
	MaxPerNode int
}

// ClaimCapacities returns the capacity of every pool that serves the node, in ADD order.
func (s *State) ClaimCapacities(now time.Time) []ClaimCapacity {
	s.observe(now)
	free := map[string]int{}
	for _, st := range s.Stats(now) {
		free[st.Pool] = st.Free
	}
	var out []ClaimCapacity
	for _, name := range s.served {
		p := s.pools[name]
		c := ClaimCapacity{Pool: name, Network: p.cfg.Network, IPv4: p.cfg.Is4(), MaxPerNode: p.cfg.Scaling.MaxPerNode}
		other := 0
		for _, k := range p.inUse {
			if k.IsReservation() {
				c.Reserved++
			} else {
				other++
			}
		}
		// Addresses bound to an IPAMClaim that the node holds while no attachment uses them
		// (a VM between its launchers) are no one else's: they are not headroom, and they take
		// a place within maxPerNode like an address in use.
		idleBound := 0
		if p.heldKnown {
			idleBound = count(s.claimBound(name).Intersect(p.held).Subtract(p.inUseSet()))
		}
		if p.cfg.Exhausted || p.cfg.Scaling.MaxPerNode <= 0 {
			c.Headroom = c.Reserved + max(free[name]-idleBound, 0)
		} else {
			// Addresses the node is giving back are not subtracted: they leave its holding within
			// seconds, and counting them would shrink and regrow the slots at every scale-down.
			c.Headroom = max(c.Reserved, p.cfg.Scaling.MaxPerNode-other-idleBound)
		}
		out = append(out, c)
	}
	return out
}
