package agent

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/handback"
)

// Events on the node's NodeIPAllocation when the node is handed back to host-local, and when
// the handback is undone.
const (
	ReasonHandedBack     = "HandedBack"
	ReasonHandbackUndone = "HandbackUndone"
)

// handbackWait bounds how long HANDBACK waits, once the mark is set, for ADDs in flight to be
// journaled or refused.
const handbackWait = 10 * time.Second

// handbackAttachments converts the state's attachments for the handback: those of network (and
// those recorded without a network: rebuilt from the pods' status, or journaled before the
// network was recorded), and, separately, those of other networks.
func handbackAttachments(atts []ipam.Attachment, network string) (mine []handback.Attachment, others []string) {
	for _, a := range atts {
		if a.Network != "" && a.Network != network {
			others = append(others, fmt.Sprintf("%s (network %s)", orKey(a), a.Network))
			continue
		}
		ha := handback.Attachment{ContainerID: a.Key.ContainerID, IfName: a.Key.IfName, Pod: a.Pod.String(), Rebuilt: a.Key.IsRebuilt()}
		for _, ad := range a.Addresses {
			ha.Addresses = append(ha.Addresses, ad.Addr)
		}
		mine = append(mine, ha)
	}
	return mine, others
}

func orKey(a ipam.Attachment) string {
	if p := a.Pod.String(); p != "" {
		return "pod " + p
	}
	return "attachment " + a.Key.String()
}

// checkHandback is handback.Check with the node's own refusals. Attachments on other networks:
// the mark refuses every ADD of the node, so the node goes back as a whole. The unattributed
// hold (holdUntil non-zero: the journal was rebuilt from the pods' status and held addresses have
// no known owner yet): a pod using one of them has no attachment, so it would get no reservation
// file and host-local could hand its address to a new pod. Addresses an older agent recorded as
// reserved ahead (lost: a sandbox may use one, unknown to the journal) refuse it for the same
// reason, for as long as their records exist.
func checkHandback(atts []ipam.Attachment, network string, target handback.Target, holdUntil time.Time, lost int) ([]handback.Attachment, error) {
	if lost > 0 {
		return nil, &handback.RefusedError{Problems: []string{fmt.Sprintf(
			"the journal holds %d addresses an older agent reserved ahead and may have handed out before a crash, to sandboxes it does not name: "+
				"they would get no reservation file and host-local could hand them to new pods; see docs/operations.md to reclaim them first", lost)}}
	}
	if !holdUntil.IsZero() {
		return nil, &handback.RefusedError{Problems: []string{fmt.Sprintf(
			"the agent's journal was rebuilt from the pods' status and some held addresses have no known owner yet "+
				"(held out of use until every pod on the node has reported its addresses, at the latest %s): a pod using one "+
				"would get no reservation file; try again once the hold has ended (ipwarden_agent_unattributed_hold_active 0)",
			holdUntil.UTC().Format(time.RFC3339))}}
	}
	mine, others := handbackAttachments(atts, network)
	if len(others) > 0 {
		return nil, &handback.RefusedError{Problems: []string{fmt.Sprintf(
			"the node has attachments on other networks than %s, which host-local's configuration does not cover: %s; "+
				"the handback refuses every ADD of the node, so delete those pods first", network, strings.Join(others, ", "))}}
	}
	return mine, handback.Check(mine, target)
}

// handback answers HANDBACK (cniproto.HandbackRequest): without Mark it reports the network's
// attachments if the handback could be done (handback.Check), changing nothing; with Mark it
// checks, journals the handback mark (from then on every ADD is refused), waits for ADDs in
// flight, checks again with the attachments as they are now (clearing the mark if that fails)
// and reports them: `ipwarden agent handback` writes host-local's files from that answer. With
// Undo it clears the mark.
func (s *Service) handback(ctx context.Context, req cniproto.Request) *cniproto.Response {
	h := req.Handback
	if h == nil {
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: HANDBACK without its request", "")
	}
	if h.Undo {
		return s.undoHandback()
	}
	if h.Network == "" {
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: the handback names no network", "give the CNI network name of the node's configuration (--network)")
	}
	target, err := handback.ParseTarget([]byte(h.To))
	if err != nil {
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: "+err.Error(), "")
	}
	// A DEL is answered before its journal write lands (del): wait for those answered so far,
	// as LIST does, so the attachments read are the ones that still exist.
	if err := s.WaitReleases(ctx); err != nil {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: HANDBACK waited for DELs being journaled: "+err.Error(), "")
	}
	// One handback (or undo) at a time: two must not interleave.
	if !s.handingBack.CompareAndSwap(false, true) {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: another handback or undo is running on this node", "try again once it has finished")
	}
	defer s.handingBack.Store(false)
	var cur *ipam.HandbackMark
	s.read(func(m *Machine) {
		cur = m.st.HandedBack()
		_, holdUntil := m.st.Hold()
		_, err = checkHandback(m.st.Attachments(), h.Network, target, holdUntil, m.st.LostAhead())
	})
	if cur != nil && cur.Network != h.Network {
		return errResp(cniproto.CodeInvalidConfig, fmt.Sprintf("ipwarden: the node was handed back for network %s at %s, not %s",
			cur.Network, cur.At.UTC().Format(time.RFC3339), h.Network), "undo it first (ipwarden agent handback --undo)")
	}
	if err != nil {
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: "+err.Error(), "")
	}
	if !h.Mark {
		return s.handbackStatus(h.Network, false)
	}
	set := cur == nil
	if set {
		mark := ipam.HandbackMark{At: s.now().UTC(), To: "host-local", Network: h.Network, Dir: h.Dir}
		if err := s.fact(func(m *Machine, now time.Time) uint64 { return m.SetHandback(&mark, now) }).Err; err != nil {
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot record the handback in the journal: "+cniproto.Truncate(err.Error(), 300),
				"nothing was changed; check the agent's --state-dir disk")
		}
	}
	// ADDs planned before the mark finish (journaled) or fail; later ones are refused.
	wctx, cancel := context.WithTimeout(ctx, handbackWait)
	defer cancel()
	for {
		if err := s.WaitReleases(wctx); err != nil {
			if set {
				s.clearMark()
			}
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: HANDBACK waited for DELs being journaled: "+err.Error(), "the handback is not marked; try again")
		}
		var (
			n         int
			changed   <-chan struct{}
			atts      []ipam.Attachment
			holdUntil time.Time
			lost      int
		)
		s.read(func(m *Machine) {
			n, changed = m.st.NumPending(), s.changedC
			_, holdUntil = m.st.Hold()
			lost = m.st.LostAhead()
			if n == 0 {
				atts = m.st.Attachments()
			}
		})
		if n == 0 {
			if _, err := checkHandback(atts, h.Network, target, holdUntil, lost); err != nil {
				if set {
					s.clearMark()
				}
				return errResp(cniproto.CodeInvalidConfig, "ipwarden: "+err.Error(), "an ADD made before the mark changed the node's attachments")
			}
			break
		}
		select {
		case <-changed:
		case <-wctx.Done():
			if set {
				s.clearMark()
			}
			return errResp(cniproto.CodeTryAgainLater, fmt.Sprintf("ipwarden: %d ADDs were still being recorded after %s; the handback is not marked", n, handbackWait), "try again")
		}
	}
	resp := s.handbackStatus(h.Network, true)
	if set {
		m := resp.Handback
		s.metrics.HandedBack.Set(1)
		s.log.Info("node handed back: every ADD is refused until the handback is undone", "to", m.To, "network", m.Network, "dir", m.Dir,
			"at", m.At.Format(time.RFC3339), "attachments", len(m.Attachments))
		s.gcr.event(nil, corev1.EventTypeNormal, ReasonHandedBack, fmt.Sprintf(
			"node handed back to %s for network %s (%d attachments, reservation files in %s): ipwarden refuses every ADD on the node; undo with `ipwarden agent handback --undo`",
			m.To, m.Network, len(m.Attachments), m.Dir))
		s.kick() // the pool monitor shows the Node condition ipwarden.io/HandedBack
	}
	return resp
}

// clearMark clears the handback mark, logging a failure (the operator can undo it).
func (s *Service) clearMark() {
	if err := s.fact(func(m *Machine, now time.Time) uint64 { return m.SetHandback(nil, now) }).Err; err != nil {
		s.log.Error(err, "cannot clear the handback mark after a refused handback; ADD stays refused until `ipwarden agent handback --undo`")
	}
}

// undoHandback clears the mark: ADD is served again. It answers the mark it cleared, or an
// empty status when there was none. The reservation files written for the
// handback stay: they name live attachments (host-local frees each at its pod's DEL if the
// node goes back later), and host-local may own some by now.
func (s *Service) undoHandback() *cniproto.Response {
	if !s.handingBack.CompareAndSwap(false, true) {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: another handback or undo is running on this node", "try again once it has finished")
	}
	defer s.handingBack.Store(false)
	var cur *ipam.HandbackMark
	s.read(func(m *Machine) { cur = m.st.HandedBack() })
	if cur == nil {
		return &cniproto.Response{Handback: &cniproto.HandbackStatus{}}
	}
	if err := s.fact(func(m *Machine, now time.Time) uint64 { return m.SetHandback(nil, now) }).Err; err != nil {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot record the undo in the journal: "+cniproto.Truncate(err.Error(), 300), "ADD stays refused; try again")
	}
	s.metrics.HandedBack.Set(0)
	s.log.Info("handback undone: ADD is served again", "to", cur.To, "network", cur.Network, "handedBackAt", cur.At.UTC().Format(time.RFC3339))
	s.gcr.event(nil, corev1.EventTypeNormal, ReasonHandbackUndone, fmt.Sprintf(
		"handback to %s (network %s, since %s) undone: ipwarden serves ADD on the node again", cur.To, cur.Network, cur.At.UTC().Format(time.RFC3339)))
	s.kick()
	// The answer names the mark it cleared (Marked false).
	return &cniproto.Response{Handback: &cniproto.HandbackStatus{At: cur.At, To: cur.To, Network: cur.Network, Dir: cur.Dir}}
}

// handbackStatus reports the mark and, with the network, its attachments.
func (s *Service) handbackStatus(network string, withMark bool) *cniproto.Response {
	var mark *ipam.HandbackMark
	var atts []ipam.Attachment
	s.read(func(m *Machine) { mark, atts = m.st.HandedBack(), m.st.Attachments() })
	st := &cniproto.HandbackStatus{}
	if m := mark; m != nil && withMark {
		st = &cniproto.HandbackStatus{Marked: true, At: m.At, To: m.To, Network: m.Network, Dir: m.Dir}
	}
	if network != "" {
		mine, _ := handbackAttachments(atts, network)
		for _, a := range mine {
			ha := cniproto.HandbackAttachment{ContainerID: a.ContainerID, IfName: a.IfName, Rebuilt: a.Rebuilt}
			if ns, name, ok := strings.Cut(a.Pod, "/"); ok {
				ha.Pod = cniproto.Pod{Namespace: ns, Name: name}
			}
			for _, ip := range a.Addresses {
				ha.Addresses = append(ha.Addresses, ip.String())
			}
			st.Attachments = append(st.Attachments, ha)
		}
	}
	return &cniproto.Response{Handback: st}
}

// releaseHandedBack removes host-local's reservation files that name att, freed while the node is
// handed back (handback.Release): a pod deleted before the node's CNI configuration names
// host-local sends its DEL here, not to host-local, so without this its file would hold its
// address in host-local for good. After the switch host-local's own DEL removed the file first,
// or host-local handed the address to another container, whose file stays. The agent sees the
// directory only where its container mounts it (deploy/ mounts /var/lib/cni/networks).
func (s *Service) releaseHandedBack(att ipam.Attachment) {
	var m *ipam.HandbackMark
	s.read(func(mc *Machine) { m = mc.st.HandedBack() })
	if m == nil || m.Dir == "" {
		return
	}
	mine, _ := handbackAttachments([]ipam.Attachment{att}, m.Network)
	removed, err := handback.Release(m.Dir, mine)
	if err != nil {
		s.log.Error(err, "cannot remove host-local's reservation of an attachment freed while the node is handed back; remove its file by hand",
			"dir", m.Dir, "attachment", cniproto.Truncate(att.Key.String(), logIDBytes), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
		return
	}
	for _, ip := range removed {
		s.log.Info("removed host-local's reservation of an attachment freed while the node is handed back",
			"dir", m.Dir, "address", ip.String(), "attachment", cniproto.Truncate(att.Key.String(), logIDBytes), "pod", att.Pod.String())
	}
}
