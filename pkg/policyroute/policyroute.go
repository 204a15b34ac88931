// Package policyroute keeps the fwmark rule and local route that keep
// replies of ztunnel-originated inbound connections inside a pod (`ip rule
// fwmark 0x111/0xfff lookup 100`, `local 0.0.0.0/0 dev lo table 100`), and
// reads the namespace state they depend on (lo up, IPv6 on lo), through
// netlink and sysctl inside the pod's namespace. Both rules backends use it.
package policyroute

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Router reads and changes a namespace's policy route and the state it
// depends on; Netlink is the real one, tests of control flow use fakes.
type Router interface {
	// State reports the namespace's loopback and IPv6 state.
	State(netnsPath string) (NetnsState, error)
	// PolicyRouteState reports whether the fwmark rule and the local route
	// of want exist.
	PolicyRouteState(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (rule, route bool, err error)
	// EnsurePolicyRoute installs the rule and route if missing and reports
	// what it added. On error it has added nothing.
	EnsurePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (Parts, error)
	// RemovePolicyRoute deletes the named parts if present.
	RemovePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute, parts Parts) error
}

// NetnsState is what a network namespace offers the capture rules.
type NetnsState struct {
	// LoopbackUp: lo is up. Redirected traffic reaches ztunnel over lo,
	// so without it capture cannot work and Apply refuses, changing
	// nothing.
	LoopbackUp bool
	// IPv6: the kernel has IPv6 and the namespace does not turn it off
	// everywhere (net.ipv6.conf.all, or some interface other than lo, has
	// disable_ipv6 = 0). IPv6 capture rules are needed.
	IPv6 bool
	// IPv6Loopback: lo has IPv6 (net.ipv6.conf.lo.disable_ipv6 = 0), so the
	// IPv6 local route can exist; without it the kernel refuses the route
	// ("IPv6 is disabled on nexthop device") and, as Istio does, we skip
	// the IPv6 policy route. Redirected IPv6 then fails closed (it cannot
	// reach ztunnel over lo) instead of leaving uncaptured.
	IPv6Loopback bool
}

// Parts names parts of a policy route: the ip rule, the local route.
type Parts struct{ Rule, Route bool }

// Any reports whether any part is named.
func (p Parts) Any() bool { return p.Rule || p.Route }

// All names both parts.
var All = Parts{Rule: true, Route: true}

// Netlink implements Router: routes and rules through netlink sockets
// opened inside the target namespace; State reads the namespace's sysctls
// and links from a thread that enters it for the read.
type Netlink struct{}

// handle opens a netlink handle in the namespace ("" = current).
func handle(netnsPath string) (*netlink.Handle, error) {
	if netnsPath == "" {
		return netlink.NewHandle()
	}
	nsh, err := netns.GetFromPath(netnsPath)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", netnsPath, err)
	}
	defer nsh.Close()
	h, err := netlink.NewHandleAt(nsh)
	if err != nil {
		return nil, fmt.Errorf("netlink in netns %s: %w", netnsPath, err)
	}
	return h, nil
}

// State implements Router. net sysctls and links resolve against the
// reading thread's namespace, so both are read from inside it.
func (Netlink) State(netnsPath string) (NetnsState, error) {
	var st NetnsState
	read := func() error {
		lo, err := net.InterfaceByName("lo")
		if err != nil {
			return fmt.Errorf("find lo: %w", err)
		}
		st.LoopbackUp = lo.Flags&net.FlagUp != 0
		const dir = "/proc/sys/net/ipv6/conf"
		entries, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			return nil // kernel without IPv6
		}
		if err != nil {
			return err
		}
		for _, e := range entries {
			name := e.Name()
			if name == "default" {
				continue // the template for interfaces yet to come
			}
			b, err := os.ReadFile(dir + "/" + name + "/disable_ipv6")
			if errors.Is(err, os.ErrNotExist) {
				continue // interface gone meanwhile
			}
			if err != nil {
				return err
			}
			on := strings.TrimSpace(string(b)) == "0"
			if name == "lo" {
				st.IPv6Loopback = on
			} else if on {
				st.IPv6 = true
			}
		}
		return nil
	}
	var err error
	if netnsPath == "" {
		err = read()
	} else {
		err = ns.WithNetNSPath(netnsPath, func(ns.NetNS) error { return read() })
	}
	if err != nil {
		return NetnsState{}, fmt.Errorf("read state of netns %s: %w", netnsPath, err)
	}
	return st, nil
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
	return &netlink.Route{
		LinkIndex: lo,
		Dst:       &net.IPNet{IP: p.Local.Addr().AsSlice(), Mask: net.CIDRMask(p.Local.Bits(), p.Local.Addr().BitLen())},
		Table:     p.Table,
		Type:      unix.RTN_LOCAL,
		Scope:     netlink.SCOPE_HOST,
		Family:    nlFamily(familyOf(p)),
	}
}

func familyOf(p ruleset.PolicyRoute) ruleset.Family {
	if p.Local.Addr().Is6() {
		return ruleset.IPv6
	}
	return ruleset.IPv4
}

func findRule(h *netlink.Handle, f ruleset.Family, want ruleset.PolicyRoute) (bool, error) {
	rules, err := h.RuleList(nlFamily(f))
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

func findRoute(h *netlink.Handle, f ruleset.Family, want ruleset.PolicyRoute) (bool, int, error) {
	lo, err := h.LinkByName("lo")
	if err != nil {
		return false, 0, fmt.Errorf("find lo: %w", err)
	}
	routes, err := h.RouteListFiltered(nlFamily(f), &netlink.Route{Table: want.Table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return false, 0, fmt.Errorf("list %s routes in table %d: %w", f, want.Table, err)
	}
	for _, r := range routes {
		ones := 0
		if r.Dst != nil {
			ones, _ = r.Dst.Mask.Size()
		}
		if r.Type == unix.RTN_LOCAL && ones == want.Local.Bits() && r.LinkIndex == lo.Attrs().Index {
			return true, lo.Attrs().Index, nil
		}
	}
	return false, lo.Attrs().Index, nil
}

// PolicyRouteState implements Router.
func (Netlink) PolicyRouteState(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (bool, bool, error) {
	h, err := handle(netnsPath)
	if err != nil {
		return false, false, err
	}
	defer h.Close()
	rule, err := findRule(h, f, want)
	if err != nil {
		return false, false, err
	}
	route, _, err := findRoute(h, f, want)
	return rule, route, err
}

// EnsurePolicyRoute implements Router.
func (Netlink) EnsurePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (Parts, error) {
	h, err := handle(netnsPath)
	if err != nil {
		return Parts{}, err
	}
	defer h.Close()
	var added Parts
	route, lo, err := findRoute(h, f, want)
	if err != nil {
		return added, err
	}
	// Route before rule: the rule must never point at an empty table.
	if !route {
		if err := h.RouteAdd(localRoute(want, lo)); err != nil && !errors.Is(err, unix.EEXIST) {
			return added, fmt.Errorf("add route local %s dev lo table %d: %w", want.Local, want.Table, err)
		} else if err == nil {
			added.Route = true
		}
	}
	rule, err := findRule(h, f, want)
	if err == nil && !rule {
		if err = h.RuleAdd(IPRule(want, f)); err != nil && !errors.Is(err, unix.EEXIST) {
			err = fmt.Errorf("add %s rule fwmark %#x/%#x lookup %d: %w", f, want.Mark, want.Mask, want.Table, err)
		} else {
			added.Rule, err = err == nil, nil
		}
	}
	if err != nil {
		// Leave nothing behind: the caller treats a failure as no change.
		if added.Route {
			if derr := deleteRoute(h, want, lo); derr != nil {
				err = errors.Join(err, derr)
			}
		}
		return Parts{}, err
	}
	return added, nil
}

// RemovePolicyRoute implements Router.
func (Netlink) RemovePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute, parts Parts) error {
	h, err := handle(netnsPath)
	if err != nil {
		return err
	}
	defer h.Close()
	if parts.Rule {
		rule, err := findRule(h, f, want)
		if err != nil {
			return err
		}
		if rule {
			if err := h.RuleDel(IPRule(want, f)); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("delete %s rule fwmark %#x/%#x lookup %d: %w", f, want.Mark, want.Mask, want.Table, err)
			}
		}
	}
	if parts.Route {
		route, lo, err := findRoute(h, f, want)
		if err != nil {
			return err
		}
		if route {
			return deleteRoute(h, want, lo)
		}
	}
	return nil
}

func deleteRoute(h *netlink.Handle, want ruleset.PolicyRoute, lo int) error {
	if err := h.RouteDel(localRoute(want, lo)); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
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
