//go:build failpoints

package agent

import (
	"fmt"
	"os"
)

// Failpoints for the crash tests, compiled in only with the failpoints build tag (the integration
// tests build the agent so; releases never are). IPWARDEN_FAILPOINT names one:
//
//	hold-add-write: an ADD never writes its attachment (nor answers: the answer follows the
//	write), so a test can kill or stop the agent while an ADD is in flight.
func init() {
	switch os.Getenv("IPWARDEN_FAILPOINT") {
	case "hold-add-write":
		beforeAddWrite = func() {
			fmt.Fprintln(os.Stderr, "failpoint hold-add-write: holding an ADD before its journal write")
			select {}
		}
	}
}
