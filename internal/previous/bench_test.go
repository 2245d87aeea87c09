package previous

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
)

// The cost per ADD while the configuration names host-local as "previous" (docs/design.md,
// "What the previous IPAM reserved"; BENCHMARKS.md): the reading of host-local's directory under
// its lock, and ipwarden's reservation file (created under the lock, synced, its directory
// synced) with its removal at the free. files is how many reservations host-local's directory
// holds besides (a node's old pods).
func benchDir(b *testing.B, files int) string {
	b.Helper()
	dir := filepath.Join(b.TempDir(), "podnet")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	for i := range files {
		a := netip.AddrFrom4([4]byte{10, 99, byte(i >> 8), byte(i)})
		if err := os.WriteFile(filepath.Join(dir, a.String()), []byte(fmt.Sprintf("old-%d\r\neth0", i)), 0o600); err != nil {
			b.Fatal(err)
		}
	}
	return dir
}

// BenchmarkReadHostLocal is the reading at an ADD: first (every file opened once) and then as
// the agent makes it, with what earlier readings found (ReadHostLocalKnown).
func BenchmarkReadHostLocal(b *testing.B) {
	for _, files := range []int{0, 110} {
		dir := benchDir(b, files)
		ctx := context.Background()
		b.Run(fmt.Sprintf("files=%d/first", files), func(b *testing.B) {
			for range b.N {
				if _, err := ReadHostLocal(ctx, dir); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("files=%d/known", files), func(b *testing.B) {
			known := map[string]bool{}
			for range b.N {
				if _, err := ReadHostLocalKnown(ctx, dir, known); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkReserveHostLocal is one ADD's reservation and its free's removal.
func BenchmarkReserveHostLocal(b *testing.B) {
	for _, files := range []int{0, 110} {
		b.Run(fmt.Sprintf("files=%d", files), func(b *testing.B) {
			dir := benchDir(b, files)
			ctx := context.Background()
			rs := []Reservation{{Addr: netip.MustParseAddr("10.98.0.1"), ContainerID: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", IfName: "eth0"}}
			b.Run("reserve", func(b *testing.B) {
				for range b.N {
					b.StopTimer()
					if _, err := UnreserveHostLocal(ctx, dir, rs); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
					if err := ReserveHostLocal(ctx, dir, rs); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("release", func(b *testing.B) {
				for range b.N {
					b.StopTimer()
					if err := ReserveHostLocal(ctx, dir, rs); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
					if _, err := UnreserveHostLocal(ctx, dir, rs); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
