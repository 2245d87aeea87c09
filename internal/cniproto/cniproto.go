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
	"time"
)

// Version is the protocol version; the agent refuses requests of another version.
const Version = 1

// DefaultSocket is where the agent listens unless told otherwise.
const DefaultSocket = "/run/ipwarden/agent.sock"

// MaxMessage bounds a request or response (a GC's valid-attachments list dominates).
const MaxMessage = 16 << 20

// Op is a request's operation.
type Op string

// Operations: the CNI verbs, and LIST for `ipwarden agent list`.
const (
	OpAdd    Op = "ADD"
	OpDel    Op = "DEL"
	OpCheck  Op = "CHECK"
	OpGC     Op = "GC"
	OpStatus Op = "STATUS"
	OpList   Op = "LIST"
)

// CNI error codes the agent answers with (see the CNI specification).
const (
	CodeIncompatibleVersion uint = 1
	CodeUnknownContainer    uint = 3
	CodeInvalidConfig       uint = 7
	CodeTryAgainLater       uint = 11
	CodeNotAvailable        uint = 50
	CodeInternal            uint = 999
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
	Pod   Pod      `json:"pod,omitzero"`
	// ValidAttachments is GC's cni.dev/valid-attachments.
	ValidAttachments []AttachmentID `json:"validAttachments,omitempty"`
	// PrevAddresses are the addresses of CHECK's prevResult (CIDR notation).
	PrevAddresses []string `json:"prevAddresses,omitempty"`
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
	if err := json.NewDecoder(io.LimitReader(conn, MaxMessage)).Decode(&resp); err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("read the ipwarden agent's answer to %s from %s: %w", req.Op, socket, err)
	}
	return &resp, nil
}

// ReadRequest reads one request from conn.
func ReadRequest(conn io.Reader) (Request, error) {
	var req Request
	if err := json.NewDecoder(io.LimitReader(conn, MaxMessage)).Decode(&req); err != nil {
		return Request{}, fmt.Errorf("decode request: %w", err)
	}
	if req.Version != Version {
		return req, &Error{Code: CodeIncompatibleVersion,
			Msg: fmt.Sprintf("ipwarden-cni speaks agent protocol %d, the agent speaks %d: install the ipwarden-cni binary of the agent's release", req.Version, Version)}
	}
	return req, nil
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
