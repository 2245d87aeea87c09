package addr_test

import (
	"fmt"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

func ExampleParseSetString() {
	s, err := addr.ParseSetString("10.0.0.0/25, 10.0.0.128/25, 10.0.1.5-10.0.1.9, 2001:db8::/64")
	if err != nil {
		panic(err)
	}
	fmt.Println(s)
	fmt.Println(s.NumRanges(), "ranges,", s.Size(), "addresses")
	_, err = addr.ParseSetString("10.0.0.1/24")
	fmt.Println(err)
	// Output:
	// 10.0.0.0/24,10.0.1.5-10.0.1.9,2001:db8::/64
	// 3 ranges, 18446744073709551877 addresses
	// prefix "10.0.0.1/24": host bits set, use 10.0.0.0/24
}

func ExampleAllocator() {
	pool := addr.MustParseSetString("10.0.0.0/24")
	a := addr.NewAllocator(pool, time.Minute)
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

	node, _ := a.Allocate(16, addr.Set{}, now)
	fmt.Println("node gets", node)
	more, _ := a.Allocate(16, node, now)
	node = node.Union(more)
	fmt.Println("node grows to", node)

	_ = a.Free(more, now)
	fmt.Println("available now:", a.Available(now), "cooling:", a.Cooling())
	fmt.Println("available after cooldown:", a.Available(now.Add(time.Minute)))
	// Output:
	// node gets 10.0.0.0/28
	// node grows to 10.0.0.0/27
	// available now: 224 cooling: 10.0.0.16/28
	// available after cooldown: 240
}
