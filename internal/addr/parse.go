package addr

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// ParseRange parses one set item: a CIDR prefix ("10.0.0.0/24"), a single
// address ("10.0.0.5", "2001:db8::1"), or an inclusive range
// ("10.0.0.5-10.0.0.9"). Surrounding whitespace is trimmed. It rejects
// zones, IPv4-mapped IPv6 addresses (::ffff:1.2.3.4), ranges that mix
// families or run backwards, and prefixes with host bits set
// ("10.0.0.1/24"; the error suggests 10.0.0.0/24).
func ParseRange(item string) (Range, error) {
	s := strings.TrimSpace(item)
	if s == "" {
		return Range{}, errors.New("empty item")
	}
	if strings.IndexByte(s, '/') >= 0 {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return Range{}, fmt.Errorf("prefix %q: %s", s, reason(err, "netip.ParsePrefix", s))
		}
		if p.Addr().Is4In6() {
			return Range{}, fmt.Errorf("prefix %q: IPv4-mapped IPv6 addresses are not allowed", s)
		}
		if m := p.Masked(); m != p {
			return Range{}, fmt.Errorf("prefix %q: host bits set, use %s", s, m)
		}
		return PrefixRange(p), nil
	}
	if i := strings.IndexByte(s, '-'); i >= 0 {
		fs, ls := strings.TrimSpace(s[:i]), strings.TrimSpace(s[i+1:])
		first, err := parseAddr(fs)
		if err != nil {
			return Range{}, fmt.Errorf("range %q: address %q: %v", s, fs, err)
		}
		last, err := parseAddr(ls)
		if err != nil {
			return Range{}, fmt.Errorf("range %q: address %q: %v", s, ls, err)
		}
		if first.Is4() != last.Is4() {
			return Range{}, fmt.Errorf("range %q: mixes IPv4 and IPv6", s)
		}
		if last.Less(first) {
			return Range{}, fmt.Errorf("range %q: first address after last", s)
		}
		return Range{first, last}, nil
	}
	a, err := parseAddr(s)
	if err != nil {
		return Range{}, fmt.Errorf("address %q: %v", s, err)
	}
	return Range{a, a}, nil
}

// parseAddr parses a single address, rejecting zones and IPv4-mapped IPv6.
func parseAddr(s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}, errors.New(reason(err, "ParseAddr", s))
	}
	if a.Zone() != "" {
		return netip.Addr{}, errors.New("zones are not allowed")
	}
	if a.Is4In6() {
		return netip.Addr{}, fmt.Errorf("IPv4-mapped IPv6 addresses are not allowed, use %s", a.Unmap())
	}
	return a, nil
}

// reason strips the "fn("input"): " prefix from a net/netip parse error, as
// the callers name the input themselves.
func reason(err error, fn, in string) string {
	msg := err.Error()
	if p := fn + "(" + strconv.Quote(in) + "): "; strings.HasPrefix(msg, p) && len(msg) > len(p) {
		return msg[len(p):]
	}
	return msg
}

// ParseSet parses items, each accepted by ParseRange, into a Set. Items may
// overlap and come in any order. The error names the first bad item, as in
// `range "10.0.0.9-10.0.0.1": first address after last`.
func ParseSet(items []string) (Set, error) {
	var v4, v6 []rng
	for _, item := range items {
		r, err := ParseRange(item)
		if err != nil {
			return Set{}, err
		}
		g, is4, _ := r.toRng()
		if is4 {
			v4 = append(v4, g)
		} else {
			v6 = append(v6, g)
		}
	}
	return fromUnsorted(v4, v6), nil
}

// ParseSetString parses the comma-separated form of ParseSet, as produced by
// Set.String. An empty or all-blank string is the empty set; an empty item
// between commas is an error.
func ParseSetString(s string) (Set, error) {
	if strings.TrimSpace(s) == "" {
		return Set{}, nil
	}
	return ParseSet(strings.Split(s, ","))
}

// MustParseSetString is like ParseSetString but panics on error. It is
// meant for constants and tests.
func MustParseSetString(s string) Set {
	set, err := ParseSetString(s)
	if err != nil {
		panic("addr: " + err.Error())
	}
	return set
}
