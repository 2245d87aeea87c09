package agent

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// readerHarness is an agent service as Run starts it (ReadsPods) before its pod reader exists,
// with free addresses in its journal, and one ADD of a VM launcher pod (its annotation references
// IPAMClaim "vm") waiting in the pod read.
func readerHarness(t *testing.T) (*Service, chan *cniproto.Response) {
	t.Helper()
	svc := NewService(ipam.New("n1"), &memJournal{}, ServiceOptions{Node: "n1", AddressWait: time.Second, ReadsPods: true, Log: logr.Discard()})
	if err := svc.SetPools([]ipam.Pool{testV4}, []string{"v4"}); err != nil {
		t.Fatal(err)
	}
	if err := svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.8/29")}, RecordOf{}); err != nil {
		t.Fatal(err)
	}
	svc.SetReady(true)
	answer := make(chan *cniproto.Response, 1)
	go func() { answer <- svc.Handle(context.Background(), addReq("launcher")) }()
	// The ADD waits in its pod read: nothing may answer it from the journal meanwhile.
	if err := localcluster.WaitFor(context.Background(), 10*time.Second, 5*time.Millisecond, func() error {
		reading := false
		svc.read(func(m *Machine) {
			for _, r := range m.reqs {
				reading = reading || r.stage == stageReading
			}
		})
		if !reading {
			return errors.New("the ADD is not in its pod read")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-answer:
		t.Fatalf("the ADD was answered before the agent could read its pod: %+v", r)
	default:
	}
	return svc, answer
}

// An ADD that comes while the agent starts (journal loaded, socket open, informers not created
// yet) waits for the pod reader, so a VM launcher's annotation is honoured: here the claim it
// names does not exist, and the ADD says so instead of handing out an ordinary address (what a
// rollout did in the chaos suite before: the VM's address changed).
func TestAddWaitsForThePodReader(t *testing.T) {
	svc, answer := readerHarness(t)
	svc.SetClaimReader(func(context.Context, string, string) (ClaimObject, error) { return ClaimObject{}, errClaimNotFound })
	svc.SetPodMeta(func(context.Context, string, string, string) (ipam.PodMeta, error) {
		return ipam.PodMeta{NetworkAnnotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: "vm"}, NamespaceKnown: true}, nil
	})
	r := <-answer
	if r.Error == nil || r.Error.Code != cniproto.CodeTryAgainLater || !strings.Contains(r.Error.Msg, "IPAMClaim ns/vm does not exist") {
		t.Fatalf("ADD of the VM launcher: %+v %+v; want code 11 naming IPAMClaim ns/vm", r.IPs, r.Error)
	}
}

// With the API server away at start, the ADD waits no more: it is served from the journal
// without its pod's annotations, as documented (TestAgentStartsWithoutAPIServer).
func TestAddServedFromTheJournalWhenTheAPIServerIsAway(t *testing.T) {
	svc, answer := readerHarness(t)
	svc.setAPIError(errors.New("connection refused"))
	r := <-answer
	if r.Error != nil || len(r.IPs) != 1 || !strings.HasPrefix(r.IPs[0].Address, "10.1.0.") {
		t.Fatalf("ADD with the API server away: %+v %+v; want an address the journal holds", r.IPs, r.Error)
	}
}
