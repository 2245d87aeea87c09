package controller

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// The controller's answer to a waiting claim use (docs/design.md, "VM addresses"), one case per
// rule, through PlanFill on a rebuilt State.

var vmKey = ClaimKey{"vms", "vm-a.net"}

func use(uid string, attached, target bool, address string) ipwardenv1.ClaimUse {
	return ipwardenv1.ClaimUse{Namespace: vmKey.Namespace, Name: vmKey.Name, UID: uid, Pod: "virt-launcher-" + uid,
		Address: ipwardenv1.IPAddress(address), Attached: attached, MigrationTarget: target}
}

func binding(address, uid string) ipwardenv1.ClaimBinding {
	return ipwardenv1.ClaimBinding{Address: ipwardenv1.IPAddress(address), Namespace: vmKey.Namespace, Name: vmKey.Name, UID: uid}
}

// claimNode is a node of a case: what its status holds in pool p and the claim uses of its spec.
type claimNode struct {
	held []string
	uses []ipwardenv1.ClaimUse
}

func claimState(t *testing.T, cidr string, st ipwardenv1.IPPoolStatus, nodes map[string]claimNode, now time.Time) *State {
	t.Helper()
	pool := testPool("p", cidr, time.Minute)
	pool.Status = st
	var allocs []ipwardenv1.NodeIPAllocation
	for _, name := range sortedKeys(nodes) {
		a := allocWith(name, "p", nodes[name].held...)
		a.Spec = ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Requested: int32(len(nodes[name].held)), IPAMClaims: nodes[name].uses}}}
		allocs = append(allocs, a)
	}
	s := NewState(DefaultExhaustionMarks)
	if twice := s.Rebuild([]ipwardenv1.IPPool{pool}, allocs, now); !twice.IsEmpty() {
		t.Fatalf("held twice after Rebuild: %v", twice)
	}
	return s
}

func useSpec(held int, uses ...ipwardenv1.ClaimUse) ipwardenv1.NodeIPAllocationSpec {
	return ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Requested: int32(held), IPAMClaims: uses}}}
}

func TestAnswerClaims(t *testing.T) {
	known := map[ClaimKey]KnownClaim{vmKey: {UID: "u1"}}
	tests := []struct {
		name     string
		cidr     string
		st       ipwardenv1.IPPoolStatus
		others   map[string]claimNode
		known    map[ClaimKey]KnownClaim
		use      ipwardenv1.ClaimUse
		settling bool
		// what n gets
		wantAddr   string // granted ("" none)
		wantShared bool
		wantCode   string // refused with this condition reason
		wantAsked  []string
		wantRecord bool // the pool status write comes first
	}{
		{name: "a claim the controller does not know is refused", known: map[ClaimKey]KnownClaim{},
			use: use("u1", false, false, ""), wantCode: refusedUnknown},
		{name: "a claim re-created under its name is another claim", known: map[ClaimKey]KnownClaim{vmKey: {UID: "u2"}},
			use: use("u1", false, false, ""), wantCode: refusedUnknown},
		{name: "no binding: a free address, recorded first", use: use("u1", false, false, ""),
			wantAddr: "*", wantRecord: true},
		{name: "no binding: the address the use asks for", use: use("u1", false, false, "10.0.0.9"),
			wantAddr: "10.0.0.9", wantRecord: true},
		{name: "no binding: the address the claim's status.ips asks for", known: map[ClaimKey]KnownClaim{vmKey: {UID: "u1", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.7")}}},
			use: use("u1", false, false, ""), wantAddr: "10.0.0.7", wantRecord: true},
		{name: "no binding: an address bound to another claim is a conflict", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.9", "u9")}},
			use: use("u1", false, false, "10.0.0.9"), wantCode: ipwardenv1.ClaimReasonAddressConflict},
		{name: "no binding: an address another node holds is a conflict", others: map[string]claimNode{"x": {held: []string{"10.0.0.9"}}},
			use: use("u1", false, false, "10.0.0.9"), wantCode: ipwardenv1.ClaimReasonAddressConflict},
		{name: "no binding: an address the pool does not hand out is a conflict", use: use("u1", false, false, "10.0.1.9"),
			wantCode: ipwardenv1.ClaimReasonAddressConflict},
		{name: "no binding: an exhausted pool", cidr: "10.0.0.0/30", others: map[string]claimNode{"x": {held: []string{"10.0.0.1-10.0.0.2"}}},
			use: use("u1", false, false, ""), wantCode: ipwardenv1.ClaimReasonSubnetExhausted},
		{name: "no binding: no free address is picked while the controller settles", settling: true, use: use("u1", false, false, "")},
		{name: "a binding no node holds is granted", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}},
			use: use("u1", false, false, ""), wantAddr: "10.0.0.5"},
		{name: "a binding is granted while the controller settles too", settling: true, st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}},
			use: use("u1", false, false, ""), wantAddr: "10.0.0.5"},
		{name: "a holder with no attached use is asked to give it back (restart elsewhere)", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}},
			others: map[string]claimNode{"x": {held: []string{"10.0.0.5"}}}, use: use("u1", false, false, ""), wantAsked: []string{"x"}},
		{name: "a migration target shares the address", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}},
			others: map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}}},
			use:    use("u1", false, true, ""), wantAddr: "10.0.0.5", wantShared: true, wantRecord: true},
		{name: "the source going back to a holding target shares it too", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}},
			others: map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, true, "10.0.0.5")}}},
			use:    use("u1", false, false, ""), wantAddr: "10.0.0.5", wantShared: true, wantRecord: true},
		{name: "a second pod without the migration label is refused", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}},
			others: map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}}},
			use:    use("u1", false, false, ""), wantCode: refusedAttached},
		{name: "a third holder is refused", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")},
			Shared: []ipwardenv1.SharedClaimAddress{{Address: "10.0.0.5", UID: "u1", Nodes: []string{"x", "y"}}}},
			others: map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}},
				"y": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, true, "10.0.0.5")}}},
			use: use("u1", false, true, ""), wantCode: refusedAttached},
		{name: "a shared grant is only for the same claim: another UID's address is a conflict", st: ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u9")}},
			others: map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u9", true, false, "10.0.0.5")}}},
			use:    use("u1", false, true, "10.0.0.5"), wantCode: ipwardenv1.ClaimReasonAddressConflict},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cidr := tc.cidr
			if cidr == "" {
				cidr = "10.0.0.0/28"
			}
			s := claimState(t, cidr, tc.st, tc.others, t0)
			k := tc.known
			if k == nil {
				k = known
			}
			for key, c := range k {
				s.SetClaim(key, c)
			}
			if tc.settling {
				s.SettleUntil(t0.Add(time.Minute))
			}
			f := s.PlanFill("n", useSpec(0, tc.use), t0)
			pf := f.Pools["p"]
			got := pf.Added.Union(pf.Shared)
			if tc.wantAddr == "" && !got.IsEmpty() || tc.wantAddr == "*" && count(got) != 1 || tc.wantAddr != "" && tc.wantAddr != "*" && got.String() != tc.wantAddr {
				t.Fatalf("granted %v, want %q", got, tc.wantAddr)
			}
			if !pf.Shared.IsEmpty() != tc.wantShared {
				t.Fatalf("shared %v, want shared %v", pf.Shared, tc.wantShared)
			}
			code := ""
			for _, a := range pf.ClaimAnswers {
				code = a.Code
			}
			if code != tc.wantCode || (tc.wantCode != "") != (len(pf.ClaimRefused) == 1) {
				t.Fatalf("answers %+v, refused %+v, want code %q", pf.ClaimAnswers, pf.ClaimRefused, tc.wantCode)
			}
			if !slices.Equal(pf.AskedBack, tc.wantAsked) {
				t.Fatalf("asked back %v, want %v", pf.AskedBack, tc.wantAsked)
			}
			if pf.MustRecord != tc.wantRecord {
				t.Fatalf("must record %v, want %v", pf.MustRecord, tc.wantRecord)
			}
			st := NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, useSpec(0, tc.use), 1, f)
			if n := len(st.Pools); tc.wantCode != "" && (n != 1 || len(st.Pools[0].ClaimRefused) != 1) {
				t.Fatalf("status %+v shows no refusal", st.Pools)
			}
		})
	}
}

// A holder asked to give a claim's address back lists it in wantedElsewhere, and so do both
// nodes of a shared grant; a holder whose pod still uses it does not.
func TestClaimWantedElsewhere(t *testing.T) {
	b := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}}
	sh := b
	sh.Shared = []ipwardenv1.SharedClaimAddress{{Address: "10.0.0.5", UID: "u1", Nodes: []string{"x", "y"}}}
	tests := []struct {
		name  string
		st    ipwardenv1.IPPoolStatus
		nodes map[string]claimNode
		want  string
	}{
		{"another node waits and no attachment here uses it", b, map[string]claimNode{
			"x": {held: []string{"10.0.0.5"}}, "y": {uses: []ipwardenv1.ClaimUse{use("u1", false, false, "")}}}, "10.0.0.5"},
		{"an attachment here uses it", b, map[string]claimNode{
			"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}}, "y": {uses: []ipwardenv1.ClaimUse{use("u1", false, false, "")}}}, ""},
		{"nobody waits", b, map[string]claimNode{"x": {held: []string{"10.0.0.5"}}}, ""},
		{"under a shared grant", sh, map[string]claimNode{
			"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}},
			"y": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, true, "10.0.0.5")}}}, "10.0.0.5"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := claimState(t, "10.0.0.0/28", tc.st, tc.nodes, t0)
			s.SetClaim(vmKey, KnownClaim{UID: "u1"})
			f := s.PlanFill("x", useSpec(1, tc.nodes["x"].uses...), t0)
			if got := f.Pools["p"].WantedElsewhere.String(); got != tc.want {
				t.Fatalf("wantedElsewhere %q, want %q", got, tc.want)
			}
		})
	}
}

// When one node of a shared grant gives the address back, it leaves that node without cooling
// or returning to the pool (the other still holds it) and the grant ends; the last holder's give
// back cools it as usual. A failed or rejected fill grants nothing and frees nothing.
func TestSharedGiveBack(t *testing.T) {
	sh := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")},
		Shared: []ipwardenv1.SharedClaimAddress{{Address: "10.0.0.5", UID: "u1", Nodes: []string{"x", "y"}}}}
	nodes := map[string]claimNode{
		"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}},
		"y": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, true, "10.0.0.5")}},
	}
	s := claimState(t, "10.0.0.0/28", sh, nodes, t0)
	s.SetClaim(vmKey, KnownClaim{UID: "u1"})
	// x's source pod is gone: it releases the address and lists no use.
	give := ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{"10.0.0.5"}}}}
	q := s.StartFill("x", &ipwardenv1.NodeIPAllocation{Spec: give}, t0)
	steps := q.Steps()
	if len(steps) != 1 || steps[0].Kind != StepNodeStatus {
		t.Fatalf("steps %v: dropping a shared copy needs no cooling record", steps)
	}
	if d := q.Fill().Pools["p"].Dropped.String(); d != "10.0.0.5" {
		t.Fatalf("dropped %q", d)
	}
	q.Advance(Landed)
	p := s.pools["p"]
	if !p.alloc.Allocated().Contains(netip.MustParseAddr("10.0.0.5")) || p.alloc.Cooling().Contains(netip.MustParseAddr("10.0.0.5")) {
		t.Fatal("the address y still holds was freed or cooled")
	}
	if len(p.shared) != 0 {
		t.Fatalf("the shared grant stays: %v", p.shared)
	}
	if b, _ := s.ClaimCounts("p"); b != 1 {
		t.Fatal("the binding went with the shared grant")
	}
	st, _ := s.PoolStatus("p", ipwardenv1.IPPoolStatus{}, 1, t0)
	if len(st.Shared) != 0 || len(st.IPAMClaims) != 1 {
		t.Fatalf("pool status %+v", st)
	}
	// y gives it back too: now it cools, with its record first.
	q = s.StartFill("y", &ipwardenv1.NodeIPAllocation{Spec: give}, t0)
	if steps := q.Steps(); len(steps) != 2 || steps[0].Kind != StepPoolStatus {
		t.Fatalf("steps %v", steps)
	}
	q.Advance(Landed)
	q.Advance(Landed)
	if !p.alloc.Cooling().Contains(netip.MustParseAddr("10.0.0.5")) {
		t.Fatal("the last holder's give-back does not cool the address")
	}
}

// Durable first: a fill that creates a binding writes the pool status before the node status;
// when the pool write fails, the node gets nothing and the address is not handed to another
// node, and the next fill records it again first.
func TestClaimBindingDurableFirst(t *testing.T) {
	s := claimState(t, "10.0.0.0/28", ipwardenv1.IPPoolStatus{}, nil, t0)
	s.SetClaim(vmKey, KnownClaim{UID: "u1"})
	alloc := &ipwardenv1.NodeIPAllocation{Spec: useSpec(0, use("u1", false, false, ""))}
	q := s.StartFill("n", alloc, t0)
	steps := q.Steps()
	if len(steps) != 2 || steps[0].Kind != StepPoolStatus || steps[1].Kind != StepNodeStatus {
		t.Fatalf("steps %v", steps)
	}
	bound := q.Fill().Pools["p"].Added
	if count(bound) != 1 {
		t.Fatalf("added %v", bound)
	}
	q.Advance(Rejected)
	if !s.HeldBy("n")["p"].IsEmpty() || q.Result() != Failed {
		t.Fatal("a failed binding write granted the address")
	}
	// Another node's ordinary fill does not get the bound address.
	f := s.PlanFill("m", spec("p", 1), t0)
	if f.Pools["p"].Added.Overlaps(bound) {
		t.Fatal("a bound address went to an ordinary fill")
	}
	s.Abort(f, true)
	q = s.StartFill("n", alloc, t0)
	if steps := q.Steps(); len(steps) != 2 || steps[0].Kind != StepPoolStatus {
		t.Fatalf("the retry does not record first: %v", steps)
	}
	st, _ := s.PoolStatus("p", ipwardenv1.IPPoolStatus{}, 1, t0)
	s.MarkClaimsDurable("p", st)
	q.Advance(Landed)
	q.Advance(Landed)
	if !s.HeldBy("n")["p"].Equal(bound) {
		t.Fatal("not granted after the binding landed")
	}
	// The next fill relies on a durable binding: no pool write.
	alloc.Spec = useSpec(1, use("u1", true, false, bound.String()))
	alloc.Status = NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, alloc.Spec, 1, q.Fill())
	if q := s.StartFill("n", alloc, t0); slices.ContainsFunc(q.Steps(), func(st Step) bool { return st.Kind == StepPoolStatus }) {
		t.Fatalf("steps %v", q.Steps())
	}
}

// A restarted controller (Rebuild from the statuses) keeps the bindings and shared grants: an
// address two nodes hold under a shared grant is not held twice, and one without is.
func TestRebuildKeepsClaims(t *testing.T) {
	st := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1"), binding("10.0.0.6", "u2")},
		Shared: []ipwardenv1.SharedClaimAddress{{Address: "10.0.0.5", UID: "u1", Nodes: []string{"x", "y"}}}}
	pool := testPool("p", "10.0.0.0/28", time.Minute)
	pool.Status = st
	x, y := allocWith("x", "p", "10.0.0.5-10.0.0.6"), allocWith("y", "p", "10.0.0.5-10.0.0.6")
	s := NewState(DefaultExhaustionMarks)
	twice := s.Rebuild([]ipwardenv1.IPPool{pool}, []ipwardenv1.NodeIPAllocation{x, y}, t0)
	if twice.String() != "10.0.0.6" {
		t.Fatalf("held twice %v, want 10.0.0.6 only", twice)
	}
	got, _ := s.PoolStatus("p", ipwardenv1.IPPoolStatus{}, 1, t0)
	if !slices.Equal(got.IPAMClaims, st.IPAMClaims) || len(got.Shared) != 1 || got.Shared[0].Address != "10.0.0.5" {
		t.Fatalf("status %+v %+v", got.IPAMClaims, got.Shared)
	}
	if r := s.Audit([]ipwardenv1.NodeIPAllocation{x, y}); r.Twice.String() != "10.0.0.6" {
		t.Fatalf("audit: held twice %v", r.Twice)
	}
}

// Release: a binding is dropped only when the fresh list lacks its claim and no node lists a use.
func TestReleaseClaims(t *testing.T) {
	st := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}}
	for _, tc := range []struct {
		name    string
		listed  map[string]bool
		used    bool
		release bool
	}{
		{"the claim is listed", map[string]bool{"u1": true}, false, false},
		{"gone, but a node lists a use", map[string]bool{}, true, false},
		{"gone and unused", map[string]bool{}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nodes := map[string]claimNode{"x": {held: []string{"10.0.0.5"}}}
			if tc.used {
				nodes["x"] = claimNode{held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}}
			}
			s := claimState(t, "10.0.0.0/28", st, nodes, t0)
			if s.ReleaseCandidates() != !tc.used {
				t.Fatal("candidates")
			}
			got := s.ReleaseClaims(tc.listed)
			if (len(got) == 1) != tc.release {
				t.Fatalf("released %v", got)
			}
			if !s.HeldBy("x")["p"].Equal(addr.MustParseSetString("10.0.0.5")) {
				t.Fatal("the holder lost the address")
			}
		})
	}
}

// The claim's status: granted, the addresses in CIDR form, the owner pod and IPsAllocated True;
// refused, what it had and IPsAllocated False with the reason.
func TestClaimStatusFor(t *testing.T) {
	prev := ipamclaimsv1.IPAMClaimStatus{IPs: []string{"10.0.0.9"}}
	got := ClaimStatusFor(prev, []string{"10.0.0.5/28"}, "pod-b", ClaimAnswer{Granted: true, Pool: "p"}, t0)
	if !slices.Equal(got.IPs, []string{"10.0.0.5/28"}) || got.OwnerPod == nil || got.OwnerPod.Name != "pod-b" ||
		len(got.Conditions) != 1 || got.Conditions[0].Status != metav1.ConditionTrue || got.Conditions[0].Reason != ipwardenv1.ClaimReasonAllocated {
		t.Fatalf("granted: %+v", got)
	}
	got = ClaimStatusFor(prev, nil, "", ClaimAnswer{Code: ipwardenv1.ClaimReasonAddressConflict, Reason: "taken"}, t0)
	if !slices.Equal(got.IPs, prev.IPs) || got.Conditions[0].Status != metav1.ConditionFalse || got.Conditions[0].Reason != ipwardenv1.ClaimReasonAddressConflict {
		t.Fatalf("refused: %+v", got)
	}
	if s := ClaimStatusFor(got, nil, "", ClaimAnswer{Code: ipwardenv1.ClaimReasonAddressConflict, Reason: "taken"}, t0.Add(time.Hour)); !slices.Equal(s.IPs, got.IPs) ||
		!s.Conditions[0].LastTransitionTime.Equal(&got.Conditions[0].LastTransitionTime) {
		t.Fatal("the same answer changes the status")
	}
}

// The source gives its copy back while the target's shared grant is still in flight: the
// address stays allocated (the target is being granted it), neither cooling nor free.
func TestSharedGiveBackWhileTheGrantIsInFlight(t *testing.T) {
	st := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}}
	s := claimState(t, "10.0.0.0/28", st, map[string]claimNode{
		"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{use("u1", true, false, "10.0.0.5")}}}, t0)
	s.SetClaim(vmKey, KnownClaim{UID: "u1"})
	target := s.StartFill("y", &ipwardenv1.NodeIPAllocation{Spec: useSpec(0, use("u1", false, true, ""))}, t0)
	if sh := target.Fill().Pools["p"].Shared.String(); sh != "10.0.0.5" {
		t.Fatalf("shared %q", sh)
	}
	give := ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{"10.0.0.5"}}}}
	source := s.StartFill("x", &ipwardenv1.NodeIPAllocation{Spec: give}, t0)
	if d := source.Fill().Pools["p"].Dropped.String(); d != "10.0.0.5" {
		t.Fatalf("dropped %q", d)
	}
	for _, step := range source.Steps() {
		if step.Kind == StepPoolStatus {
			t.Fatal("a cooling record for the target's address")
		}
		source.Advance(Landed)
	}
	for range target.Steps() {
		target.Advance(Landed)
	}
	a := netip.MustParseAddr("10.0.0.5")
	p := s.pools["p"]
	if !s.HeldBy("y")["p"].Contains(a) || s.HeldBy("x")["p"].Contains(a) || !p.alloc.Allocated().Contains(a) || p.alloc.Cooling().Contains(a) {
		t.Fatalf("y %v, x %v, allocated %v, cooling %v", s.HeldBy("y"), s.HeldBy("x"), p.alloc.Allocated(), p.alloc.Cooling())
	}
}

// One address per claim and family on a network: a use in another pool of the network than the
// one that records the claim is refused, naming that pool.
func TestClaimRecordedInAnotherPool(t *testing.T) {
	p, q := testPool("p", "10.0.0.0/28", time.Minute), testPool("q", "10.0.1.0/28", time.Minute)
	q.Status.IPAMClaims = []ipwardenv1.ClaimBinding{binding("10.0.1.5", "u1")}
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{p, q}, nil, t0)
	s.SetClaim(vmKey, KnownClaim{UID: "u1"})
	f := s.PlanFill("n", useSpec(0, use("u1", false, false, "")), t0)
	pf := f.Pools["p"]
	if !pf.Added.IsEmpty() || len(pf.ClaimRefused) != 1 || pf.ClaimRefused[0].Reason != "IPAMClaim vms/vm-a.net's address is recorded in pool q, not p" {
		t.Fatalf("added %v, refused %+v", pf.Added, pf.ClaimRefused)
	}
}

// A claim's address the node still lists as releasing (the old pod's DEL on the node where the
// VM restarts) is not granted to it until its spec stops releasing it.
func TestClaimAddressStillReleasing(t *testing.T) {
	st := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}}
	s := claimState(t, "10.0.0.0/28", st, map[string]claimNode{"n": {held: []string{"10.0.0.5"}}}, t0)
	s.SetClaim(vmKey, KnownClaim{UID: "u1"})
	sp := useSpec(0, use("u1", false, false, ""))
	sp.Pools[0].Releasing = []ipwardenv1.AddressBlock{"10.0.0.5"}
	q := s.StartFill("n", &ipwardenv1.NodeIPAllocation{Spec: sp}, t0)
	pf := q.Fill().Pools["p"]
	if pf.Removed.String() != "10.0.0.5" || !pf.Added.IsEmpty() || len(pf.ClaimAnswers) != 0 {
		t.Fatalf("removed %v, added %v, answers %+v", pf.Removed, pf.Added, pf.ClaimAnswers)
	}
	for range q.Steps() {
		q.Advance(Landed)
	}
	// Cooling now; the next spec no longer releases it: granted out of the cooldown.
	f := s.PlanFill("n", useSpec(0, use("u1", false, false, "")), t0.Add(time.Second))
	if f.Pools["p"].Added.String() != "10.0.0.5" {
		t.Fatalf("added %v", f.Pools["p"].Added)
	}
}

// The pod a claim's status names: the last answered pod while a node still lists its use; once
// it is gone (a restart on a node that kept the address, with no wait to answer) the attached
// pod; during a migration the target.
func TestClaimOwner(t *testing.T) {
	st := ipwardenv1.IPPoolStatus{IPAMClaims: []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}}
	pod := func(name string, attached, target bool) ipwardenv1.ClaimUse {
		u := use("u1", attached, target, "10.0.0.5")
		u.Pod = name
		return u
	}
	for _, tc := range []struct {
		name   string
		nodes  map[string]claimNode
		prefer string
		want   string
	}{
		{"the answered pod runs", map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{pod("a1", true, false)}}}, "a1", "a1"},
		{"restarted: the answered pod is gone", map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{pod("a2", true, false)}}}, "a1", "a2"},
		{"migrating: the target", map[string]claimNode{
			"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{pod("a2", true, false)}},
			"y": {uses: []ipwardenv1.ClaimUse{pod("a3", true, true)}}}, "a1", "a3"},
		{"a failed migration: the source", map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{pod("a2", true, false)}}}, "a3", "a2"},
		{"the answered pod still waits", map[string]claimNode{"x": {held: []string{"10.0.0.5"}, uses: []ipwardenv1.ClaimUse{pod("a2", true, false), pod("a4", false, true)}}}, "a4", "a4"},
		{"no use", map[string]claimNode{"x": {held: []string{"10.0.0.5"}}}, "a1", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := claimState(t, "10.0.0.0/28", st, tc.nodes, t0)
			if got := s.ClaimOwner("u1", tc.prefer); got != tc.want {
				t.Fatalf("ClaimOwner = %q, want %q", got, tc.want)
			}
		})
	}
}
