//go:build failpoints

package agent

import "os"

// Failpoints for the crash tests, compiled in only with the failpoints build tag (the integration
// tests build the agent so; releases never are). IPWARDEN_FAILPOINT names one:
//
//	hold-early-add-write: an ADD answered early never writes its attachment, so a test can kill
//	the agent between the answer and the write.
func init() {
	switch os.Getenv("IPWARDEN_FAILPOINT") {
	case "hold-early-add-write":
		beforeEarlyAddWrite = func() { select {} }
	}
}
