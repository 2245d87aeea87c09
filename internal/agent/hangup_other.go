//go:build !linux

package agent

import "net"

// watchHangup is Linux-only (POLLHUP on a unix stream socket); elsewhere an ADD whose plugin went
// away is rolled back only when its answer cannot be written.
func watchHangup(net.Conn, func()) (stop func()) { return func() {} }
