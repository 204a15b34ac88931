// Package policyroute keeps the fwmark rule and local route that keep
// replies of ztunnel-originated inbound connections inside a pod (`ip rule
// fwmark 0x111/0xfff lookup 100`, `local 0.0.0.0/0 dev lo table 100`), over
// a netlink socket opened inside the pod's namespace, and, on the node, the
// ip rules that route kubelet probes of EKS branch ENI pods through their
// veth. Both rules backends use it; entering the namespace, and the
// namespace state the routes depend on, are pkg/netns's.
package policyroute

import (
	"errors"
	"fmt"
	"net"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Parts names parts of a policy route: the ip rule, the local route.
type Parts struct{ Rule, Route bool }

// Any reports whether any part is named.
func (p Parts) Any() bool { return p.Rule || p.Route }

// All names both parts.
var All = Parts{Rule: true, Route: true}

// Conn is the policy-route side of one namespace: a NETLINK_ROUTE socket
// opened inside it, usable from any thread.
type Conn struct {
	h  *netlink.Handle
	lo int
}

// Dial opens a Conn in the network namespace the calling thread is in: run
// it inside netns.Do. lo is that namespace's loopback interface index
// (netns.State.LoopbackIndex), which the local route names. The caller
// closes the Conn.
func Dial(lo int) (*Conn, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	return &Conn{h: h, lo: lo}, nil
}

// Close closes the route socket.
func (c *Conn) Close() {
	if c.h != nil {
		c.h.Close()
		c.h = nil
	}
}

func nlFamily(f ruleset.Family) int {
	if f == ruleset.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// IPRule is the ip rule of p for family f as netlink describes it.
func IPRule(p ruleset.PolicyRoute, f ruleset.Family) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = nlFamily(f)
	r.Table = p.Table
	r.Mark = p.Mark
	mask := p.Mask
	r.Mask = &mask
	r.Priority = p.Priority
	return r
}

func localRoute(p ruleset.PolicyRoute, lo int) *netlink.Route {
	f := ruleset.IPv4
	if p.Local.Addr().Is6() {
		f = ruleset.IPv6
	}
	return &netlink.Route{
		LinkIndex: lo,
		Dst:       &net.IPNet{IP: p.Local.Addr().AsSlice(), Mask: net.CIDRMask(p.Local.Bits(), p.Local.Addr().BitLen())},
		Table:     p.Table,
		Type:      unix.RTN_LOCAL,
		Scope:     netlink.SCOPE_HOST,
		Family:    nlFamily(f),
	}
}

func (c *Conn) findRule(f ruleset.Family, want ruleset.PolicyRoute) (bool, error) {
	rules, err := c.h.RuleList(nlFamily(f))
	if err != nil {
		return false, fmt.Errorf("list %s rules: %w", f, err)
	}
	for _, r := range rules {
		if r.Table == want.Table && r.Mark == want.Mark && r.Mask != nil && *r.Mask == want.Mask &&
			r.Priority == want.Priority && !r.Invert && r.Src == nil && r.Dst == nil {
			return true, nil
		}
	}
	return false, nil
}

func (c *Conn) findRoute(f ruleset.Family, want ruleset.PolicyRoute) (bool, error) {
	routes, err := c.h.RouteListFiltered(nlFamily(f), &netlink.Route{Table: want.Table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return false, fmt.Errorf("list %s routes in table %d: %w", f, want.Table, err)
	}
	for _, r := range routes {
		ones := 0
		if r.Dst != nil {
			ones, _ = r.Dst.Mask.Size()
		}
		if r.Type == unix.RTN_LOCAL && ones == want.Local.Bits() && r.LinkIndex == c.lo {
			return true, nil
		}
	}
	return false, nil
}

// PolicyRouteState reports whether the rule and the route of want exist.
func (c *Conn) PolicyRouteState(f ruleset.Family, want ruleset.PolicyRoute) (rule, route bool, err error) {
	if rule, err = c.findRule(f, want); err != nil {
		return false, false, err
	}
	route, err = c.findRoute(f, want)
	return rule, route, err
}

// EnsurePolicyRoute installs the rule and route if missing and reports what
// it added. On error it has added nothing. Both are added with NLM_F_EXCL,
// so one that exists answers EEXIST: two requests, no listing.
func (c *Conn) EnsurePolicyRoute(f ruleset.Family, want ruleset.PolicyRoute) (Parts, error) {
	var added Parts
	// Route before rule: the rule must never point at an empty table.
	switch err := c.h.RouteAdd(localRoute(want, c.lo)); {
	case err == nil:
		added.Route = true
	case !errors.Is(err, unix.EEXIST):
		return added, fmt.Errorf("add route local %s dev lo table %d: %w", want.Local, want.Table, err)
	}
	switch err := c.h.RuleAdd(IPRule(want, f)); {
	case err == nil:
		added.Rule = true
	case !errors.Is(err, unix.EEXIST):
		err = fmt.Errorf("add %s rule fwmark %#x/%#x lookup %d: %w", f, want.Mark, want.Mask, want.Table, err)
		// Leave nothing behind: the caller treats a failure as no change.
		if added.Route {
			if derr := c.deleteRoute(want); derr != nil {
				err = errors.Join(err, derr)
			}
		}
		return Parts{}, err
	}
	return added, nil
}

// RemovePolicyRoute deletes the named parts if present.
func (c *Conn) RemovePolicyRoute(f ruleset.Family, want ruleset.PolicyRoute, parts Parts) error {
	if parts.Rule {
		rule, err := c.findRule(f, want)
		if err != nil {
			return err
		}
		if rule {
			if err := c.h.RuleDel(IPRule(want, f)); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("delete %s rule fwmark %#x/%#x lookup %d: %w", f, want.Mark, want.Mask, want.Table, err)
			}
		}
	}
	if parts.Route {
		route, err := c.findRoute(f, want)
		if err != nil {
			return err
		}
		if route {
			return c.deleteRoute(want)
		}
	}
	return nil
}

func (c *Conn) deleteRoute(want ruleset.PolicyRoute) error {
	if err := c.h.RouteDel(localRoute(want, c.lo)); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete route local %s dev lo table %d: %w", want.Local, want.Table, err)
	}
	return nil
}

// Drift reports a missing ip rule or route of p in family f.
func Drift(f ruleset.Family, p ruleset.PolicyRoute, rule, route bool) []ruleset.DriftItem {
	var items []ruleset.DriftItem
	if !rule {
		items = append(items, ruleset.DriftItem{Family: f, Kind: ruleset.DriftMissing, Object: "ip rule",
			Want: fmt.Sprintf("pref %d fwmark %#x/%#x lookup %d", p.Priority, p.Mark, p.Mask, p.Table)})
	}
	if !route {
		items = append(items, ruleset.DriftItem{Family: f, Kind: ruleset.DriftMissing, Object: "route",
			Want: fmt.Sprintf("local %s dev lo table %d", p.Local, p.Table)})
	}
	return items
}

// Leftover reports an ip rule or route of p in family f that exists while
// the desired state has none (IPv6's, with IPv6 left alone).
func Leftover(f ruleset.Family, p ruleset.PolicyRoute, rule, route bool) []ruleset.DriftItem {
	var items []ruleset.DriftItem
	if rule {
		items = append(items, ruleset.DriftItem{Family: f, Kind: ruleset.DriftExtra, Object: "ip rule",
			Have: fmt.Sprintf("pref %d fwmark %#x/%#x lookup %d", p.Priority, p.Mark, p.Mask, p.Table)})
	}
	if route {
		items = append(items, ruleset.DriftItem{Family: f, Kind: ruleset.DriftExtra, Object: "route",
			Have: fmt.Sprintf("local %s dev lo table %d", p.Local, p.Table)})
	}
	return items
}
