package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// Time limits of one call to the agent. They sit below the runtimes' own limits, so that a
// runtime sees a CNI error (code 11, try again later) from the plugin and not a killed plugin:
//   - containerd runs ADD (setupPodNetwork in internal/cri/server/sandbox_run.go) under the
//     RunPodSandbox request's context, whose deadline is the kubelet's --runtime-request-timeout
//     (default 2m); a DEL on a failed sandbox start gets util.DeferContext, 1m
//     (deferCleanupTimeout in internal/cri/util/util.go);
//   - CRI-O gives ADD 5m plus the request's deadline and DEL 1m (server/sandbox_network.go:
//     startTimeout, stopCtx).
//
// So ADD gets 90s (the agent's --address-wait, default 10s, fits well inside) and the other verbs
// 30s. When the plugin gives up, it closes its connection and the agent rolls the ADD back.
const (
	addTimeout   = 90 * time.Second
	otherTimeout = 30 * time.Second
)

// config is the part of the network configuration the plugin reads.
type config struct {
	types.PluginConf
	Pools  []string
	Socket string
	// Network is the IPPool spec.network the attachment draws from ("" for the pod network).
	Network string
	// AllowNonKubernetes accepts ADDs whose CNI_ARGS carry no pod identity (containers that are
	// not Kubernetes pods); their attachments are freed only by DEL and CNI GC.
	AllowNonKubernetes bool
	// HasValidAttachments: the GC request carries a valid-attachments list (possibly empty).
	HasValidAttachments bool
}

// badConfig is a CNI "invalid network configuration" error naming the field.
func badConfig(field, format string, args ...any) *types.Error {
	return types.NewError(types.ErrInvalidNetworkConfig,
		fmt.Sprintf("ipwarden-cni: network configuration field %q: %s", field, fmt.Sprintf(format, args...)),
		"fix the CNI network configuration (see the ipwarden README, \"CNI configuration\")")
}

// parseConfig reads the network configuration: pools and socket from the "ipam" section, else
// from the top level.
func parseConfig(stdin []byte) (*config, error) {
	c := &config{}
	if err := json.Unmarshal(stdin, &c.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "ipwarden-cni: cannot decode the network configuration: "+err.Error(), "")
	}
	var raw struct {
		Pools       json.RawMessage            `json:"pools"`
		Socket      json.RawMessage            `json:"socket"`
		IPAM        map[string]json.RawMessage `json:"ipam"`
		Valid       json.RawMessage            `json:"cni.dev/valid-attachments"`
		ValidLegacy json.RawMessage            `json:"cni.dev/attachments"` // libcni before v1.2.3 sent this key
		AllowNonK8s json.RawMessage            `json:"allowNonKubernetes"`
		Network     json.RawMessage            `json:"network"`
	}
	if err := json.Unmarshal(stdin, &raw); err != nil {
		return nil, badConfig("ipam", "must be an object: %v", err)
	}
	pools, poolsField := raw.Pools, "pools"
	socket, socketField := raw.Socket, "socket"
	if p, ok := raw.IPAM["pools"]; ok {
		pools, poolsField = p, "ipam.pools"
	}
	if s, ok := raw.IPAM["socket"]; ok {
		socket, socketField = s, "ipam.socket"
	}
	if len(pools) > 0 && string(pools) != "null" {
		if err := json.Unmarshal(pools, &c.Pools); err != nil {
			return nil, badConfig(poolsField, `must be a list of IPPool names such as ["pods-v4", "pods-v6"], not %s`, pools)
		}
		seen := map[string]bool{}
		for _, p := range c.Pools {
			if p == "" {
				return nil, badConfig(poolsField, "holds an empty pool name")
			}
			if seen[p] {
				return nil, badConfig(poolsField, "names pool %q twice", p)
			}
			seen[p] = true
		}
	}
	network, networkField := raw.Network, "network"
	if n, ok := raw.IPAM["network"]; ok {
		network, networkField = n, "ipam.network"
	}
	if len(network) > 0 && string(network) != "null" {
		if err := json.Unmarshal(network, &c.Network); err != nil || len(c.Network) > 63 {
			return nil, badConfig(networkField, `must be the name of an IPPool spec.network such as "storage", not %s`, network)
		}
	}
	allow, allowField := raw.AllowNonK8s, "allowNonKubernetes"
	if a, ok := raw.IPAM["allowNonKubernetes"]; ok {
		allow, allowField = a, "ipam.allowNonKubernetes"
	}
	if len(allow) > 0 && string(allow) != "null" {
		if err := json.Unmarshal(allow, &c.AllowNonKubernetes); err != nil {
			return nil, badConfig(allowField, "must be true or false, not %s", allow)
		}
	}
	present := func(m json.RawMessage) bool { return len(m) > 0 && string(m) != "null" }
	c.HasValidAttachments = present(raw.Valid) || present(raw.ValidLegacy)
	if len(c.ValidAttachments) == 0 && present(raw.ValidLegacy) && !present(raw.Valid) {
		if err := json.Unmarshal(raw.ValidLegacy, &c.ValidAttachments); err != nil {
			return nil, badConfig("cni.dev/attachments", "must be a list of {containerID, ifname}: %v", err)
		}
	}
	c.Socket = cniproto.DefaultSocket
	if len(socket) > 0 && string(socket) != "null" {
		if err := json.Unmarshal(socket, &c.Socket); err != nil {
			return nil, badConfig(socketField, `must be the path of the agent's socket such as "%s", not %s`, cniproto.DefaultSocket, socket)
		}
		if !filepath.IsAbs(c.Socket) {
			return nil, badConfig(socketField, "%q is not an absolute path", c.Socket)
		}
	}
	return c, nil
}

// podFromArgs reads K8S_POD_NAMESPACE, K8S_POD_NAME and K8S_POD_UID from CNI_ARGS.
func podFromArgs(args string) cniproto.Pod {
	var p cniproto.Pod
	for _, kv := range strings.Split(args, ";") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		switch k {
		case "K8S_POD_NAMESPACE":
			p.Namespace = v
		case "K8S_POD_NAME":
			p.Name = v
		case "K8S_POD_UID":
			p.UID = v
		}
	}
	return p
}

// call sends req to the agent and turns every failure into a CNI error. unreachableCode is the
// code for an agent that cannot be reached (11 for the verbs, 50 for STATUS).
func call(socket string, req cniproto.Request, timeout time.Duration, unreachableCode uint) (*cniproto.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	resp, err := cniproto.Call(ctx, socket, req)
	if err != nil {
		var u *cniproto.UnreachableError
		if errors.As(err, &u) {
			return nil, types.NewError(unreachableCode,
				fmt.Sprintf("ipwarden-cni: the ipwarden agent is not reachable at %s", socket),
				fmt.Sprintf("%v; check that the ipwarden agent runs on this node and listens on %s (CNI config key \"socket\")", u.Err, socket))
		}
		var silent *cniproto.SilentError
		if errors.As(err, &silent) {
			return nil, types.NewError(types.ErrTryAgainLater, "ipwarden-cni: "+silent.Error(),
				"an ADD the agent had not answered is rolled back when it resumes; the runtime will retry")
		}
		// The connection's deadline comes from ctx, so a read can fail with an i/o timeout a
		// moment before ctx reports its own: both mean the agent did not answer in time.
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) || ctx.Err() != nil {
			return nil, types.NewError(types.ErrTryAgainLater,
				fmt.Sprintf("ipwarden-cni: the ipwarden agent at %s did not answer %s within %s", socket, req.Op, timeout),
				"the agent may be stopped or overloaded; an ADD it had not answered is rolled back; the runtime will retry")
		}
		return nil, types.NewError(types.ErrTryAgainLater, "ipwarden-cni: "+err.Error(), "the agent may be restarting; the runtime will retry")
	}
	if resp.Error != nil {
		return nil, types.NewError(resp.Error.Code, resp.Error.Msg, resp.Error.Details)
	}
	return resp, nil
}

func request(op cniproto.Op, args *skel.CmdArgs, c *config) cniproto.Request {
	return cniproto.Request{
		Op:          op,
		ContainerID: args.ContainerID,
		IfName:      args.IfName,
		Netns:       args.Netns,
		Network:     c.Name,
		Pools:       c.Pools,
		PoolNetwork: c.Network,
		Pod:         podFromArgs(args.Args),
		// The agent refuses an ADD without pod identity unless the configuration allows it.
		NonKubernetes: c.AllowNonKubernetes,
	}
}

func cmdAdd(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	resp, err := call(c.Socket, request(cniproto.OpAdd, args, c), addTimeout, types.ErrTryAgainLater)
	if err != nil {
		return err
	}
	result, err := toResult(resp)
	if err != nil {
		return err
	}
	return types.PrintResult(result, c.CNIVersion)
}

// toResult builds the CNI result of an ADD answer.
func toResult(resp *cniproto.Response) (*current.Result, error) {
	result := &current.Result{CNIVersion: current.ImplementedSpecVersion}
	for _, ip := range resp.IPs {
		ipn, err := types.ParseCIDR(ip.Address)
		if err != nil {
			return nil, types.NewError(types.ErrInternal, fmt.Sprintf("ipwarden-cni: the agent answered a bad address %q", ip.Address), err.Error())
		}
		cfg := &current.IPConfig{Address: *ipn}
		if ip.Gateway != "" {
			cfg.Gateway = net.ParseIP(ip.Gateway)
		}
		result.IPs = append(result.IPs, cfg)
	}
	for _, r := range resp.Routes {
		_, dst, err := net.ParseCIDR(r.Dst)
		if err != nil {
			return nil, types.NewError(types.ErrInternal, fmt.Sprintf("ipwarden-cni: the agent answered a bad route %q", r.Dst), err.Error())
		}
		rt := &types.Route{Dst: *dst}
		if r.GW != "" {
			rt.GW = net.ParseIP(r.GW)
		}
		result.Routes = append(result.Routes, rt)
	}
	return result, nil
}

func cmdDel(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	_, err = call(c.Socket, request(cniproto.OpDel, args, c), otherTimeout, types.ErrTryAgainLater)
	return err
}

func cmdCheck(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	req := request(cniproto.OpCheck, args, c)
	if c.RawPrevResult != nil {
		if err := version.ParsePrevResult(&c.PluginConf); err != nil {
			return types.NewError(types.ErrDecodingFailure, "ipwarden-cni: cannot decode prevResult: "+err.Error(), "")
		}
		prev, err := current.NewResultFromResult(c.PrevResult)
		if err != nil {
			return types.NewError(types.ErrDecodingFailure, "ipwarden-cni: cannot convert prevResult: "+err.Error(), "")
		}
		for _, ip := range prev.IPs {
			req.PrevAddresses = append(req.PrevAddresses, ip.Address.String())
		}
	}
	_, err = call(c.Socket, req, otherTimeout, types.ErrTryAgainLater)
	return err
}

func cmdGC(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	req := cniproto.Request{Op: cniproto.OpGC, Network: c.Name, Pools: c.Pools, HasValidAttachments: c.HasValidAttachments}
	for _, a := range c.ValidAttachments {
		req.ValidAttachments = append(req.ValidAttachments, cniproto.AttachmentID{ContainerID: a.ContainerID, IfName: a.IfName})
	}
	_, err = call(c.Socket, req, otherTimeout, types.ErrTryAgainLater)
	return err
}

func cmdStatus(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	_, err = call(c.Socket, cniproto.Request{Op: cniproto.OpStatus, Network: c.Name, Pools: c.Pools}, otherTimeout, types.ErrPluginNotAvailable)
	return err
}
