// Package cri reads the node's own evidence of which pod sandboxes exist and which pod-network
// addresses they hold, from the container runtime, through two read-only CRI calls
// (ListPodSandbox, PodSandboxStatus) on the runtime's socket. The agent uses it after a lost or
// damaged journal: the rebuild and the hold rest on it rather than on pod statuses, which may be
// stale (docs/design.md, "The node forgets").
//
// The socket is root-equivalent: anyone who can write to it can run containers on the node. The
// agent only reads; docs/operations.md says what mounting it costs and how to go without.
package cri

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// DefaultEndpoint is containerd's CRI socket. CRI-O's is unix:///var/run/crio/crio.sock.
const DefaultEndpoint = "unix:///run/containerd/containerd.sock"

// MaxSandboxes bounds one reading: a node runs at most a few hundred pods; more sandboxes than this
// reads as the runtime not answering sensibly.
const MaxSandboxes = 4096

// Reader reads the runtime's pod sandboxes. The zero value and a nil *Reader read nothing (no
// runtime configured): Read returns an error, and the caller's evidence is unknown.
type Reader struct {
	endpoint string
	timeout  time.Duration
	conn     *grpc.ClientConn
	client   runtimeapi.RuntimeServiceClient
}

// ErrNotConfigured: no runtime endpoint was given (--cri-socket "").
var ErrNotConfigured = errors.New("no container runtime socket configured (--cri-socket)")

// New returns a reader of the runtime at endpoint ("unix:///path"; a bare path is taken as a unix
// socket). An empty endpoint returns nil: nothing to ask. The connection is made lazily.
func New(endpoint string, timeout time.Duration) (*Reader, error) {
	if endpoint == "" {
		return nil, nil
	}
	if strings.HasPrefix(endpoint, "/") {
		endpoint = "unix://" + endpoint
	}
	if !strings.HasPrefix(endpoint, "unix://") {
		return nil, fmt.Errorf("the container runtime endpoint %q is not a unix socket (unix:///path)", endpoint)
	}
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("container runtime endpoint %s: %w", endpoint, err)
	}
	return &Reader{endpoint: endpoint, timeout: timeout, conn: conn, client: runtimeapi.NewRuntimeServiceClient(conn)}, nil
}

// Endpoint is the socket the reader asks.
func (r *Reader) Endpoint() string {
	if r == nil {
		return ""
	}
	return r.endpoint
}

// Close closes the connection.
func (r *Reader) Close() error {
	if r == nil || r.conn == nil {
		return nil
	}
	return r.conn.Close()
}

// Read lists every pod sandbox the runtime has, ready or not, with the default network's
// addresses it recorded for each. Any failure returns an error and no evidence: a partial reading
// could show a pod's sandbox missing, which the hold would take for a pod that is not running.
func (r *Reader) Read(ctx context.Context) (ipam.NodeSandboxes, error) {
	if r == nil {
		return ipam.NodeSandboxes{}, ErrNotConfigured
	}
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	list, err := r.client.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return ipam.NodeSandboxes{}, fmt.Errorf("list pod sandboxes on %s: %w", r.endpoint, err)
	}
	if len(list.Items) > MaxSandboxes {
		return ipam.NodeSandboxes{}, fmt.Errorf("the runtime on %s lists %d pod sandboxes, more than %d", r.endpoint, len(list.Items), MaxSandboxes)
	}
	out := ipam.NodeSandboxes{Known: true}
	for _, sb := range list.Items {
		st, err := r.client.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sb.Id})
		if err != nil {
			return ipam.NodeSandboxes{}, fmt.Errorf("status of pod sandbox %s on %s: %w", sb.Id, r.endpoint, err)
		}
		out.Sandboxes = append(out.Sandboxes, Sandbox(sb, st.GetStatus()))
	}
	return out, nil
}

// Sandbox converts what the runtime says of one sandbox (status may be nil).
func Sandbox(sb *runtimeapi.PodSandbox, st *runtimeapi.PodSandboxStatus) ipam.RuntimeSandbox {
	out := ipam.RuntimeSandbox{ID: sb.GetId(), Ready: sb.GetState() == runtimeapi.PodSandboxState_SANDBOX_READY}
	if m := sb.GetMetadata(); m != nil {
		out.Pod = ipam.PodRef{Namespace: m.GetNamespace(), Name: m.GetName(), UID: m.GetUid()}
	}
	if st != nil {
		if st.GetState() != runtimeapi.PodSandboxState_SANDBOX_READY {
			out.Ready = false
		}
		if n := st.GetNetwork(); n != nil {
			ips := []string{n.GetIp()}
			for _, a := range n.GetAdditionalIps() {
				ips = append(ips, a.GetIp())
			}
			for _, s := range ips {
				if a, err := netip.ParseAddr(s); err == nil {
					out.IPs = append(out.IPs, a.Unmap())
				}
			}
		}
	}
	return out
}
