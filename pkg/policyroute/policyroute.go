// Package policyroute keeps the fwmark rule and local route that keep
// replies of ztunnel-originated inbound connections inside a pod (`ip rule
// fwmark 0x111/0xfff lookup 100`, `local 0.0.0.0/0 dev lo table 100`), and
// reads the namespace state they depend on (lo up, IPv6 on lo), through
// netlink and sysctl inside the pod's namespace. Both rules backends use it.
package policyroute

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
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
	// XTables lists the x_tables (iptables-legacy) tables registered in
	// the namespace; x_tables registers one on first use, so a namespace
	// legacy iptables never touched has none.
	XTables []string
}

// Parts names parts of a policy route: the ip rule, the local route.
type Parts struct{ Rule, Route bool }

// Any reports whether any part is named.
func (p Parts) Any() bool { return p.Rule || p.Route }

// All names both parts.
var All = Parts{Rule: true, Route: true}

// Conn is the policy-route side of one namespace: a NETLINK_ROUTE socket
// opened inside it, usable from any thread, and the namespace's state read
// at the same time. Open enters the namespace once; everything after runs
// on the socket.
type Conn struct {
	h     *netlink.Handle
	lo    int
	State NetnsState
}

// Open enters the namespace at netnsPath ("" = the caller's) once: reads
// its state, opens the route socket, and runs also (if not nil) there, so
// a caller can open its own sockets in the same switch. The caller closes
// the Conn.
func Open(netnsPath string, also func() error) (*Conn, error) {
	c := &Conn{}
	inside := func() error {
		var err error
		if c.State, err = readSysctls(); err != nil {
			return err
		}
		if c.h, err = netlink.NewHandle(unix.NETLINK_ROUTE); err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		if also != nil {
			return also()
		}
		return nil
	}
	var err error
	if netnsPath == "" {
		err = inside()
	} else {
		err = ns.WithNetNSPath(netnsPath, func(ns.NetNS) error { return inside() })
	}
	if err == nil {
		var lo netlink.Link
		if lo, err = c.h.LinkByName("lo"); err == nil {
			c.lo = lo.Attrs().Index
			c.State.LoopbackUp = lo.Attrs().Flags&net.FlagUp != 0
		} else {
			err = fmt.Errorf("find lo: %w", err)
		}
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("netns %s: %w", netnsPath, err)
	}
	return c, nil
}

// Close closes the route socket.
func (c *Conn) Close() {
	if c.h != nil {
		c.h.Close()
		c.h = nil
	}
}

// readSysctls reads the IPv6 and x_tables state of the calling thread's
// namespace: x_tables from /proc/thread-self/net (which resolves against
// it), IPv6 per interface over netlink. Not from /proc/sys when it can be
// helped: every namespace has the same net/ipv6/conf/<name> entries, so
// each lookup there walks a dentry chain as long as the node has
// namespaces, and the cost of a capture would grow with the pods on the
// node.
func readSysctls() (NetnsState, error) {
	var st NetnsState
	for _, p := range []string{"/proc/thread-self/net/ip_tables_names", "/proc/thread-self/net/ip6_tables_names"} {
		b, err := os.ReadFile(p)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return st, err
		}
		st.XTables = append(st.XTables, strings.Fields(string(b))...)
	}
	on, err := ipv6Links()
	if err != nil {
		return st, err
	}
	for name, enabled := range on {
		if name == "lo" {
			st.IPv6Loopback = enabled
		} else if enabled {
			st.IPv6 = true
		}
	}
	if !st.IPv6 && on != nil {
		// No interface besides lo has it (rare in a pod: a namespace with
		// only lo, or one that turned IPv6 off per interface): what counts
		// then is net.ipv6.conf.all, one sysctl lookup.
		b, err := os.ReadFile("/proc/sys/net/ipv6/conf/all/disable_ipv6")
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return st, err
		}
		st.IPv6 = err == nil && strings.TrimSpace(string(b)) == "0"
	}
	return st, nil
}

// native is the host's byte order, that of netlink attribute values.
var native = binary.NativeEndian

// devconfDisableIPv6 is DEVCONF_DISABLE_IPV6 (linux/ipv6.h): the index of
// disable_ipv6 in the s32 values of IFLA_INET6_CONF.
const devconfDisableIPv6 = 26

// ipv6Links reports, per interface of the calling thread's namespace,
// whether IPv6 is on (disable_ipv6 = 0), from one RTM_GETLINK dump of the
// AF_INET6 family. A kernel without IPv6 has no interface in it.
func ipv6Links() (map[string]bool, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETLINK, unix.NLM_F_DUMP)
	req.AddData(nl.NewIfInfomsg(unix.AF_INET6))
	msgs, err := req.Execute(unix.NETLINK_ROUTE, unix.RTM_NEWLINK)
	if errors.Is(err, unix.EAFNOSUPPORT) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("dump IPv6 links: %w", err)
	}
	out := map[string]bool{}
	for _, m := range msgs {
		if len(m) < unix.SizeofIfInfomsg {
			continue
		}
		attrs, err := nl.ParseRouteAttr(m[unix.SizeofIfInfomsg:])
		if err != nil {
			return nil, fmt.Errorf("parse IPv6 link: %w", err)
		}
		name, on := "", false
		for _, a := range attrs {
			switch a.Attr.Type {
			case unix.IFLA_IFNAME:
				name = strings.TrimRight(string(a.Value), "\x00")
			case unix.IFLA_PROTINFO:
				nested, err := nl.ParseRouteAttr(a.Value)
				if err != nil {
					return nil, fmt.Errorf("parse IPv6 link info: %w", err)
				}
				for _, n := range nested {
					if n.Attr.Type == unix.IFLA_INET6_CONF && len(n.Value) >= 4*(devconfDisableIPv6+1) {
						v := int32(native.Uint32(n.Value[4*devconfDisableIPv6:]))
						on = v == 0
					}
				}
			}
		}
		if name != "" {
			out[name] = on
		}
	}
	return out, nil
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

// Netlink implements Router over a Conn per call.
type Netlink struct{}

// State implements Router.
func (Netlink) State(netnsPath string) (NetnsState, error) {
	c, err := Open(netnsPath, nil)
	if err != nil {
		return NetnsState{}, err
	}
	defer c.Close()
	return c.State, nil
}

// PolicyRouteState implements Router.
func (Netlink) PolicyRouteState(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (bool, bool, error) {
	c, err := Open(netnsPath, nil)
	if err != nil {
		return false, false, err
	}
	defer c.Close()
	return c.PolicyRouteState(f, want)
}

// EnsurePolicyRoute implements Router.
func (Netlink) EnsurePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (Parts, error) {
	c, err := Open(netnsPath, nil)
	if err != nil {
		return Parts{}, err
	}
	defer c.Close()
	return c.EnsurePolicyRoute(f, want)
}

// RemovePolicyRoute implements Router.
func (Netlink) RemovePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute, parts Parts) error {
	c, err := Open(netnsPath, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.RemovePolicyRoute(f, want, parts)
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
