package controller

// Need is how urgently a node needs a sync; the scheduler serves the greatest need first.
type Need struct {
	// Claims is the number of claimed addresses the node's status lacks: its pods use them.
	// Claims are served before anything else.
	Claims int
	// Deficit is the number of addresses the node requested but does not hold (summed over
	// pools). Nodes in deficit have pods waiting: they come first, largest first.
	Deficit int
	// Surplus is what the node holds beyond its request, released or not: taking back released
	// addresses refills the pool for nodes in deficit, largest first.
	Surplus int
}

// NeedOf sums the need of a node's pool plans.
func NeedOf(plans map[string]PoolPlan) Need {
	var n Need
	for _, p := range plans {
		n.Deficit += p.Add
		n.Surplus += count(p.Remove) + p.Excess
	}
	return n
}

// MoreUrgent orders needs: claims first, then any deficit before none, larger deficit first, then larger surplus.
func MoreUrgent(a, b Need) bool {
	if a.Claims != b.Claims {
		return a.Claims > b.Claims
	}
	if a.Deficit != b.Deficit {
		return a.Deficit > b.Deficit
	}
	return a.Surplus > b.Surplus
}
