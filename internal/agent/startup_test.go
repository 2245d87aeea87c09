package agent

import (
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
)

// startRecorder is a starter that records what reconcileStart asks of it, in order.
type startRecorder struct {
	calls      []string
	recoverErr error
	hold       bool
}

func (r *startRecorder) SetSandboxes(ipam.NodeSandboxes) { r.calls = append(r.calls, "sandboxes") }
func (r *startRecorder) Rebuild([]ipam.Pod) (int, error) {
	r.calls = append(r.calls, "rebuild")
	return 0, nil
}
func (r *startRecorder) RecoverReservations(evs []ipam.ReservationEvidence) (int, error) {
	r.calls = append(r.calls, "recover")
	return len(evs), r.recoverErr
}
func (r *startRecorder) StartHold(time.Time) {
	r.calls = append(r.calls, "hold")
	r.hold = true
}
func (r *startRecorder) Hold() (bool, time.Time) { return r.hold, time.Time{} }

// The start recovers DRA reservations from the claims exactly when it rebuilds the journal (it
// was lost, damaged or new, or a restart interrupted the hold): after the rebuild from the pods,
// before the hold starts; a refused recovery stops the start there, as a refused rebuild does.
// Without a lost journal the claims are not read (a LIST of every claim in the cluster).
func TestReconcileStartRecoversOnlyAfterALostJournal(t *testing.T) {
	ev := []ipam.ReservationEvidence{{Claim: ipam.ClaimDevice{UID: "c"}, Addr: netip.MustParseAddr("10.1.0.8")}}
	for _, tc := range []struct {
		name        string
		empty       bool // the journal was lost, damaged or new
		interrupted bool // a hold's marker is in the state directory
		dra         bool // --dra: the claims can be read
		refused     error
		want        []string
		wantErr     bool
	}{
		{name: "journal kept: no read, no hold", dra: true, want: []string{"sandboxes", "rebuild", "sandboxes"}},
		{name: "journal lost: recovered before the hold", empty: true, dra: true, want: []string{"sandboxes", "rebuild", "recover", "hold"}},
		{name: "a hold interrupted: recovered again", interrupted: true, dra: true, want: []string{"sandboxes", "rebuild", "recover", "hold"}},
		{name: "journal lost, no --dra: the hold alone", empty: true, want: []string{"sandboxes", "rebuild", "hold"}},
		{name: "the recovery refused: the start stops", empty: true, dra: true, refused: errRefused, want: []string{"sandboxes", "rebuild", "recover"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.interrupted {
				if err := journal.MarkHold(dir, mt0.Add(time.Hour)); err != nil {
					t.Fatal(err)
				}
			}
			reads := 0
			var claims func() []ipam.ReservationEvidence
			if tc.dra {
				claims = func() []ipam.ReservationEvidence { reads++; return ev }
			}
			r := &startRecorder{recoverErr: tc.refused}
			_, err := reconcileStart(r, nil, ipam.NodeSandboxes{}, claims, dir, startFacts{journalEmpty: tc.empty}, time.Hour, mt0, logr.Discard())
			if (err != nil) != tc.wantErr || tc.wantErr && !errors.Is(err, errRefused) {
				t.Fatalf("reconcileStart: %v", err)
			}
			if !slices.Equal(r.calls, tc.want) {
				t.Fatalf("calls %v, want %v", r.calls, tc.want)
			}
			if wantReads := boolInt(slices.Contains(tc.want, "recover")); reads != wantReads {
				t.Fatalf("claims read %d times, want %d", reads, wantReads)
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
