package localcluster

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// Network namespaces, an ICMP echo and a link's removal, done with system calls rather than the
// ip and ping programs: a fresh machine may have neither (iproute2 and iputils-ping are not in a
// minimal Debian), and `make demo` must work there. Each needs root.

// NetnsDir is where named network namespaces are mounted, as `ip netns add` mounts them.
const NetnsDir = "/var/run/netns"

// NetnsPath is the path of the named network namespace name.
func NetnsPath(name string) string { return filepath.Join(NetnsDir, name) }

// AddNetns creates a network namespace and bind-mounts it at NetnsPath(name), as `ip netns add`
// does. An existing name is an error.
func AddNetns(name string) error {
	if err := os.MkdirAll(NetnsDir, 0o755); err != nil {
		return fmt.Errorf("network namespace %s: %w", name, err)
	}
	path := NetnsPath(name)
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return fmt.Errorf("network namespace %s: %w", name, err)
	}
	f.Close()
	err = onThread(func() error {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("unshare a network namespace: %w", err)
		}
		if err := unix.Mount("/proc/thread-self/ns/net", path, "none", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind-mount the new network namespace on %s: %w", path, err)
		}
		return nil
	})
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("network namespace %s: %w", name, err)
	}
	return nil
}

// DelNetns unmounts and removes the named network namespace, as `ip netns del` does; the
// namespace itself goes when nothing else holds it. A name that does not exist is no error.
func DelNetns(name string) error {
	path := NetnsPath(name)
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount network namespace %s: %w", name, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove network namespace %s: %w", name, err)
	}
	return nil
}

// InNetns runs f on an OS thread in the network namespace at path. Sockets f opens stay in that
// namespace after it returns.
func InNetns(path string, f func() error) error {
	return onThread(func() error {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open network namespace %s: %w", path, err)
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("enter network namespace %s: %w", path, err)
		}
		return f()
	})
}

// onThread runs f on a locked OS thread and then puts that thread back in the network namespace
// it started in. A thread that cannot go back stays locked, so it ends with its goroutine and no
// other goroutine ever runs in the wrong namespace.
func onThread(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		home, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open this thread's network namespace: %w", err)
			return
		}
		defer unix.Close(home)
		err = f()
		if serr := unix.Setns(home, unix.CLONE_NEWNET); serr != nil {
			errc <- errors.Join(err, fmt.Errorf("return to this process's network namespace: %w", serr))
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// Ping sends ICMP echo requests from inside the network namespace at netns to ip, one a
// quarter second, until one is answered or timeout passes. It opens a raw socket (root).
func Ping(netns, ip string, timeout time.Duration) error {
	dst, err := netip.ParseAddr(ip)
	if err != nil {
		return fmt.Errorf("ping %q: %w", ip, err)
	}
	network, request, reply := "ip4:icmp", byte(8), byte(0)
	if dst.Unmap().Is6() {
		network, request, reply = "ip6:ipv6-icmp", 128, 129
	}
	dst = dst.Unmap()
	var conn *net.IPConn
	if err := InNetns(netns, func() error {
		var err error
		conn, err = net.ListenIP(network, nil)
		return err
	}); err != nil {
		return fmt.Errorf("ping %s: %w", ip, err)
	}
	defer conn.Close()
	var idb [2]byte
	_, _ = rand.Read(idb[:])
	id := binary.BigEndian.Uint16(idb[:])
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 1500)
	for seq := uint16(1); time.Now().Before(deadline); seq++ {
		if _, err := conn.WriteTo(EchoRequest(request, id, seq), &net.IPAddr{IP: dst.AsSlice()}); err != nil {
			return fmt.Errorf("ping %s from %s: %w", ip, netns, err)
		}
		next := time.Now().Add(250 * time.Millisecond)
		if next.After(deadline) {
			next = deadline
		}
		_ = conn.SetReadDeadline(next)
		for {
			n, from, err := conn.ReadFrom(buf)
			if err != nil {
				break // no answer within the interval: send the next request
			}
			src, ok := from.(*net.IPAddr)
			if !ok {
				continue
			}
			if a, ok := netip.AddrFromSlice(src.IP); ok && a.Unmap() == dst && IsEchoReply(buf[:n], reply, id) {
				return nil
			}
		}
	}
	return fmt.Errorf("ping %s from %s: no echo reply within %s", ip, netns, timeout)
}

// EchoRequest is an ICMP (type 8) or ICMPv6 (type 128) echo request with id and seq. The ICMPv4
// checksum is filled in; the kernel computes ICMPv6's.
func EchoRequest(typ byte, id, seq uint16) []byte {
	m := make([]byte, 16)
	m[0] = typ
	binary.BigEndian.PutUint16(m[4:], id)
	binary.BigEndian.PutUint16(m[6:], seq)
	copy(m[8:], "ipwarden")
	if typ == 8 {
		binary.BigEndian.PutUint16(m[2:], icmpChecksum(m))
	}
	return m
}

// IsEchoReply says whether the ICMP message m is an echo reply of type reply to identifier id.
func IsEchoReply(m []byte, reply byte, id uint16) bool {
	return len(m) >= 8 && m[0] == reply && m[1] == 0 && binary.BigEndian.Uint16(m[4:]) == id
}

// icmpChecksum is the Internet checksum (RFC 1071) of m.
func icmpChecksum(m []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(m); i += 2 {
		sum += uint32(m[i])<<8 | uint32(m[i+1])
	}
	if len(m)%2 == 1 {
		sum += uint32(m[len(m)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// DeleteLink removes the network interface name from this process's network namespace, as `ip
// link del` does (one rtnetlink RTM_DELLINK request). A name that does not exist is no error.
func DeleteLink(name string) error {
	ifi, err := net.InterfaceByName(name)
	if err != nil {
		return nil // gone already
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("delete link %s: netlink socket: %w", name, err)
	}
	defer unix.Close(fd)
	req := make([]byte, unix.SizeofNlMsghdr+unix.SizeofIfInfomsg)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.RTM_DELLINK)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	binary.NativeEndian.PutUint32(req[8:], 1) // sequence number
	req[unix.SizeofNlMsghdr] = unix.AF_UNSPEC
	binary.NativeEndian.PutUint32(req[unix.SizeofNlMsghdr+4:], uint32(ifi.Index))
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return fmt.Errorf("delete link %s: read the answer: %w", name, err)
	}
	// The answer is an NLMSG_ERROR message whose error is 0 on success.
	if n < unix.SizeofNlMsghdr+4 || binary.NativeEndian.Uint16(buf[4:]) != unix.NLMSG_ERROR {
		return fmt.Errorf("delete link %s: unexpected netlink answer (%d bytes)", name, n)
	}
	if errno := -int32(binary.NativeEndian.Uint32(buf[unix.SizeofNlMsghdr:])); errno != 0 {
		if unix.Errno(errno) == unix.ENODEV {
			return nil
		}
		return fmt.Errorf("delete link %s: %w", name, unix.Errno(errno))
	}
	return nil
}
