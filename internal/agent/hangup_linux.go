package agent

import (
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// hangupPoll is how often watchHangup looks at the connection.
const hangupPoll = 100 * time.Millisecond

// watchHangup calls gone once the plugin has closed its end of conn, while the agent works on
// its request; it stops when the returned function is called. The plugin half-closes after its
// request, so a read sees EOF at once and cannot tell; a unix stream socket whose peer has closed
// completely reports POLLHUP (the kernel shuts down both directions), a half-close does not.
func watchHangup(conn net.Conn, gone func()) (stop func()) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return func() {}
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(hangupPoll)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			hup := false
			_ = rc.Control(func(fd uintptr) {
				fds := []unix.PollFd{{Fd: int32(fd), Events: 0}}
				if n, err := unix.Poll(fds, 0); err == nil && n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLERR) != 0 {
					hup = true
				}
			})
			if hup {
				gone()
				return
			}
		}
	})
	return func() {
		close(done)
		wg.Wait()
	}
}
