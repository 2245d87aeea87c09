//go:build failpoints

package agent

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// Failpoints for the crash tests, compiled in only with the failpoints build tag (the integration
// tests and the chaos suite build the agent so; releases never are). IPWARDEN_FAILPOINT names one:
//
//	hold-add-write: an ADD never writes its attachment (nor answers: the answer follows the
//	write), so a test can kill or stop the agent while an ADD is in flight.
//
//	slow-add-write: every ADD's journal write is stretched: 1-15 ms before it starts and 1-15 ms
//	after it returned (before the ADD is answered). While any ADD write is in that window the
//	file add-write-in-flight exists in IPWARDEN_FAILPOINT_DIR, so a test can time a kill -9 to
//	land on one (the file outlives the kill: it shows the kill landed there).
func init() {
	switch os.Getenv("IPWARDEN_FAILPOINT") {
	case "hold-add-write":
		beforeAddWrite = func() {
			fmt.Fprintln(os.Stderr, "failpoint hold-add-write: holding an ADD before its journal write")
			select {}
		}
	case "slow-add-write":
		marker := filepath.Join(os.Getenv("IPWARDEN_FAILPOINT_DIR"), "add-write-in-flight")
		var mu sync.Mutex
		inFlight := 0
		pause := func() { time.Sleep(time.Duration(1+rand.IntN(15)) * time.Millisecond) }
		beforeAddWrite = func() {
			mu.Lock()
			if inFlight++; inFlight == 1 {
				_ = os.WriteFile(marker, nil, 0o600)
			}
			mu.Unlock()
			pause()
		}
		afterAddWrite = func() {
			pause()
			mu.Lock()
			if inFlight--; inFlight == 0 {
				_ = os.Remove(marker)
			}
			mu.Unlock()
		}
	}
}
