package addr

import (
	"strings"
	"testing"
)

func FuzzParseSet(f *testing.F) {
	for _, s := range []string{
		"10.0.0.0/24",
		"10.0.0.0/24, 10.0.1.0/24",
		"10.0.0.5-10.0.0.9,2001:db8::/64",
		"0.0.0.0/0,::/0",
		"255.255.255.255,::,ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
		"10.0.0.9-10.0.0.1",
		"10.0.0.1/24",
		"fe80::1%eth0",
		"::ffff:1.2.3.4",
		"1.2.3.4-::1",
		",",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		s, err := ParseSetString(in)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error message")
			}
			return
		}
		if err := checkCanonical(s); err != nil {
			t.Fatalf("ParseSetString(%q) = %q not canonical: %v", in, s, err)
		}
		items := s.Strings()
		back, err := ParseSet(items)
		if err != nil || !back.Equal(s) {
			t.Fatalf("ParseSet(%q) = %q, %v; want %q", items, back, err, s)
		}
		if again, err := ParseSetString(s.String()); err != nil || !again.Equal(s) || again.String() != s.String() {
			t.Fatalf("String round trip of %q: %q, %v", s, again, err)
		}
		// Every input item lies in the set; the canonical items are
		// disjoint and sum to the size.
		if strings.TrimSpace(in) != "" {
			for _, item := range strings.Split(in, ",") {
				r, err := ParseRange(item)
				if err != nil || !s.ContainsRange(r) {
					t.Fatalf("item %q: %v, contained %v", item, err, s.ContainsRange(r))
				}
			}
		}
		var total Count
		for _, item := range items {
			r, err := ParseRange(item)
			if err != nil || r.String() != item {
				t.Fatalf("canonical item %q: %v / %q", item, err, r.String())
			}
			total = total.Add(r.Size())
		}
		if total != s.Size() {
			t.Fatalf("size %v != sum of items %v", s.Size(), total)
		}
	})
}

func FuzzSetOps(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{2, 0, 10, 5, 3, 100, 20, 2, 0, 12, 9, 3, 90, 31})
	f.Add([]byte{3, 0x80, 8, 0x83, 0, 1, 4, 4, 0, 4, 255, 0})
	f.Add([]byte{2, 0x80, 0, 0x84, 0, 1, 0x80, 32})
	f.Add([]byte{4, 6, 120, 10, 0x46, 0, 255, 2, 0, 3, 0x45, 250, 9, 2, 6, 127, 2, 5, 255, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &byteReader{b: data}
		a, ra, bigA := decodeSet(r, true)
		b, rb, bigB := decodeSet(r, true)
		checkSetOps(t, a, b, ra, rb, !bigA && !bigB)
	})
}

func FuzzAllocator(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{1, 0x40, 0, 255, 1, 0, 16, 0, 16, 0, 2, 0, 4, 4, 30, 5, 0, 0, 8, 0, 5, 1, 4, 39, 0, 3})
	f.Add([]byte{2, 3, 0, 40, 5, 0, 200, 1, 2, 0, 5, 1, 2, 0, 7, 6, 1, 0, 10, 5, 7, 1, 3, 0, 8, 2, 0, 3, 4, 20, 5, 0, 0, 24})
	f.Add([]byte{1, 0x42, 192, 255, 0, 0, 4, 1, 0, 4, 0, 2, 0, 2, 1, 3, 6, 0, 2, 0, 4, 39, 4, 39, 5, 0, 0, 23})
	f.Fuzz(func(t *testing.T, data []byte) {
		runAllocScript(t, data)
	})
}
