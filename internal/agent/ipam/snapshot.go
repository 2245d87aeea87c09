package ipam

import (
	"cmp"
	"slices"
)

// Apply returns snap with ch applied, deletes before puts, in canonical order. It is the
// reference meaning of a Change: the journal must load exactly Apply of what it committed.
func (snap Snapshot) Apply(ch Change) Snapshot {
	atts := map[Key]Attachment{}
	for _, a := range snap.Attachments {
		atts[a.Key] = a
	}
	cool := map[Address]Cooling{}
	for _, c := range snap.Cooling {
		cool[Address{c.Pool, c.Addr}] = c
	}
	rel := map[Address]Releasing{}
	for _, r := range snap.Releasing {
		rel[Address{r.Pool, r.Addr}] = r
	}
	hold := map[string]Holding{}
	for _, h := range snap.Holdings {
		hold[h.Pool] = h
	}
	pools := map[string]Pool{}
	for _, p := range snap.Pools {
		pools[p.Name] = p
	}
	for _, k := range ch.DeleteAttachments {
		delete(atts, k)
	}
	for _, a := range ch.PutAttachments {
		atts[a.Key] = a
	}
	for _, a := range ch.DeleteCooling {
		delete(cool, a)
	}
	for _, c := range ch.PutCooling {
		cool[Address{c.Pool, c.Addr}] = c
	}
	for _, a := range ch.DeleteReleasing {
		delete(rel, a)
	}
	for _, r := range ch.PutReleasing {
		rel[Address{r.Pool, r.Addr}] = r
	}
	for _, p := range ch.DeleteHoldings {
		delete(hold, p)
	}
	for _, h := range ch.PutHoldings {
		hold[h.Pool] = h
	}
	ahead := map[Address]bool{}
	for _, a := range snap.Ahead {
		ahead[a] = true
	}
	for _, a := range ch.DeleteAhead {
		delete(ahead, a)
	}
	for _, a := range ch.PutAhead {
		ahead[a] = true
	}
	for _, p := range ch.DeletePools {
		delete(pools, p)
	}
	for _, p := range ch.PutPools {
		pools[p.Name] = p
	}
	out := Snapshot{Mark: snap.Mark, ConfigPools: snap.ConfigPools}
	if ch.PutMark != nil {
		out.Mark = *ch.PutMark
	}
	if ch.PutConfigPools != nil {
		out.ConfigPools = slices.Clone(*ch.PutConfigPools)
	}
	out.Handback = snap.Handback
	if ch.ClearHandback {
		out.Handback = nil
	}
	if ch.PutHandback != nil {
		m := *ch.PutHandback
		out.Handback = &m
	}
	for _, a := range atts {
		out.Attachments = append(out.Attachments, a)
	}
	for _, c := range cool {
		out.Cooling = append(out.Cooling, c)
	}
	for _, r := range rel {
		out.Releasing = append(out.Releasing, r)
	}
	for _, h := range hold {
		out.Holdings = append(out.Holdings, h)
	}
	for _, p := range pools {
		out.Pools = append(out.Pools, p)
	}
	for a := range ahead {
		out.Ahead = append(out.Ahead, a)
	}
	out.Sort()
	return out
}

// Sort puts the records of snap in canonical order: attachments by key, addresses by pool and
// address, holdings and pools by name.
func (snap *Snapshot) Sort() {
	slices.SortFunc(snap.Attachments, func(a, b Attachment) int {
		return cmp.Or(cmp.Compare(a.Key.ContainerID, b.Key.ContainerID), cmp.Compare(a.Key.IfName, b.Key.IfName))
	})
	slices.SortFunc(snap.Cooling, func(a, b Cooling) int { return cmp.Or(cmp.Compare(a.Pool, b.Pool), a.Addr.Compare(b.Addr)) })
	slices.SortFunc(snap.Releasing, func(a, b Releasing) int { return cmp.Or(cmp.Compare(a.Pool, b.Pool), a.Addr.Compare(b.Addr)) })
	slices.SortFunc(snap.Holdings, func(a, b Holding) int { return cmp.Compare(a.Pool, b.Pool) })
	slices.SortFunc(snap.Pools, func(a, b Pool) int { return cmp.Compare(a.Name, b.Name) })
	sortAddresses(snap.Ahead)
}
