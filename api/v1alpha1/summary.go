package v1alpha1

import (
	"sort"
	"strconv"
	"strings"
)

// Summarize renders what a node holds against what it requests, one "pool held/requested" per
// pool in name order, for the Held/Requested column of kubectl get. The controller stores it in
// status.summary whenever it writes the status.
func Summarize(spec NodeIPAllocationSpec, status NodeIPAllocationStatus) string {
	type row struct{ held, requested int32 }
	rows := map[string]*row{}
	get := func(pool string) *row {
		r, ok := rows[pool]
		if !ok {
			r = &row{}
			rows[pool] = r
		}
		return r
	}
	for _, p := range spec.Pools {
		get(p.Pool).requested = p.Requested
	}
	for _, p := range status.Pools {
		get(p.Pool).held = p.Held
	}
	names := make([]string, 0, len(rows))
	for n := range rows {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for i, n := range names {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(n)
		b.WriteByte(' ')
		b.WriteString(strconv.Itoa(int(rows[n].held)))
		b.WriteByte('/')
		b.WriteString(strconv.Itoa(int(rows[n].requested)))
	}
	return b.String()
}
