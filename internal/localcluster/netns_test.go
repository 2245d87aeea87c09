package localcluster

import (
	"encoding/binary"
	"errors"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestEchoRequest(t *testing.T) {
	for _, tc := range []struct {
		name    string
		typ     byte
		id, seq uint16
	}{
		{"v4", 8, 0x1234, 1},
		{"v4, odd bytes in the fields", 8, 0xffff, 0xfffe},
		{"v6 (the kernel sums it)", 128, 7, 9},
	} {
		m := EchoRequest(tc.typ, tc.id, tc.seq)
		if m[0] != tc.typ || binary.BigEndian.Uint16(m[4:]) != tc.id || binary.BigEndian.Uint16(m[6:]) != tc.seq {
			t.Errorf("%s: header % x", tc.name, m[:8])
		}
		sum := binary.BigEndian.Uint16(m[2:])
		if tc.typ == 8 && icmpChecksum(m) != 0 {
			t.Errorf("%s: checksum %#04x does not verify", tc.name, sum)
		}
		if tc.typ == 128 && sum != 0 {
			t.Errorf("%s: checksum %#04x set; the kernel computes ICMPv6's", tc.name, sum)
		}
	}
	// RFC 1071's example: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2, so its checksum is 220d.
	if got := icmpChecksum([]byte{0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7}); got != 0x220d {
		t.Errorf("RFC 1071 example: %#04x, want 0x220d", got)
	}
}

func TestIsEchoReply(t *testing.T) {
	reply := func(typ, code byte, id uint16) []byte {
		m := EchoRequest(8, id, 1)
		m[0], m[1] = typ, code
		return m
	}
	for _, tc := range []struct {
		name string
		m    []byte
		typ  byte
		want bool
	}{
		{"v4 reply", reply(0, 0, 42), 0, true},
		{"v6 reply", reply(129, 0, 42), 129, true},
		{"another identifier", reply(0, 0, 43), 0, false},
		{"an echo request", reply(8, 0, 42), 0, false},
		{"unreachable", reply(3, 1, 42), 0, false},
		{"nonzero code", reply(0, 1, 42), 0, false},
		{"short", []byte{0, 0, 0}, 0, false},
	} {
		if got := IsEchoReply(tc.m, tc.typ, 42); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// netnsInode is the inode of a network namespace file (two paths name one namespace when equal).
func netnsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// The demo's namespaces and its bridge check without the ip and ping programs (needs root): a
// named namespace is made and removed, an ICMP echo is answered inside it once its loopback is up
// and not before, a link made inside it is deleted, and no thread of this process is left in it.
func TestNetnsPingAndDeleteLink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("this test creates network namespaces and raw sockets: run it as root")
	}
	home := netnsInode(t, "/proc/self/ns/net")
	name := RandomName("ipwt-", 4)
	if err := AddNetns(name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = DelNetns(name) })
	path := NetnsPath(name)
	if netnsInode(t, path) == home {
		t.Fatalf("%s is this process's own network namespace", path)
	}
	if err := AddNetns(name); err == nil {
		t.Fatal("a second AddNetns of one name succeeded")
	}

	start := time.Now()
	if err := Ping(path, "127.0.0.1", 500*time.Millisecond); err == nil {
		t.Fatal("ping 127.0.0.1 answered in a namespace whose loopback is down")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("the unanswered ping took %s, its timeout was 500ms", took)
	}
	if err := InNetns(path, func() error { return linkUp("lo") }); err != nil {
		t.Fatal(err)
	}
	if err := Ping(path, "127.0.0.1", 2*time.Second); err != nil {
		t.Fatal(err)
	}

	// A bridge made inside the namespace, deleted there by DeleteLink; a missing one is no error.
	if err := InNetns(path, func() error {
		if err := newBridge("ipwt-br0"); err != nil {
			return err
		}
		if _, err := net.InterfaceByName("ipwt-br0"); err != nil {
			return err
		}
		if err := DeleteLink("ipwt-br0"); err != nil {
			return err
		}
		if _, err := net.InterfaceByName("ipwt-br0"); err == nil {
			return errors.New("ipwt-br0 is still there after DeleteLink")
		}
		return DeleteLink("ipwt-br0")
	}); err != nil {
		t.Fatal(err)
	}

	// Every thread the runtime hands out is back in this process's namespace.
	var wg sync.WaitGroup
	var mu sync.Mutex
	var stray int
	for range 64 {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var st unix.Stat_t
			if err := unix.Stat("/proc/thread-self/ns/net", &st); err == nil && st.Ino != home {
				mu.Lock()
				stray++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if stray > 0 {
		t.Fatalf("%d threads are in another network namespace", stray)
	}

	if err := DelNetns(name); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s after DelNetns: %v", path, err)
	}
	if err := DelNetns(name); err != nil {
		t.Fatalf("a second DelNetns: %v", err)
	}
}

// linkUp sets the interface up (SIOCSIFFLAGS) in the calling thread's namespace.
func linkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// newBridge creates a bridge (rtnetlink RTM_NEWLINK, IFLA_IFNAME and IFLA_LINKINFO/IFLA_INFO_KIND)
// in the calling thread's namespace.
func newBridge(name string) error {
	attr := func(typ uint16, data []byte) []byte {
		b := make([]byte, (4+len(data)+3)&^3)
		binary.NativeEndian.PutUint16(b[0:], uint16(4+len(data)))
		binary.NativeEndian.PutUint16(b[2:], typ)
		copy(b[4:], data)
		return b
	}
	msg := make([]byte, unix.SizeofNlMsghdr+unix.SizeofIfInfomsg)
	msg = append(msg, attr(unix.IFLA_IFNAME, append([]byte(name), 0))...)
	msg = append(msg, attr(unix.IFLA_LINKINFO, attr(unix.IFLA_INFO_KIND, []byte("bridge")))...)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint16(msg[4:], unix.RTM_NEWLINK)
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK|unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	binary.NativeEndian.PutUint32(msg[8:], 1)
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return err
	}
	if n < unix.SizeofNlMsghdr+4 || binary.NativeEndian.Uint16(buf[4:]) != unix.NLMSG_ERROR {
		return errors.New("unexpected netlink answer")
	}
	if errno := -int32(binary.NativeEndian.Uint32(buf[unix.SizeofNlMsghdr:])); errno != 0 {
		return unix.Errno(errno)
	}
	return nil
}
