package check

import (
	"context"
	"fmt"
	"net/netip"
	"strings"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// FromAgent converts an agent's LIST answer into the checker's attachments.
func FromAgent(node string, atts []cniproto.Attachment) []Attachment {
	out := make([]Attachment, 0, len(atts))
	for _, a := range atts {
		at := Attachment{Node: node, ContainerID: a.ContainerID, IfName: a.IfName, PodNamespace: a.Pod.Namespace,
			PodName: a.Pod.Name, PodUID: a.Pod.UID, Created: a.Created, Sandbox: a.Sandbox, Netns: a.Netns}
		if len(a.IPs) > 0 {
			at.Pool = a.IPs[0].Pool
		}
		for _, ip := range a.IPs {
			s := ip.Address
			if i := strings.IndexByte(s, '/'); i >= 0 {
				s = s[:i]
			}
			if addr, err := netip.ParseAddr(s); err == nil {
				at.Addrs = append(at.Addrs, addr)
				at.AddrPools = append(at.AddrPools, ip.Pool)
			}
		}
		out = append(out, at)
	}
	return out
}

// AskAgent lists a node's attachments through its agent's socket.
func AskAgent(ctx context.Context, node, socket string) ([]Attachment, error) {
	resp, err := cniproto.Call(ctx, socket, cniproto.Request{Version: cniproto.Version, Op: cniproto.OpList})
	if err != nil {
		return nil, err
	}
	if err := resp.AsError(); err != nil {
		return nil, fmt.Errorf("agent of %s: %w", node, err)
	}
	return FromAgent(node, resp.Attachments), nil
}
