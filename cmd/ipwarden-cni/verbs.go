package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
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
// 30s. When the plugin gives up, it closes its connection and the agent rolls the ADD back. A
// verb delegated to the previous IPAM (DEL, CHECK, GC; see "previous") runs after the agent's
// answer and gets previousTimeout more, so the two together stay below the runtimes' 1m for DEL.
const (
	addTimeout      = 90 * time.Second
	otherTimeout    = 30 * time.Second
	previousTimeout = 20 * time.Second
)

// maxPrevious bounds the "previous" object: an IPAM configuration is a few hundred bytes. ADD
// forwards it to the agent, which reads what that IPAM reserved.
const maxPrevious = cniproto.MaxPrevious

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
	// Previous is the "previous" object: the IPAM configuration of the plugin that allocated
	// the addresses of pods started before the node moved to ipwarden (nil when not set).
	// DEL, CHECK (of an attachment the agent does not know) and GC are delegated to it.
	Previous json.RawMessage
	// PreviousType is Previous's "type": the plugin's name on CNI_PATH.
	PreviousType string
	// ClaimReference is args.cni "ipam-claim-reference": the IPAMClaim the attachment
	// references (Multus copies it from the network-selection element's cni-args).
	ClaimReference string
}

// badConfig is a CNI "invalid network configuration" error naming the field.
func badConfig(field, format string, args ...any) *types.Error {
	return types.NewError(types.ErrInvalidNetworkConfig,
		fmt.Sprintf("ipwarden-cni: network configuration field %q: %s", field, fmt.Sprintf(format, args...)),
		"fix the CNI network configuration (see ipwarden's docs/configuration.md, \"The CNI plugin\")")
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
		Previous    json.RawMessage            `json:"previous"`
		Args        json.RawMessage            `json:"args"`
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
	previous, previousField := raw.Previous, "previous"
	if p, ok := raw.IPAM["previous"]; ok {
		previous, previousField = p, "ipam.previous"
	}
	if len(previous) > 0 && string(previous) != "null" {
		if err := c.parsePrevious(previous, previousField); err != nil {
			return nil, err
		}
	}
	var args struct {
		CNI map[string]json.RawMessage `json:"cni"`
	}
	_ = json.Unmarshal(raw.Args, &args) // "args" belongs to the runtime's conventions: only our key is checked
	if ref, ok := args.CNI["ipam-claim-reference"]; ok && string(ref) != "null" {
		if err := json.Unmarshal(ref, &c.ClaimReference); err != nil || len(c.ClaimReference) > 253 {
			return nil, badConfig("args.cni.ipam-claim-reference", "must be the name of an IPAMClaim in the pod's namespace, not %s", cniproto.Truncate(string(ref), 100))
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

// parsePrevious checks the "previous" object: a JSON object of at most maxPrevious bytes whose
// "type" names a plugin other than ipwarden itself.
func (c *config) parsePrevious(previous json.RawMessage, field string) error {
	if len(previous) > maxPrevious {
		return badConfig(field, "is %d bytes, at most %d: it is the previous IPAM's \"ipam\" object", len(previous), maxPrevious)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(previous, &obj); err != nil || obj == nil {
		return badConfig(field, `must be the previous IPAM's "ipam" object such as {"type": "host-local", ...}, not %s`, cniproto.Truncate(string(previous), 100))
	}
	var typ string
	if t, ok := obj["type"]; !ok || json.Unmarshal(t, &typ) != nil || typ == "" {
		return badConfig(field+".type", `must name the previous IPAM plugin such as "host-local"`)
	}
	if typ == "ipwarden" || typ == "ipwarden-cni" {
		return badConfig(field+".type", "names ipwarden itself: it must name the IPAM plugin the node used before ipwarden")
	}
	if strings.ContainsAny(typ, `/\`) || typ == "." || typ == ".." {
		return badConfig(field+".type", "%q is not the name of a plugin on CNI_PATH", typ)
	}
	c.Previous, c.PreviousType = previous, typ
	return nil
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
		// The IPAMClaim the configuration names, ahead of the pod's annotations.
		IPAMClaimReference: c.ClaimReference,
		// The agent refuses an ADD without pod identity unless the configuration allows it.
		NonKubernetes: c.AllowNonKubernetes,
	}
}

func cmdAdd(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	req := request(cniproto.OpAdd, args, c)
	// The agent reads what the previous IPAM reserved (a pod whose ADD went through it just
	// before the node switched uses an address no pod status shows yet) and keeps it out of use.
	req.Previous = c.Previous
	resp, err := call(c.Socket, req, addTimeout, types.ErrTryAgainLater)
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

// cmdDel frees the attachment in the agent, then, with "previous" set, has the previous IPAM free
// whatever it holds for the container: DEL is idempotent and host-local or Whereabouts forget a
// container they never saw without complaint, so it is delegated whether or not the agent knew
// the container. Both run even when one fails; the runtime retries a failed DEL.
func cmdDel(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	_, agentErr := call(c.Socket, request(cniproto.OpDel, args, c), otherTimeout, types.ErrTryAgainLater)
	if c.Previous == nil {
		return agentErr
	}
	return bothErr("DEL", c, agentErr, delegate("DEL", args, c))
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
	var te *types.Error
	if c.Previous == nil || !errors.As(err, &te) || te.Code != cniproto.CodeUnknownContainer {
		return err
	}
	// The agent answers code 3 only when it holds no attachment for the container and interface:
	// a pod started before the node moved to ipwarden, whose addresses the previous IPAM holds.
	perr := delegate("CHECK", args, c)
	if perr != nil && checkUnsupported(perr) {
		// Whereabouts (v0.9.4) answers every CHECK "CNI CHECK method is not implemented": it
		// cannot say, and neither can the agent, which never ADDed this container.
		fmt.Fprintf(os.Stderr, "ipwarden-cni: the previous IPAM %q does not implement CHECK (%s): nothing to check\n", c.PreviousType, perr.Msg)
		return nil
	}
	if perr != nil {
		return types.NewError(perr.Code, fmt.Sprintf("ipwarden-cni: CHECK: the ipwarden agent has no attachment for container %s interface %s, and %s",
			cniproto.Truncate(args.ContainerID, 64), args.IfName, perr.Msg), perr.Details)
	}
	return nil
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
	_, agentErr := call(c.Socket, req, otherTimeout, types.ErrTryAgainLater)
	if c.Previous == nil {
		return agentErr
	}
	if !c.HasValidAttachments {
		// Without the list every attachment would look stale to the previous IPAM too.
		fmt.Fprintf(os.Stderr, "ipwarden-cni: GC without cni.dev/valid-attachments: not delegated to the previous IPAM %q\n", c.PreviousType)
		return agentErr
	}
	perr := delegate("GC", args, c)
	if perr != nil && gcUnsupported(perr) {
		fmt.Fprintf(os.Stderr, "ipwarden-cni: the previous IPAM %q does not support GC (%s): skipped it\n", c.PreviousType, perr.Msg)
		perr = nil
	}
	return bothErr("GC", c, agentErr, perr)
}

// gcUnsupported tells a delegated GC's error that says the plugin has no GC: skel of CNI library
// v1.2 and later answers a version error (code 1, "plugin version does not allow GC") for a
// plugin whose supported versions stop before 1.1.0; an older skel knows no GC command at all
// (code 4, "unknown CNI_COMMAND: GC").
func gcUnsupported(e *types.Error) bool {
	return e.Code == types.ErrIncompatibleCNIVersion ||
		(e.Code == types.ErrInvalidEnvironmentVariables && strings.Contains(e.Msg, "unknown CNI_COMMAND"))
}

// checkUnsupported tells a delegated CHECK's error that says the plugin has no CHECK: a version
// error (a plugin of CNI before 0.4.0), or a plugin that answers it is not implemented
// (Whereabouts: code 999 "CNI CHECK method is not implemented").
func checkUnsupported(e *types.Error) bool {
	return e.Code == types.ErrIncompatibleCNIVersion || strings.Contains(strings.ToLower(e.Msg), "not implemented")
}

// previousConf is the previous IPAM's network configuration: the plugin's own, with its "ipam"
// object replaced by the "previous" object (so host-local, say, reads its ranges and dataDir).
// Everything else (name, cniVersion, prevResult, cni.dev/valid-attachments) passes unchanged.
func previousConf(stdin []byte, previous json.RawMessage) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(stdin, &m); err != nil {
		return nil, err
	}
	m["ipam"] = previous
	return json.Marshal(m)
}

// runDelegate runs the plugin typ, found on CNI_PATH, for verb with conf on stdin and the plugin's
// own CNI_* environment, as libcni's invoke.Delegate* do; the plugin's error is its CNI error.
// (invoke itself is not used: it links OpenTelemetry, whose start-up cost every exec of this
// plugin would pay, on every ADD too.)
func runDelegate(ctx context.Context, typ, verb string, conf []byte) error {
	var path string
	dirs := filepath.SplitList(os.Getenv("CNI_PATH"))
	for _, dir := range dirs {
		p := filepath.Join(dir, typ)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			path = p
			break
		}
	}
	if path == "" {
		return fmt.Errorf("failed to find plugin %q in path %v", typ, dirs)
	}
	cmd := exec.CommandContext(ctx, path)
	env := make([]string, 0, len(os.Environ())+1)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CNI_COMMAND=") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, "CNI_COMMAND="+verb)
	cmd.Stdin = bytes.NewReader(conf)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		var e types.Error
		if jerr := json.Unmarshal(out.Bytes(), &e); jerr == nil && (e.Code != 0 || e.Msg != "") {
			return &e
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("netplugin failed: %q: %w", strings.TrimSpace(out.String()), err)
	}
	return nil
}

// delegate runs verb of the previous IPAM, found on CNI_PATH, with the same CNI_* environment.
// Its error's message names the previous IPAM and its type.
func delegate(verb string, args *skel.CmdArgs, c *config) *types.Error {
	conf, err := previousConf(args.StdinData, c.Previous)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, fmt.Sprintf("ipwarden-cni: cannot build the network configuration of the previous IPAM %q: %v", c.PreviousType, err), "")
	}
	ctx, cancel := context.WithTimeout(context.Background(), previousTimeout)
	defer cancel()
	switch verb {
	case "DEL", "CHECK", "GC":
		err = runDelegate(ctx, c.PreviousType, verb, conf)
	default:
		err = fmt.Errorf("verb %s is not delegated", verb)
	}
	if err == nil {
		return nil
	}
	code, msg, details := uint(types.ErrInternal), err.Error(), ""
	var te *types.Error
	if errors.As(err, &te) {
		msg, details = te.Msg, te.Details
		if te.Code != 0 {
			code = te.Code
		}
	}
	if ctx.Err() != nil {
		msg = fmt.Sprintf("did not finish within %s: %s", previousTimeout, msg)
	}
	return types.NewError(code, fmt.Sprintf("%s by the previous IPAM %q failed: %s", verb, c.PreviousType, msg), details)
}

// bothErr combines the agent's error and the previous IPAM's of a verb run by both; each message
// says which failed. The agent's code wins (code 11 for an unreachable agent keeps its meaning).
func bothErr(verb string, c *config, agentErr error, perr *types.Error) error {
	if agentErr == nil && perr == nil {
		return nil
	}
	if agentErr == nil {
		return types.NewError(perr.Code, fmt.Sprintf("ipwarden-cni: the ipwarden agent's %s succeeded, but %s", verb, perr.Msg), perr.Details)
	}
	te := &types.Error{Code: types.ErrInternal, Msg: agentErr.Error()}
	errors.As(agentErr, &te)
	tail := fmt.Sprintf("%s by the previous IPAM %q succeeded", verb, c.PreviousType)
	if perr != nil {
		tail = "and " + perr.Msg
	}
	return types.NewError(te.Code, fmt.Sprintf("%s by the ipwarden agent failed: %s (%s)", verb, te.Msg, tail), te.Details)
}

func cmdStatus(args *skel.CmdArgs) error {
	c, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	_, err = call(c.Socket, cniproto.Request{Op: cniproto.OpStatus, Network: c.Name, Pools: c.Pools}, otherTimeout, types.ErrPluginNotAvailable)
	return err
}
