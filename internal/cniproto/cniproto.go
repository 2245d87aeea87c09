// Package cniproto is the protocol between ipwarden-cni and the node agent over the agent's unix
// socket: one JSON request per connection, the client half-closes, the agent answers with one
// JSON response and closes.
//
// The plugin links this package, so it imports nothing beyond the standard library: no
// Kubernetes client, no CNI library.
package cniproto

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// Version is the protocol version; the agent refuses requests of another version.
const Version = 1

// DefaultSocket is where the agent listens unless told otherwise.
const DefaultSocket = "/run/ipwarden/agent.sock"

// MaxRequest bounds a request the agent reads. A request is a few hundred bytes; a GC's
// valid-attachments list dominates (64 KiB holds about 500 attachments with 64-character
// container IDs, beyond what a node runs: kubelet's default maximum is 110 pods).
const MaxRequest = 64 << 10

// MaxResponse bounds a response the plugin or `ipwarden agent list` reads (LIST reports every
// attachment of the node).
const MaxResponse = 16 << 20

// Bounds of a request's fields, checked by Validate. A container ID is 64 hex characters for
// containerd and CRI-O; an interface name at most 15 bytes (IFNAMSIZ-1).
const (
	MaxContainerID = 256
	MaxIfName      = 15
	MaxName        = 253 // namespace, pod name, UID, network, pool name, netns path
	MaxPools       = 16
)

// Op is a request's operation.
type Op string

// Operations: the CNI verbs, LIST for `ipwarden agent list` and HANDBACK for `ipwarden agent
// handback`.
const (
	OpAdd    Op = "ADD"
	OpDel    Op = "DEL"
	OpCheck  Op = "CHECK"
	OpGC     Op = "GC"
	OpStatus Op = "STATUS"
	OpList   Op = "LIST"
	// OpHandback plans, marks or undoes handing the node back to host-local (HandbackRequest).
	OpHandback Op = "HANDBACK"
)

// CNI error codes the agent answers with (see the CNI specification). CodeUnknownContainer is
// the answer to a CHECK of an attachment the agent does not hold, and to nothing else:
// ipwarden-cni then asks the previous IPAM of its configuration ("previous"), which may hold the
// container's addresses from before the node moved to ipwarden.
const (
	CodeIncompatibleVersion uint = 1
	CodeUnknownContainer    uint = 3
	CodeInvalidEnv          uint = 4
	CodeIOFailure           uint = 5
	CodeDecodingFailure     uint = 6
	CodeInvalidConfig       uint = 7
	CodeTryAgainLater       uint = 11
	CodeNotAvailable        uint = 50
	// CodeHandedBack, in the CNI specification's plugin-specific range (100 and up), refuses an
	// ADD on a node handed back to host-local (`ipwarden agent handback`): retrying does not
	// help until the node's CNI configuration names host-local, or the handback is undone.
	CodeHandedBack uint = 100
	CodeInternal   uint = 999
)

// Pod names the pod of an attachment (CNI_ARGS K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_UID).
type Pod struct {
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	UID       string `json:"uid,omitempty"`
}

// AttachmentID is a (containerID, ifname) pair.
type AttachmentID struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
}

// Request is one call to the agent.
type Request struct {
	Version     int    `json:"version"`
	Op          Op     `json:"op"`
	ContainerID string `json:"containerID,omitempty"`
	IfName      string `json:"ifname,omitempty"`
	Netns       string `json:"netns,omitempty"`
	// Network is the CNI network name.
	Network string `json:"network,omitempty"`
	// Pools to draw from; empty means the agent's default.
	Pools []string `json:"pools,omitempty"`
	// PoolNetwork is the configuration's "network": the IPPool spec.network the attachment
	// draws from ("" for the pod network).
	PoolNetwork string `json:"poolNetwork,omitempty"`
	Pod         Pod    `json:"pod,omitzero"`
	// ValidAttachments is GC's cni.dev/valid-attachments.
	ValidAttachments []AttachmentID `json:"validAttachments,omitempty"`
	// HasValidAttachments says the runtime sent a valid-attachments list (possibly empty). A GC
	// without one carries no information and frees nothing.
	HasValidAttachments bool `json:"hasValidAttachments,omitempty"`
	// NonKubernetes is the plugin configuration's "allowNonKubernetes": an ADD without pod
	// identity (K8S_POD_NAMESPACE, K8S_POD_NAME) is accepted.
	NonKubernetes bool `json:"nonKubernetes,omitempty"`
	// Previous is ADD's "previous" object of the network configuration: the ipam object of the
	// IPAM the node ran before ipwarden. The agent reads what that IPAM reserved (package
	// previous) before the ADD picks, and keeps those addresses out of use. At most
	// MaxPrevious bytes.
	Previous json.RawMessage `json:"previous,omitempty"`
	// IPAMClaimReference is the configuration's args.cni "ipam-claim-reference" (Multus copies
	// it from a network-selection element's cni-args): the IPAMClaim the attachment references,
	// ahead of the pod's annotations (docs/design.md, "VM addresses").
	IPAMClaimReference string `json:"ipamClaimReference,omitempty"`
	// PrevAddresses are the addresses of CHECK's prevResult (CIDR notation).
	PrevAddresses []string `json:"prevAddresses,omitempty"`
	// Handback is HANDBACK's request.
	Handback *HandbackRequest `json:"handback,omitempty"`
}

// MaxPrevious bounds Request.Previous (previous.MaxConfig).
const MaxPrevious = 16 << 10

// MaxHandbackConfig bounds HandbackRequest.To (handback.MaxConfig).
const MaxHandbackConfig = 16 << 10

// HandbackRequest is `ipwarden agent handback`'s request to its node's agent.
type HandbackRequest struct {
	// To is the ipam object of the CNI configuration the node goes back to (host-local's).
	To string `json:"to,omitempty"`
	// Network is the CNI network name whose attachments are handed back.
	Network string `json:"network,omitempty"`
	// Dir is host-local's directory the reservation files go to, recorded in the mark.
	Dir string `json:"dir,omitempty"`
	// Mark: set the handback mark (ADD refused from then on) and answer the attachments as
	// they are once no ADD is in flight. Without it the agent only answers the attachments
	// (and whether the handback could be done), changing nothing.
	Mark bool `json:"mark,omitempty"`
	// Undo clears the mark.
	Undo bool `json:"undo,omitempty"`
}

// HandbackAttachment is one attachment HANDBACK answers.
type HandbackAttachment struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
	Pod         Pod    `json:"pod,omitzero"`
	// Addresses are bare addresses (no prefix length).
	Addresses []string `json:"addresses"`
	Rebuilt   bool     `json:"rebuilt,omitempty"`
}

// HandbackStatus is HANDBACK's answer, and LIST's report of the mark.
type HandbackStatus struct {
	// Marked: the node is handed back (since At, to To, for Network, files in Dir).
	Marked  bool      `json:"marked"`
	At      time.Time `json:"at,omitzero"`
	To      string    `json:"to,omitempty"`
	Network string    `json:"network,omitempty"`
	Dir     string    `json:"dir,omitempty"`
	// Attachments are the network's attachments (not for Undo or LIST).
	Attachments []HandbackAttachment `json:"attachments,omitempty"`
}

// IP is one address of an ADD result.
type IP struct {
	Pool string `json:"pool"`
	// Address in CIDR notation with the pool network's prefix length, e.g. 10.244.1.5/16.
	Address string `json:"address"`
	Gateway string `json:"gateway,omitempty"`
}

// Route is a route of an ADD result.
type Route struct {
	Dst string `json:"dst"`
	GW  string `json:"gw,omitempty"`
}

// Error is a CNI error.
type Error struct {
	Code    uint   `json:"code"`
	Msg     string `json:"msg"`
	Details string `json:"details,omitempty"`
}

func (e *Error) Error() string {
	if e.Details != "" {
		return e.Msg + "; " + e.Details
	}
	return e.Msg
}

// Attachment is one attachment as LIST reports it.
type Attachment struct {
	ContainerID string    `json:"containerID"`
	IfName      string    `json:"ifname"`
	Network     string    `json:"network,omitempty"`
	Pod         Pod       `json:"pod,omitzero"`
	IPs         []IP      `json:"ips"`
	Created     time.Time `json:"created"`
	// Rebuilt is set for attachments rebuilt from a pod's status.podIPs (container ID unknown).
	Rebuilt bool `json:"rebuilt,omitempty"`
	// Netns is the network namespace path recorded at ADD; Sandbox is what the agent sees of it
	// now: "gone", "exists", "unknown" (it cannot tell) or "unrecorded".
	Netns   string `json:"netns,omitempty"`
	Sandbox string `json:"sandbox,omitempty"`
	// Conflicts lists addresses of the attachment that the node no longer holds.
	Conflicts []string `json:"conflicts,omitempty"`
	// Claim is the IPAMClaim whose address the attachment holds (docs/design.md, "VM
	// addresses"); nil when none.
	Claim *Claim `json:"claim,omitempty"`
}

// Claim is an IPAMClaim an attachment references, as LIST reports it.
type Claim struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// MigrationTarget: the pod is a live migration's target (kubevirt.io/migrationJobUID).
	MigrationTarget bool `json:"migrationTarget,omitempty"`
}

// PoolStatus is one pool as LIST and STATUS report it.
type PoolStatus struct {
	Pool      string `json:"pool"`
	Served    bool   `json:"served"`
	Held      int    `json:"held"`
	InUse     int    `json:"inUse"`
	Free      int    `json:"free"`
	Cooling   int    `json:"cooling"`
	Releasing int    `json:"releasing"`
	Requested int    `json:"requested"`
	Conflicts int    `json:"conflicts"`
	Exhausted bool   `json:"exhausted,omitempty"`
	// Unattributed counts held addresses kept out of use after a rebuild (see Hold).
	Unattributed int `json:"unattributed,omitempty"`
	// Adopted counts addresses of attachments recorded from pods' status.podIPs rather than by
	// an ADD: pods that ran before the node moved to ipwarden, or whose journal was lost.
	Adopted int `json:"adopted,omitempty"`
	// PreviousReserved counts held addresses kept out of use because the previous IPAM reserves
	// them (a pod that started through it may use them before its status shows it).
	PreviousReserved int `json:"previousReserved,omitempty"`
}

// Hold is the unattributed hold after the agent rebuilt its journal from the pods: held
// addresses no attachment accounts for stay out of use until every pod on the node has reported
// its addresses or is gone, or until Until.
type Hold struct {
	Until time.Time `json:"until"`
	// Addresses counts the addresses held out of use.
	Addresses int `json:"addresses"`
	// WaitingFor names (namespace/name) pods that have not reported their addresses yet, at most 20.
	WaitingFor []string `json:"waitingFor,omitempty"`
	// MoreWaiting counts waiting pods beyond WaitingFor.
	MoreWaiting int `json:"moreWaiting,omitempty"`
}

// Response is the agent's answer.
type Response struct {
	Error       *Error       `json:"error,omitempty"`
	IPs         []IP         `json:"ips,omitempty"`
	Routes      []Route      `json:"routes,omitempty"`
	Freed       int          `json:"freed,omitempty"`
	Node        string       `json:"node,omitempty"`
	Attachments []Attachment `json:"attachments,omitempty"`
	Pools       []PoolStatus `json:"pools,omitempty"`
	// Hold is set while the unattributed hold is on (LIST).
	Hold *Hold `json:"hold,omitempty"`
	// Handback answers HANDBACK; LIST sets it while the node is handed back.
	Handback *HandbackStatus `json:"handback,omitempty"`
}

// UnreachableError says the agent's socket could not be reached.
type UnreachableError struct {
	Socket string
	Err    error
}

func (e *UnreachableError) Error() string {
	return fmt.Sprintf("cannot reach the ipwarden agent at %s: %v (is the ipwarden agent DaemonSet running on this node?)", e.Socket, e.Err)
}

func (e *UnreachableError) Unwrap() error { return e.Err }

// The agent shows it is alive while it handles a request: it writes one space as soon as it has
// read the request and one every Heartbeat until it writes the response (JSON allows whitespace
// before a value, so the response decodes as before). A client that hears nothing for Silence
// gives up with a *SilentError, long before a runtime's own timeout would kill the plugin: a
// paused or wedged agent gets a CNI error that names it, while an ADD that legitimately waits for
// addresses (--address-wait) keeps its connection. The plugin and the agent ship together (one
// image); a plugin newer than its agent would give up on an ADD the old agent made wait longer
// than Silence.
const (
	Heartbeat = 2 * time.Second
	Silence   = 10 * time.Second
)

// heartbeatEvery and silenceLimit are Heartbeat and Silence (shortened by tests).
var heartbeatEvery, silenceLimit = Heartbeat, Silence

// SilentError says the agent accepted a request but sent nothing for Silence.
type SilentError struct {
	Socket string
	Op     Op
	For    time.Duration
	// Acked: the agent had read the request (its first heartbeat came) before it fell silent.
	Acked bool
}

func (e *SilentError) Error() string {
	what := "accepted the connection but never read the " + string(e.Op) + " request"
	if e.Acked {
		what = "read the " + string(e.Op) + " request, then stopped answering"
	}
	return fmt.Sprintf("the ipwarden agent at %s %s: nothing for %s (is it paused, stopped or overloaded? see the ipwarden-agent pod on this node)", e.Socket, what, e.For)
}

// silenceReader reads from conn with a deadline Silence (or the context's, if sooner) past each
// read, and remembers whether anything arrived.
type silenceReader struct {
	conn    net.Conn
	limit   time.Duration
	ctxDL   time.Time
	got     bool
	timeout bool // the last read ended at the silence deadline, not the context's
}

func (r *silenceReader) Read(p []byte) (int, error) {
	dl := time.Now().Add(r.limit)
	silence := true
	if !r.ctxDL.IsZero() && r.ctxDL.Before(dl) {
		dl, silence = r.ctxDL, false
	}
	_ = r.conn.SetReadDeadline(dl)
	n, err := r.conn.Read(p)
	if n > 0 {
		r.got = true
	}
	r.timeout = silence && errors.Is(err, os.ErrDeadlineExceeded)
	return n, err
}

// WriteHeartbeats writes the first heartbeat to w at once and one every Heartbeat until the
// returned stop is called; stop waits for a write in progress, so the caller's response is never
// interleaved. Write errors end the heartbeats (the caller's own write reports them).
func WriteHeartbeats(w io.Writer) (stop func()) {
	var mu sync.Mutex
	done := make(chan struct{})
	beat := func() bool {
		mu.Lock()
		defer mu.Unlock()
		select {
		case <-done:
			return false
		default:
		}
		_, err := w.Write([]byte{' '})
		return err == nil
	}
	if !beat() {
		return func() {}
	}
	go func() {
		t := time.NewTicker(heartbeatEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if !beat() {
					return
				}
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			mu.Lock()
			close(done)
			mu.Unlock()
		})
	}
}

// Call sends req to the agent at socket and returns its response. A response carrying a CNI
// error is returned as the response, not as err; err is an *UnreachableError when the socket
// cannot be reached, or another error when the exchange breaks off.
func Call(ctx context.Context, socket string, req Request) (*Response, error) {
	req.Version = Version
	d := net.Dialer{Timeout: 3 * time.Second}
	conn, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, &UnreachableError{Socket: socket, Err: err}
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		return nil, fmt.Errorf("send %s to the ipwarden agent at %s: %w", req.Op, socket, err)
	}
	if uc, ok := conn.(*net.UnixConn); ok {
		_ = uc.CloseWrite()
	}
	var resp Response
	sr := &silenceReader{conn: conn, limit: silenceLimit}
	if dl, ok := ctx.Deadline(); ok {
		sr.ctxDL = dl
	}
	if err := json.NewDecoder(io.LimitReader(sr, MaxResponse)).Decode(&resp); err != nil {
		if sr.timeout && ctx.Err() == nil {
			return nil, &SilentError{Socket: socket, Op: req.Op, For: silenceLimit, Acked: sr.got}
		}
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("read the ipwarden agent's answer to %s from %s: %w", req.Op, socket, err)
	}
	return &resp, nil
}

// ReadRequest reads one request of at most MaxRequest bytes from conn and validates it. A bad
// request gives an *Error saying what was wrong.
func ReadRequest(conn io.Reader) (Request, error) {
	var req Request
	lr := &io.LimitedReader{R: conn, N: MaxRequest + 1}
	if err := json.NewDecoder(lr).Decode(&req); err != nil {
		if lr.N <= 0 {
			return Request{}, &Error{Code: CodeDecodingFailure,
				Msg: fmt.Sprintf("ipwarden agent: request larger than %d bytes", MaxRequest)}
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return Request{}, &Error{Code: CodeIOFailure, Msg: "ipwarden agent: no complete request received in time; closing the connection"}
		}
		return Request{}, &Error{Code: CodeDecodingFailure, Msg: "ipwarden agent: cannot decode the request: " + Truncate(err.Error(), 200)}
	}
	if req.Version != Version {
		return req, &Error{Code: CodeIncompatibleVersion,
			Msg: fmt.Sprintf("ipwarden-cni speaks agent protocol %d, the agent speaks %d: install the ipwarden-cni binary of the agent's release", req.Version, Version)}
	}
	if err := req.Validate(); err != nil {
		return req, err
	}
	return req, nil
}

// Validate checks the lengths of the request's fields; the error names the field, its length and
// the bound.
func (r *Request) Validate() *Error {
	tooLong := func(what string, n, most int) *Error {
		return &Error{Code: CodeInvalidEnv, Msg: fmt.Sprintf("ipwarden: %s too long (%d bytes, at most %d)", what, n, most)}
	}
	if n := len(r.ContainerID); n > MaxContainerID {
		return tooLong("container ID (CNI_CONTAINERID)", n, MaxContainerID)
	}
	if n := len(r.IfName); n > MaxIfName {
		return tooLong("interface name (CNI_IFNAME)", n, MaxIfName)
	}
	for _, f := range []struct {
		what string
		v    string
	}{{"network namespace path (CNI_NETNS)", r.Netns}, {"network name", r.Network}, {"K8S_POD_NAMESPACE", r.Pod.Namespace},
		{"K8S_POD_NAME", r.Pod.Name}, {"K8S_POD_UID", r.Pod.UID}, {"ipam-claim-reference", r.IPAMClaimReference}} {
		if n := len(f.v); n > MaxName {
			return tooLong(f.what, n, MaxName)
		}
	}
	if len(r.Pools) > MaxPools {
		return &Error{Code: CodeInvalidConfig, Msg: fmt.Sprintf("ipwarden: %d pools requested, at most %d", len(r.Pools), MaxPools)}
	}
	for _, p := range r.Pools {
		if n := len(p); n > MaxName {
			return &Error{Code: CodeInvalidConfig, Msg: fmt.Sprintf("ipwarden: pool name too long (%d bytes, at most %d)", n, MaxName)}
		}
	}
	if n := len(r.Previous); n > MaxPrevious {
		return &Error{Code: CodeInvalidConfig, Msg: fmt.Sprintf("ipwarden: the \"previous\" ipam configuration is too long (%d bytes, at most %d)", n, MaxPrevious)}
	}
	if h := r.Handback; h != nil {
		if n := len(h.To); n > MaxHandbackConfig {
			return &Error{Code: CodeInvalidConfig, Msg: fmt.Sprintf("ipwarden: handback ipam configuration too long (%d bytes, at most %d)", n, MaxHandbackConfig)}
		}
		if n := len(h.Dir); n > 4096 {
			return &Error{Code: CodeInvalidConfig, Msg: fmt.Sprintf("ipwarden: handback directory too long (%d bytes, at most 4096)", n)}
		}
		if n := len(h.Network); n > MaxName {
			return tooLong("handback network name", n, MaxName)
		}
	}
	for _, a := range r.ValidAttachments {
		if n := len(a.ContainerID); n > MaxContainerID {
			return tooLong("container ID in cni.dev/valid-attachments", n, MaxContainerID)
		}
		if n := len(a.IfName); n > MaxIfName {
			return tooLong("interface name in cni.dev/valid-attachments", n, MaxIfName)
		}
	}
	return nil
}

// Truncate shortens s to at most n bytes for logs and messages, marking the cut.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return fmt.Sprintf("%s...(%d bytes)", s[:n], len(s))
}

// WriteResponse writes resp to conn.
func WriteResponse(conn io.Writer, resp *Response) error {
	return json.NewEncoder(conn).Encode(resp)
}

// AsError returns the response's CNI error, or nil.
func (r *Response) AsError() error {
	if r == nil || r.Error == nil {
		return nil
	}
	return r.Error
}

// IsUnreachable reports whether err says the agent could not be reached.
func IsUnreachable(err error) bool {
	var u *UnreachableError
	return errors.As(err, &u)
}
