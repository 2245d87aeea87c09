package scaling

import (
	"fmt"
	"math"
	"testing"
)

func TestTarget(t *testing.T) {
	d := DefaultParams
	for _, tc := range []struct {
		name      string
		demand    int
		p         Params
		exhausted bool
		want      int
	}{
		{"worked example: batch 16, buffer 0.5, demand 25", 25, Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}, false, 48},
		{"empty node keeps half a batch spare, rounded up to a batch", 0, d, false, 16},
		{"no buffer and no demand holds nothing", 0, Params{BatchSize: 16, BufferPercent: 0, MaxPerNode: 250}, false, 0},
		{"no buffer, demand exactly a batch", 16, Params{BatchSize: 16, BufferPercent: 0, MaxPerNode: 250}, false, 16},
		{"no buffer, one over a batch", 17, Params{BatchSize: 16, BufferPercent: 0, MaxPerNode: 250}, false, 32},
		{"buffer boundary: 8 used + 8 spare fits one batch", 8, d, false, 16},
		{"buffer boundary: 9 used needs a second batch", 9, d, false, 32},
		{"full buffer always adds a batch", 16, Params{BatchSize: 16, BufferPercent: 100, MaxPerNode: 250}, false, 32},
		{"full buffer, demand 0", 0, Params{BatchSize: 16, BufferPercent: 100, MaxPerNode: 250}, false, 16},
		{"batch 1", 5, Params{BatchSize: 1, BufferPercent: 50, MaxPerNode: 250}, false, 6},
		{"demand beyond max clamps to max", 400, d, false, 250},
		{"target beyond max clamps to max even below demand", 245, d, false, 250},
		{"max equal to batch", 3, Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 16}, false, 16},
		{"exhausted: demand, no spare", 25, d, true, 25},
		{"exhausted: an empty node holds nothing", 0, d, true, 0},
		{"exhausted still clamps at max", 300, d, true, 250},
		{"negative demand counts as zero", -5, d, false, 16},
		{"large batch", 1000, Params{BatchSize: 1024, BufferPercent: 25, MaxPerNode: 65536}, false, 2048},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Target(tc.demand, tc.p, tc.exhausted); got != tc.want {
				t.Fatalf("Target(%d, %+v, exhausted=%v) = %d, want %d", tc.demand, tc.p, tc.exhausted, got, tc.want)
			}
		})
	}
}

// TestTargetMatchesFormula checks the integer arithmetic against the formula in floating point
// over a grid of inputs where floats are exact enough, and the economy bounds of docs/design.md.
func TestTargetMatchesFormula(t *testing.T) {
	for _, batch := range []int{1, 2, 3, 7, 16, 32, 100} {
		for _, pct := range []int{0, 1, 25, 33, 50, 99, 100} {
			for _, maxN := range []int{batch, 2 * batch, 250} {
				if maxN < batch {
					continue
				}
				p := Params{BatchSize: batch, BufferPercent: pct, MaxPerNode: maxN}
				for demand := 0; demand <= 300; demand++ {
					got := Target(demand, p, false)
					want := float64(batch) * math.Ceil(float64(pct)/100+float64(demand)/float64(batch))
					if want > float64(maxN) {
						want = float64(maxN)
					}
					if float64(got) != want {
						t.Fatalf("Target(%d, %+v) = %d, formula gives %v", demand, p, got, want)
					}
					if got%batch != 0 && got != maxN {
						t.Fatalf("Target(%d, %+v) = %d is not a whole number of batches", demand, p, got)
					}
					// Address economy: at most demand + batch*(buffer+1).
					if bound := float64(demand) + float64(batch)*(float64(pct)/100+1); float64(got) > bound {
						t.Fatalf("Target(%d, %+v) = %d exceeds economy bound %v", demand, p, got, bound)
					}
					if got < min(demand, maxN) {
						t.Fatalf("Target(%d, %+v) = %d does not cover demand", demand, p, got)
					}
					ex := Target(demand, p, true)
					if ex != min(demand, maxN) {
						t.Fatalf("exhausted Target(%d, %+v) = %d, want demand clamped", demand, p, ex)
					}
				}
			}
		}
	}
}

func TestParamsValidate(t *testing.T) {
	for _, tc := range []struct {
		p    Params
		want string
	}{
		{DefaultParams, ""},
		{Params{BatchSize: 1, BufferPercent: 0, MaxPerNode: 1}, ""},
		{Params{BatchSize: 0, BufferPercent: 50, MaxPerNode: 250}, "batchSize 0: must be at least 1"},
		{Params{BatchSize: 16, BufferPercent: -1, MaxPerNode: 250}, "bufferPercent -1: must be between 0 and 100"},
		{Params{BatchSize: 16, BufferPercent: 101, MaxPerNode: 250}, "bufferPercent 101: must be between 0 and 100"},
		{Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 15}, "maxPerNode 15: must be at least batchSize 16"},
	} {
		t.Run(fmt.Sprint(tc.p), func(t *testing.T) {
			err := tc.p.Validate()
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tc.want {
				t.Fatalf("Validate() = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestDemand(t *testing.T) {
	for _, tc := range []struct{ inUse, pending, want int }{
		{0, 0, 0}, {10, 0, 10}, {10, 5, 15}, {-1, 3, 3},
	} {
		if got := Demand(tc.inUse, tc.pending); got != tc.want {
			t.Errorf("Demand(%d, %d) = %d, want %d", tc.inUse, tc.pending, got, tc.want)
		}
	}
}

func BenchmarkTarget(b *testing.B) {
	for i := 0; b.Loop(); i++ {
		_ = Target(i%300, DefaultParams, i%7 == 0)
	}
}
