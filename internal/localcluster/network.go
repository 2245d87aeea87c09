package localcluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"time"

	"github.com/containernetworking/cni/libcni"
	cnitypes "github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
)

// Pod identifies a pod to the CNI plugin.
type Pod struct {
	Namespace, Name, UID string
	ContainerID          string
}

// Network starts pods on one node through the real plugin binaries. With Bridge set (needs root)
// it is the bridge plugin delegating IPAM to ipwarden in a network namespace per pod; without, it
// calls the ipwarden IPAM plugin alone, as a main plugin would.
type Network struct {
	// Bridge is the Linux bridge name ("" for IPAM-only calls).
	Bridge string
	// NSPrefix names the pods' network namespaces (<prefix><container id>).
	NSPrefix string

	cni    *libcni.CNIConfig
	list   *libcni.NetworkConfigList
	ifName string // "" for eth0
}

// NewNetwork builds a network for the agent at socket. cacheDir holds libcni's result cache.
func NewNetwork(cniDir, cacheDir, name, socket, bridge, nsPrefix string, pools ...string) (*Network, error) {
	ipam := map[string]any{"type": "ipwarden", "socket": socket}
	if len(pools) > 0 {
		ipam["pools"] = pools
	}
	n := &Network{Bridge: bridge, NSPrefix: nsPrefix, cni: libcni.NewCNIConfigWithCacheDir([]string{cniDir}, cacheDir, nil)}
	var plugin map[string]any
	if bridge == "" {
		IPAMOnly()
	}
	if bridge != "" {
		plugin = map[string]any{"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": false, "ipam": ipam}
	} else {
		plugin = ipam
	}
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "plugins": []any{plugin}})
	list, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		return nil, err
	}
	n.list = list
	return n, nil
}

// NewSecondaryNetwork builds an IPAM-only network whose calls name interface ifName (Multus'
// "net1") and ask ipwarden for an address on network (an IPPool's spec.network), as a secondary
// network's main plugin delegating IPAM to ipwarden would. Its pods are the pod network's: the
// same container ids, namespaces and pod arguments.
func NewSecondaryNetwork(cniDir, cacheDir, name, socket, network, ifName string) (*Network, error) {
	IPAMOnly()
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name,
		"plugins": []any{map[string]any{"type": "ipwarden", "socket": socket, "network": network}}})
	list, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		return nil, err
	}
	return &Network{cni: libcni.NewCNIConfigWithCacheDir([]string{cniDir}, cacheDir, nil), list: list, ifName: ifName}, nil
}

// RandomName returns prefix followed by hex digits, for bridges and container ids.
func RandomName(prefix string, bytes int) string {
	b := make([]byte, bytes)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func (n *Network) rt(p Pod) *libcni.RuntimeConf {
	netns := "/proc/self/ns/net" // IPAM-only: the namespace is not touched
	if n.Bridge != "" {
		netns = NetnsPath(n.NSPrefix + p.ContainerID)
	}
	ifName := "eth0"
	if n.ifName != "" {
		ifName = n.ifName
	}
	return &libcni.RuntimeConf{
		ContainerID: p.ContainerID,
		NetNS:       netns,
		IfName:      ifName,
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", p.Namespace}, {"K8S_POD_NAME", p.Name},
			{"K8S_POD_UID", p.UID}},
	}
}

// Add creates the pod's namespace (bridge mode) and runs CNI ADD; it returns the addresses.
func (n *Network) Add(ctx context.Context, p Pod) ([]string, error) {
	if n.Bridge != "" {
		if err := AddNetns(n.NSPrefix + p.ContainerID); err != nil {
			return nil, err
		}
	}
	r, err := n.cni.AddNetworkList(ctx, n.list, n.rt(p))
	if err != nil {
		n.removeNS(p)
		return nil, err
	}
	res, err := current.NewResultFromResult(r)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, ip := range res.IPs {
		out = append(out, ip.Address.IP.String())
	}
	return out, nil
}

// Del runs CNI DEL and removes the pod's namespace.
func (n *Network) Del(ctx context.Context, p Pod) error {
	err := n.cni.DelNetworkList(ctx, n.list, n.rt(p))
	n.removeNS(p)
	return err
}

// ForgetNamespace removes a pod's namespace without a CNI DEL: a pod that vanished while its
// runtime never called DEL.
func (n *Network) ForgetNamespace(p Pod) { n.removeNS(p) }

func (n *Network) removeNS(p Pod) {
	if n.Bridge != "" {
		_ = DelNetns(n.NSPrefix + p.ContainerID)
	}
}

// Ping sends ICMP echo requests from inside the pod's namespace to ip until one is answered,
// for at most 2 s (bridge mode).
func (n *Network) Ping(p Pod, ip string) error {
	return Ping(NetnsPath(n.NSPrefix+p.ContainerID), ip, 2*time.Second)
}

// Close removes the bridge.
func (n *Network) Close() {
	if n.Bridge != "" {
		_ = DeleteLink(n.Bridge)
	}
}

// CNICode extracts the CNI error code from a plugin error (0 when it is not one).
func CNICode(err error) (uint, string) {
	var e *cnitypes.Error
	if errors.As(err, &e) {
		if e.Details == "" {
			return e.Code, e.Msg
		}
		return e.Code, e.Msg + ": " + e.Details
	}
	return 0, ""
}

// IPAMOnly lets plugins be called with this process's own network namespace as CNI_NETNS, which
// the CNI library otherwise refuses after an ADD: IPAM-only calls touch no namespace. It sets
// CNI_NETNS_OVERRIDE=1 in this process's environment, which libcni passes to the plugins.
func IPAMOnly() { _ = os.Setenv("CNI_NETNS_OVERRIDE", "1") }

// IsRoot says whether network namespaces can be used.
func IsRoot() bool { return os.Geteuid() == 0 }
