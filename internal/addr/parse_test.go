package addr

import (
	"strings"
	"testing"
)

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Range
	}{
		{"10.0.0.0/24", rg("10.0.0.0", "10.0.0.255")},
		{"  10.0.0.0/24\t", rg("10.0.0.0", "10.0.0.255")},
		{"10.0.0.5", rg("10.0.0.5", "10.0.0.5")},
		{"10.0.0.5-10.0.0.9", rg("10.0.0.5", "10.0.0.9")},
		{"10.0.0.5 - 10.0.0.9", rg("10.0.0.5", "10.0.0.9")},
		{"10.0.0.5-10.0.0.5", rg("10.0.0.5", "10.0.0.5")},
		{"0.0.0.0/0", rg("0.0.0.0", "255.255.255.255")},
		{"255.255.255.255/32", rg("255.255.255.255", "255.255.255.255")},
		{"::/0", rg("::", max6)},
		{"2001:db8::/64", rg("2001:db8::", "2001:db8::ffff:ffff:ffff:ffff")},
		{"2001:db8::1/128", rg("2001:db8::1", "2001:db8::1")},
		{"2001:db8::1-2001:db8::ff", rg("2001:db8::1", "2001:db8::ff")},
		{"2001:DB8::1", rg("2001:db8::1", "2001:db8::1")},
	} {
		got, err := ParseRange(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseRange(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
	}{
		{"", "empty item"},
		{"   ", "empty item"},
		{"10.0.0.9-10.0.0.1", `range "10.0.0.9-10.0.0.1": first address after last`},
		{"10.0.0.1/24", `prefix "10.0.0.1/24": host bits set, use 10.0.0.0/24`},
		{"2001:db8::1/64", `prefix "2001:db8::1/64": host bits set, use 2001:db8::/64`},
		{"10.0.0.0/33", `prefix "10.0.0.0/33": `},
		{"10.0.0.0/", `prefix "10.0.0.0/": `},
		{"fe80::/64%eth0", `prefix "fe80::/64%eth0"`},
		{"fe80::%eth0/64", `prefix "fe80::%eth0/64"`},
		{"fe80::1%eth0", `address "fe80::1%eth0": zones are not allowed`},
		{"fe80::1%eth0-fe80::2", `range "fe80::1%eth0-fe80::2": address "fe80::1%eth0": zones are not allowed`},
		{"::ffff:1.2.3.4", `address "::ffff:1.2.3.4": IPv4-mapped IPv6 addresses are not allowed, use 1.2.3.4`},
		{"::ffff:1.2.3.0/120", `prefix "::ffff:1.2.3.0/120": IPv4-mapped IPv6 addresses are not allowed`},
		{"::ffff:1.2.3.4-::ffff:1.2.3.5", `IPv4-mapped IPv6 addresses are not allowed`},
		{"10.0.0.1-2001:db8::1", `range "10.0.0.1-2001:db8::1": mixes IPv4 and IPv6`},
		{"10.0.0.1-", `range "10.0.0.1-": address ""`},
		{"-10.0.0.1", `range "-10.0.0.1": address ""`},
		{"10.0.0.1-10.0.0.2-10.0.0.3", `range "10.0.0.1-10.0.0.2-10.0.0.3": address "10.0.0.2-10.0.0.3"`},
		{"foo", `address "foo": unable to parse IP`},
		{"10.0.0.256", `address "10.0.0.256"`},
		{"10.0.0.1,10.0.0.2", `address "10.0.0.1,10.0.0.2"`},
	} {
		_, err := ParseRange(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseRange(%q) error = %v, want %q", tc.in, err, tc.want)
		}
		_, err = ParseSet([]string{"10.0.0.0/8", tc.in})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseSet(..., %q) error = %v, want %q", tc.in, err, tc.want)
		}
	}
}

func TestParseSet(t *testing.T) {
	for _, tc := range []struct {
		in   []string
		want string
	}{
		{nil, ""},
		{[]string{"10.0.0.0/25", "10.0.0.128/25"}, "10.0.0.0/24"},
		{[]string{"10.0.0.5-10.0.0.20", "10.0.0.0/28", "10.0.0.21"}, "10.0.0.0-10.0.0.21"},
		{[]string{"2001:db8::/64", "10.0.0.1", "::"}, "10.0.0.1,::,2001:db8::/64"},
		{[]string{"10.0.0.0/8"}, "10.0.0.0/8"},
		{[]string{"0.0.0.0-255.255.255.255"}, "0.0.0.0/0"},
	} {
		s, err := ParseSet(tc.in)
		if err != nil || s.String() != tc.want {
			t.Errorf("ParseSet(%q) = %q, %v; want %q", tc.in, s, err, tc.want)
		}
		mustCanonical(t, s)
	}
}

func TestParseSetString(t *testing.T) {
	for _, tc := range []struct {
		in, want, err string
	}{
		{"", "", ""},
		{"  ", "", ""},
		{"10.0.0.0/24", "10.0.0.0/24", ""},
		{"10.0.0.0/24, 10.0.1.0/24 ,2001:db8::5-2001:db8::9", "10.0.0.0/23,2001:db8::5-2001:db8::9", ""},
		{"10.0.0.0/24,", "", "empty item"},
		{",10.0.0.0/24", "", "empty item"},
		{"10.0.0.0/24,,10.0.2.0/24", "", "empty item"},
		{"10.0.0.0/24,10.0.0.9-10.0.0.1", "", `range "10.0.0.9-10.0.0.1": first address after last`},
	} {
		s, err := ParseSetString(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseSetString(%q) error = %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || s.String() != tc.want {
			t.Errorf("ParseSetString(%q) = %q, %v; want %q", tc.in, s, err, tc.want)
		}
	}
}

func TestMustParseSetString(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "host bits") {
			t.Fatalf("recover() = %v", r)
		}
	}()
	MustParseSetString("10.0.0.1/8")
}

func TestParseRoundTrip(t *testing.T) {
	for _, in := range []string{
		"",
		"0.0.0.0",
		"0.0.0.0/0",
		"::/0",
		"0.0.0.0/0,::/0",
		"10.0.0.1-10.0.0.6,10.0.0.8,10.0.1.0/24,2001:db8::/64,2001:db8:0:2::-2001:db8:0:2::5",
		"255.255.255.255,::," + max6,
		"1.2.3.4-255.255.255.255,::1-" + max6,
	} {
		s := ms(in)
		back, err := ParseSet(s.Strings())
		if err != nil || !back.Equal(s) {
			t.Errorf("ParseSet(Strings(%q)) = %v, %v", in, back, err)
		}
		back, err = ParseSetString(s.String())
		if err != nil || !back.Equal(s) || s.String() != in {
			t.Errorf("ParseSetString(String(%q)) = %v, %v", in, back, err)
		}
	}
}
