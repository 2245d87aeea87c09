// Package addr is ipwarden's address arithmetic: ranges, sets and the pool
// allocator, for IPv4 and IPv6 alike, on net/netip value types.
//
// # Representation
//
// A Range is an inclusive [First, Last] interval of one family. A Set is a
// list of such intervals kept in canonical form:
//
//   - IPv4 ranges come first, then IPv6 ranges (an IPv4-mapped IPv6
//     address such as ::ffff:1.2.3.4 is an IPv6 address here);
//   - within a family, ranges are sorted, do not overlap, and are not
//     adjacent: touching ranges are always merged.
//
// So each set has exactly one representation, Equal is a slice comparison,
// and the size of a Set depends on how fragmented it is, never on how many
// addresses it holds: a /8 or a /64 is a single range. Internally each
// range is a pair of unsigned 128-bit integers (an IPv4 address uses the
// low 32 bits), so set algebra never parses or formats text. Set
// operations are linear merges that gallop over long runs, so combining a
// large set with a small one costs O(small·log(large)) comparisons plus a
// bulk copy.
//
// Sets are immutable values: operations return new Sets, which may share
// storage with their inputs, and nothing ever writes to a Set after it is
// built. Zones are not part of addresses here: constructors drop or reject
// them and lookups ignore them.
//
// Counts of addresses use Count, an unsigned 128-bit integer whose
// arithmetic saturates; the one size it cannot hold, 2^128 for the whole
// IPv6 space, is reported as MaxCount.
//
// # Text form
//
// Set.Strings writes one item per canonical range: a CIDR prefix when the
// range is exactly one ("10.0.0.0/28"), a bare address for a single
// address, and "first-last" otherwise. ParseSet accepts those three forms
// in any mix, order and overlap, and rejects zones, IPv4-mapped IPv6,
// mixed-family or reversed ranges, and prefixes with host bits set.
// ParseSet(s.Strings()) equals s for every set that ParseSet can produce
// (that is, without IPv4-mapped IPv6 addresses).
//
// # Allocation
//
// Allocator hands out addresses from a pool Set as a pure state machine
// (time is an argument). Its state is four Sets (pool, allocated, cooling
// and the derived free set) plus a FIFO of (Set, freed-at) batches waiting
// out the cooldown; there is no per-address structure. See Allocate for
// the placement policy, which keeps each holder's addresses in few,
// aligned CIDR blocks.
package addr
