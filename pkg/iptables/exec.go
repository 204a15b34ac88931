package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Cmd is one command to run inside a network namespace.
type Cmd struct {
	Name  string
	Args  []string
	Stdin []byte
}

// String renders the command line for logs and errors.
func (c Cmd) String() string { return strings.Join(append([]string{c.Name}, c.Args...), " ") }

// Executor runs commands inside a network namespace. It is the Applier's
// only way to run iptables, so tests of the planning logic substitute a
// fake; NetnsExecutor is the real one.
type Executor interface {
	// Run runs cmd inside the namespace at netnsPath ("" = the caller's
	// namespace) and returns its standard output.
	Run(ctx context.Context, netnsPath string, cmd Cmd) ([]byte, error)
}

// Router reads and changes what the Applier sets through netlink and
// sysctl in a network namespace; NetlinkRouter is the real one.
type Router interface {
	// State reports the namespace's loopback and IPv6 state.
	State(netnsPath string) (NetnsState, error)
	// PolicyRouteState reports whether the fwmark rule and the local route
	// of want exist.
	PolicyRouteState(netnsPath string, f Family, want PolicyRoute) (rule, route bool, err error)
	// EnsurePolicyRoute installs the rule and route if missing and reports
	// what it added. On error it has added nothing.
	EnsurePolicyRoute(netnsPath string, f Family, want PolicyRoute) (RouteParts, error)
	// RemovePolicyRoute deletes the named parts if present.
	RemovePolicyRoute(netnsPath string, f Family, want PolicyRoute, parts RouteParts) error
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

// RouteParts names parts of a policy route: the ip rule, the local route.
type RouteParts struct{ Rule, Route bool }

// Any reports whether any part is named.
func (p RouteParts) Any() bool { return p.Rule || p.Route }

// allRoute names both parts.
var allRoute = RouteParts{Rule: true, Route: true}

// maxOutput bounds what a command may print; iptables-save of a pod
// namespace is tiny, so more than this is an error, not a memory hazard.
const maxOutput = maxSaveBytes

// NetnsExecutor runs commands in a namespace by switching a locked OS
// thread into it and forking from there; the child inherits the thread's
// namespace. It works for named netns paths, /proc/<pid>/ns/net and
// /proc/self/fd/<n>.
type NetnsExecutor struct{}

// Run implements Executor.
func (NetnsExecutor) Run(ctx context.Context, netnsPath string, cmd Cmd) ([]byte, error) {
	var out []byte
	run := func() error {
		c := exec.CommandContext(ctx, cmd.Name, cmd.Args...)
		c.Stdin = bytes.NewReader(cmd.Stdin)
		stdout := &capped{limit: maxOutput}
		stderr := &capped{limit: 4096}
		c.Stdout, c.Stderr = stdout, stderr
		c.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C"}
		err := c.Run()
		if stdout.over {
			return fmt.Errorf("%s: output exceeds %d bytes", cmd.Name, maxOutput)
		}
		if err != nil {
			msg := strings.TrimSpace(stderr.String())
			if msg != "" {
				return fmt.Errorf("%s: %w: %s", cmd, err, msg)
			}
			return fmt.Errorf("%s: %w", cmd, err)
		}
		out = stdout.Bytes()
		return nil
	}
	if netnsPath == "" {
		return out, run()
	}
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error { return run() })
	return out, err
}

// capped is a bytes.Buffer that stops growing at limit and remembers it.
type capped struct {
	bytes.Buffer
	limit int
	over  bool
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.limit - c.Len(); len(p) > room {
		c.over = true
		if room > 0 {
			c.Buffer.Write(p[:room])
		}
		return len(p), nil
	}
	return c.Buffer.Write(p)
}

// NetlinkRouter implements Router with netlink sockets opened inside the
// target namespace, so no thread ever switches namespace for routing.
type NetlinkRouter struct{}

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
func (NetlinkRouter) State(netnsPath string) (NetnsState, error) {
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

func nlFamily(f Family) int {
	if f == IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

func (p PolicyRoute) rule(f Family) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = nlFamily(f)
	r.Table = p.Table
	r.Mark = p.Mark
	mask := p.Mask
	r.Mask = &mask
	r.Priority = p.Priority
	return r
}

func (p PolicyRoute) route(lo int) *netlink.Route {
	return &netlink.Route{
		LinkIndex: lo,
		Dst:       &net.IPNet{IP: p.Local.Addr().AsSlice(), Mask: net.CIDRMask(p.Local.Bits(), p.Local.Addr().BitLen())},
		Table:     p.Table,
		Type:      unix.RTN_LOCAL,
		Scope:     netlink.SCOPE_HOST,
		Family:    nlFamily(p.familyOf()),
	}
}

func (p PolicyRoute) familyOf() Family {
	if p.Local.Addr().Is6() {
		return IPv6
	}
	return IPv4
}

func findRule(h *netlink.Handle, f Family, want PolicyRoute) (bool, error) {
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

func findRoute(h *netlink.Handle, f Family, want PolicyRoute) (bool, int, error) {
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
func (NetlinkRouter) PolicyRouteState(netnsPath string, f Family, want PolicyRoute) (bool, bool, error) {
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
func (NetlinkRouter) EnsurePolicyRoute(netnsPath string, f Family, want PolicyRoute) (RouteParts, error) {
	h, err := handle(netnsPath)
	if err != nil {
		return RouteParts{}, err
	}
	defer h.Close()
	var added RouteParts
	route, lo, err := findRoute(h, f, want)
	if err != nil {
		return added, err
	}
	// Route before rule: the rule must never point at an empty table.
	if !route {
		if err := h.RouteAdd(want.route(lo)); err != nil && !errors.Is(err, unix.EEXIST) {
			return added, fmt.Errorf("add route local %s dev lo table %d: %w", want.Local, want.Table, err)
		} else if err == nil {
			added.Route = true
		}
	}
	rule, err := findRule(h, f, want)
	if err == nil && !rule {
		if err = h.RuleAdd(want.rule(f)); err != nil && !errors.Is(err, unix.EEXIST) {
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
		return RouteParts{}, err
	}
	return added, nil
}

// RemovePolicyRoute implements Router.
func (NetlinkRouter) RemovePolicyRoute(netnsPath string, f Family, want PolicyRoute, parts RouteParts) error {
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
			if err := h.RuleDel(want.rule(f)); err != nil && !errors.Is(err, unix.ENOENT) {
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

func deleteRoute(h *netlink.Handle, want PolicyRoute, lo int) error {
	if err := h.RouteDel(want.route(lo)); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete route local %s dev lo table %d: %w", want.Local, want.Table, err)
	}
	return nil
}
