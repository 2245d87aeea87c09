package journal

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// The crash tests run this test binary again as a child process that writes to a journal in a
// loop and prints a line after every commit that returned; the parent kills it with SIGKILL at a
// random moment, reopens the journal and checks it: bbolt's own consistency check passes, the
// state machine restores it without contradictions, and it holds exactly the commits the child
// acknowledged, plus possibly the one that was in flight, whole or not at all.

const (
	envChild = "IPWARDEN_JOURNAL_CRASH_CHILD" // "seq" or "concurrent"
	envDir   = "IPWARDEN_JOURNAL_CRASH_DIR"
	envSeed  = "IPWARDEN_JOURNAL_CRASH_SEED"
)

var crashPools = []ipam.Pool{
	{Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, Cooldown: 20 * time.Second,
		Scaling: scaling.Params{BatchSize: 8, BufferPercent: 50, MaxPerNode: 64}},
	{Name: "v6", CIDRs: []netip.Prefix{netip.MustParsePrefix("fd00::/120")}, Cooldown: 20 * time.Second,
		Scaling: scaling.Params{BatchSize: 8, BufferPercent: 50, MaxPerNode: 64}},
}

// restoreState builds the state machine from a snapshot, as the agent does on start.
func restoreState(t testing.TB, snap ipam.Snapshot) *ipam.State {
	s := ipam.New("node-a")
	if problems := s.Restore(snap); len(problems) > 0 {
		t.Fatalf("journal contradicts itself: %v", problems)
	}
	s.SetPools(crashPools, []string{"v4", "v6"})
	return s
}

// ops runs up to n deterministic operations (given seed and the starting state) and calls commit
// with each Change; it stops early if commit fails. Operation i happens at a fixed fake time.
func ops(s *ipam.State, seed uint64, n int, commit func(i int, ch ipam.Change) error) {
	rng := rand.New(rand.NewPCG(seed, 7))
	base := t0.Add(time.Duration(seed) * time.Hour)
	for i := 0; i < n; i++ {
		now := base.Add(time.Duration(i) * time.Second)
		var ch ipam.Change
		var after func()
		switch op := rng.IntN(10); {
		case op < 1 || i == 0: // the controller changes the holding: takes releasing, adds some
			ch = s.SetPools(crashPools, []string{"v4", "v6"})
			for _, p := range []struct{ name, pool string }{{"v4", "10.0.0.0/24"}, {"v6", "fd00::/120"}} {
				held, _ := s.Holding(p.name)
				for _, req := range s.Spec() {
					if req.Pool == p.name {
						held = held.Subtract(req.Releasing)
					}
				}
				all := addr.MustParseSetString(p.pool)
				held = held.Union(all.Subtract(held).First(rng.IntN(12)))
				ch.Merge(s.SetHolding(p.name, held))
			}
		case op < 6:
			key := ipam.Key{ContainerID: fmt.Sprintf("s%d-%d", seed, i), IfName: "eth0"}
			var err error
			_, ch, err = s.Add(ipam.AddRequest{Key: key, Network: "net", Pod: ipam.PodRef{Namespace: "ns", Name: key.ContainerID, UID: "u" + key.ContainerID}}, now)
			if err != nil {
				continue
			}
			after = func() { s.ConfirmAdd(key) }
		case op < 9:
			atts := s.Attachments()
			if len(atts) == 0 {
				continue
			}
			plan, err := s.PlanDel(atts[rng.IntN(len(atts))].Key, now)
			if err != nil {
				panic(err)
			}
			ch = plan.Change
			after = func() { s.ApplyDel(plan) }
		default:
			ch = s.Release(now).Change
		}
		if ch.IsEmpty() {
			if after != nil {
				after()
			}
			continue
		}
		if err := commit(i, ch); err != nil {
			return
		}
		if after != nil {
			after()
		}
	}
}

// TestCrashChild is the child's body (a subprocess entry point, not a test): a normal test run
// shows it as skipped.
func TestCrashChild(t *testing.T) {
	mode := os.Getenv(envChild)
	if mode == "" {
		t.Skip("the crash tests' child process; runs only when they start it")
	}
	dir := os.Getenv(envDir)
	seed, _ := strconv.ParseUint(os.Getenv(envSeed), 10, 64)
	j, err := Open(dir, Options{Node: "node-a"})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(2)
	}
	switch mode {
	case "seq":
		snap, err := j.Load()
		if err != nil {
			fmt.Println("error", err)
			os.Exit(2)
		}
		fmt.Println("ready")
		ops(restoreState(t, snap), seed, 1<<30, func(i int, ch ipam.Change) error {
			if err := j.Commit(ch); err != nil {
				fmt.Println("error", err)
				os.Exit(2)
			}
			fmt.Printf("ack %d\n", i)
			return nil
		})
	case "concurrent":
		fmt.Println("ready")
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Go(func() {
				for i := 0; ; i++ {
					ch := ipam.Change{PutAttachments: []ipam.Attachment{{Key: windowKey(seed, w, i), Created: t0}}}
					if i >= 3 {
						ch.DeleteAttachments = []ipam.Key{windowKey(seed, w, i-3)}
					}
					if err := j.Commit(ch); err != nil {
						fmt.Println("error", err)
						os.Exit(2)
					}
					fmt.Printf("ack %d %d\n", w, i)
				}
			})
		}
		wg.Wait()
	}
}

func windowKey(seed uint64, w, i int) ipam.Key {
	return ipam.Key{ContainerID: fmt.Sprintf("w%d-%d-%06d", seed, w, i), IfName: "eth0"}
}

// runAndKill starts the child, lets it commit for a random while, kills it with SIGKILL and
// returns the acknowledgement lines it printed.
func runAndKill(t *testing.T, mode, dir string, seed uint64, rng *rand.Rand) []string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envChild+"="+mode, envDir+"="+dir, envSeed+"="+strconv.FormatUint(seed, 10))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1<<16)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var acks []string
	deadline := time.After(30 * time.Second)
	var kill <-chan time.Time
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				_ = cmd.Wait()
				t.Fatalf("child exited before it was killed; last lines %v", tail(acks))
			}
			if strings.HasPrefix(l, "error") {
				t.Fatalf("child: %s", l)
			}
			if l == "ready" {
				kill = time.After(time.Duration(rng.IntN(40_000)) * time.Microsecond)
			}
			if strings.HasPrefix(l, "ack ") {
				acks = append(acks, strings.TrimPrefix(l, "ack "))
			}
			continue
		case <-kill:
		case <-deadline:
			t.Fatal("child never became ready")
		}
		break
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for l := range lines {
		if strings.HasPrefix(l, "ack ") {
			acks = append(acks, strings.TrimPrefix(l, "ack "))
		}
	}
	if err := cmd.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("child was not killed: %v", err)
	}
	return acks
}

func tail(s []string) []string { return s[max(0, len(s)-3):] }

func reopen(t *testing.T, dir string) (ipam.Snapshot, *Journal) {
	t.Helper()
	j := open(t, dir, "node-a")
	if errs := j.Verify(); len(errs) > 0 {
		t.Fatalf("bbolt consistency check after kill -9: %v", errs)
	}
	snap, err := j.Load()
	if err != nil {
		t.Fatalf("load after kill -9: %v", err)
	}
	return snap, j
}

// TestCrashMidWriteSequential kills a child that runs the real state machine against the
// journal, over and over on one file, and checks after each kill that the journal equals the
// state after exactly the acknowledged operations, or after one more.
func TestCrashMidWriteSequential(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 1))
	var start ipam.Snapshot
	totalAcks := 0
	for round := range 12 {
		seed := uint64(round + 1)
		acks := runAndKill(t, "seq", dir, seed, rng)
		got, j := reopen(t, dir)
		restoreState(t, got) // no contradictions
		j.Close()

		acked := -1
		if len(acks) > 0 {
			acked, _ = strconv.Atoi(acks[len(acks)-1])
		}
		totalAcks += len(acks)
		// Replay the same operations on the model from the same start.
		model := start
		var states []string // states[k] = after commits 0..k-1
		states = append(states, canon(t, model))
		var ackedIdx = -1
		errEnough := errors.New("replayed one commit past the acknowledged one")
		ops(restoreState(t, start), seed, 1<<30, func(i int, ch ipam.Change) error {
			if i > acked && len(states) > ackedIdx+1 && ackedIdx >= 0 || (acked < 0 && len(states) > 1) {
				return errEnough
			}
			model = model.Apply(ch)
			states = append(states, canon(t, model))
			if i == acked {
				ackedIdx = len(states) - 1
			}
			return nil
		})
		if acked < 0 {
			ackedIdx = 0
		}
		if ackedIdx < 0 {
			t.Fatalf("round %d: the model never reached the acknowledged operation %d", round, acked)
		}
		g := canon(t, got)
		switch {
		case g == states[ackedIdx]:
		case ackedIdx+1 < len(states) && g == states[ackedIdx+1]:
		default:
			t.Fatalf("round %d: after kill -9 with %d acknowledged commits (last op %d) the journal is\n%s\nwant\n%s",
				round, len(acks), acked, g, states[ackedIdx])
		}
		start = got
	}
	t.Logf("12 kills, %d acknowledged commits checked", totalAcks)
}

// TestCrashMidWriteConcurrent kills a child whose 8 writers commit concurrently (group commit)
// and checks every writer's records: each commit adds one record and deletes an older one, so a
// torn transaction would show as a window of the wrong size.
func TestCrashMidWriteConcurrent(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(2, 2))
	total := 0
	for round := range 8 {
		seed := uint64(100 + round)
		acks := runAndKill(t, "concurrent", dir, seed, rng)
		total += len(acks)
		last := map[int]int{}
		for w := range 8 {
			last[w] = -1
		}
		for _, a := range acks {
			var w, i int
			if _, err := fmt.Sscanf(a, "%d %d", &w, &i); err != nil {
				t.Fatalf("bad ack %q", a)
			}
			last[w] = max(last[w], i)
		}
		got, j := reopen(t, dir)
		j.Close()
		present := map[ipam.Key]bool{}
		for _, a := range got.Attachments {
			present[a.Key] = true
		}
		for w := range 8 {
			ok := false
			for _, top := range []int{last[w], last[w] + 1} {
				want := map[ipam.Key]bool{}
				for i := max(0, top-2); i <= top; i++ {
					want[windowKey(seed, w, i)] = true
				}
				match := true
				for k := range want {
					if !present[k] {
						match = false
					}
				}
				for k := range present {
					if strings.HasPrefix(k.ContainerID, fmt.Sprintf("w%d-%d-", seed, w)) && !want[k] {
						match = false
					}
				}
				if match {
					ok = true
				}
			}
			if !ok {
				t.Fatalf("round %d writer %d: acknowledged up to %d, journal holds %v", round, w, last[w], got.Attachments)
			}
		}
	}
	t.Logf("8 kills, %d acknowledged concurrent commits checked", total)
}
