package ipam

import (
	"net/netip"
	"slices"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// The node's own evidence. A pod's status and Multus' network-status are reports the kubelet and
// Multus wrote at some moment: they may be stale, and status.podIPs shows the default network
// only. The container runtime knows which pod sandboxes exist on the node now and, for the
// default network, which addresses they got (CRI ListPodSandbox and PodSandboxStatus). That is
// proof for the pod network; a secondary network's addresses are known to the runtime only
// inside the sandbox's network namespace, which the agent does not enter (docs/design.md,
// "The node forgets").

// RuntimeSandbox is one pod sandbox the container runtime shows on the node.
type RuntimeSandbox struct {
	ID  string
	Pod PodRef
	// Ready: the sandbox runs (CRI SANDBOX_READY). One that is not ready may still have its
	// network namespace, and so its addresses, until the kubelet stops it.
	Ready bool
	// IPs are the default network's addresses the runtime recorded for the sandbox.
	IPs []netip.Addr
}

// NodeSandboxes is one reading of the container runtime's pod sandboxes.
type NodeSandboxes struct {
	// Known: the runtime answered. Without it the reading proves nothing, and the rules fall
	// back to the pods' own reports, network by network (DecideHold).
	Known bool
	// Unreadable: the agent has a runtime to ask (--cri-socket) and it did not answer. A pod
	// deleted from the API server may still run a sandbox only the runtime shows, so nothing
	// leaves the hold before its deadline on the pods' reports alone (DecideHold).
	Unreadable bool
	Sandboxes  []RuntimeSandbox
}

// Shows reports whether the runtime shows a sandbox of the pod with uid, ready or not.
func (e NodeSandboxes) Shows(uid string) bool {
	return e.Known && uid != "" && slices.ContainsFunc(e.Sandboxes, func(sb RuntimeSandbox) bool { return sb.Pod.UID == uid })
}

// ReadyIPs returns the default network's addresses of the pod's ready sandboxes.
func (e NodeSandboxes) ReadyIPs(uid string) []netip.Addr {
	var out []netip.Addr
	for _, sb := range e.Sandboxes {
		if sb.Ready && sb.Pod.UID == uid {
			for _, ip := range sb.IPs {
				if !slices.Contains(out, ip) {
					out = append(out, ip)
				}
			}
		}
	}
	return out
}

// PodUses reports whether a sandbox of the pod with uid the runtime shows (ready or not) has ip.
func (e NodeSandboxes) PodUses(uid string, ip netip.Addr) bool {
	return slices.ContainsFunc(e.Sandboxes, func(sb RuntimeSandbox) bool { return sb.Pod.UID == uid && slices.Contains(sb.IPs, ip) })
}

// Uses returns every address a sandbox the runtime shows may hold (ready or not).
func (e NodeSandboxes) Uses() addr.Set {
	var as []netip.Addr
	for _, sb := range e.Sandboxes {
		as = append(as, sb.IPs...)
	}
	return addr.SetOfAddrs(as...)
}

// reportedOn is what the node can tell of the addresses pod uses on network: on the pod network,
// the runtime's ready sandboxes when the runtime shows the pod (proof), else status.podIPs; on a
// secondary network, Multus' network-status (the runtime does not know those addresses).
func reportedOn(pod Pod, network string, ev NodeSandboxes) []netip.Addr {
	if network == "" && ev.Shows(pod.Ref.UID) {
		return ev.ReadyIPs(pod.Ref.UID)
	}
	return pod.Reported(network)
}

// SetSandboxes takes a reading of the container runtime's pod sandboxes (see NodeSandboxes); the
// rebuild and the hold use the last one.
func (s *State) SetSandboxes(ev NodeSandboxes) { s.sandboxes = ev }

// Sandboxes returns the last reading of the runtime's pod sandboxes.
func (s *State) Sandboxes() NodeSandboxes { return s.sandboxes }
