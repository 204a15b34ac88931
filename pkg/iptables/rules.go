// Package iptables holds the in-pod redirection rules as data, renders them
// to iptables-restore input, applies them inside a pod's network namespace
// (one iptables-restore --noflush transaction per address family plus the
// policy-routing rule and local route via netlink), reports drift, and
// removes exactly what it added.
//
// Everything lives in our own chains (ISTIO_PRERT, ISTIO_OUTPUT) reached by
// one jump from a built-in chain per table, so removal deletes only what this
// package created and never touches other rules in the namespace.
package iptables

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// Family is an IP address family: it selects iptables or ip6tables.
type Family int

const (
	// IPv4 selects iptables and IPv4 routing.
	IPv4 Family = 4
	// IPv6 selects ip6tables and IPv6 routing.
	IPv6 Family = 6
)

// Families lists both families in the order they are applied.
var Families = []Family{IPv4, IPv6}

// String returns "ipv4" or "ipv6".
func (f Family) String() string {
	switch f {
	case IPv4:
		return "ipv4"
	case IPv6:
		return "ipv6"
	}
	return fmt.Sprintf("family(%d)", int(f))
}

// loopback is the address the redirect rules exclude as a destination
// (REDIRECT in OUTPUT rewrites to it, and local services bind to it).
func (f Family) loopback() string {
	if f == IPv6 {
		return "::1/128"
	}
	return "127.0.0.1/32"
}

// hostPrefix renders a as a single-host prefix the way iptables-save prints it.
func hostPrefix(a netip.Addr) string {
	return netip.PrefixFrom(a, a.BitLen()).String()
}

// Our chain names, the same in every table that uses them. They match the
// names Istio's CNI agent uses, so a node moving between implementations
// never ends up with two competing sets of capture rules in one pod.
const (
	// ChainPrerouting holds our rules for packets entering the pod.
	ChainPrerouting = "ISTIO_PRERT"
	// ChainOutput holds our rules for packets the pod sends.
	ChainOutput = "ISTIO_OUTPUT"
	// ChainProbeSNAT holds the host's kubelet-probe SNAT rule (nat table,
	// jumped to from POSTROUTING).
	ChainProbeSNAT = "AMBIENT_PROBE_SNAT"
)

// Tables we write to, in the order they are rendered.
const (
	TableRaw    = "raw"
	TableMangle = "mangle"
	TableNAT    = "nat"
)

// scope bounds what one kind of rule set may create or delete: its
// tables, its chains, and the built-in chain that jumps to each. Planning
// and removal never touch a chain outside the scope.
type scope struct {
	tables []string
	chains []string
	hook   map[string]string
	// first names chains whose jump must be the first rule of its hook
	// chain (inserted at 1, moved back there by every apply).
	first map[string]bool
}

func (s *scope) owns(chain string) bool {
	for _, c := range s.chains {
		if c == chain {
			return true
		}
	}
	return false
}

var (
	// podScope is what the in-pod rule set owns.
	podScope = &scope{
		tables: []string{TableRaw, TableMangle, TableNAT},
		chains: []string{ChainPrerouting, ChainOutput},
		hook:   map[string]string{ChainPrerouting: "PREROUTING", ChainOutput: "OUTPUT"},
	}
	// hostScope is what the host probe SNAT owns.
	// The probe SNAT jump goes first in POSTROUTING (Istio inserts it at
	// 1): a MASQUERADE or ACCEPT that other tools put earlier would
	// otherwise take kubelet's probes before they are SNATed.
	hostScope = &scope{
		tables: []string{TableNAT},
		chains: []string{ChainProbeSNAT},
		hook:   map[string]string{ChainProbeSNAT: "POSTROUTING"},
		first:  map[string]bool{ChainProbeSNAT: true},
	}
)

// isOurChain reports whether name is a chain this package owns anywhere.
func isOurChain(name string) bool { return podScope.owns(name) || hostScope.owns(name) }

// RestoreMask is the nfmask and ctmask of the connmark restore: the whole
// connmark becomes the packet mark, as in Istio's rules.
const RestoreMask uint32 = 0xffffffff

// DNSConntrackZone is the conntrack zone for ztunnel's upstream DNS leg, so
// it never shares conntrack entries with the application's (redirected) leg.
const DNSConntrackZone = 1

// PodConfig holds the options for one pod's rule set.
type PodConfig struct {
	// ProbeSNATv4 and ProbeSNATv6 are the sources kubelet probes are SNATed
	// to on the host; traffic from (and to) them bypasses capture. The zero
	// value means ambient.DefaultProbeSNATv4 / ambient.DefaultProbeSNATv6.
	ProbeSNATv4, ProbeSNATv6 netip.Addr
	// DNSCapture redirects DNS (UDP and TCP port 53) to ztunnel's 15053.
	DNSCapture bool
	// BypassInbound disables inbound redirection to 15006 (ingress mode).
	BypassInbound bool
	// VirtualInterfaces are interfaces in the pod (KubeVirt's bridge to a
	// VM, say) whose incoming TCP is redirected to ztunnel's outbound port
	// as if the pod had sent it, whatever BypassInbound says. A trailing
	// "+" matches every name with that prefix, as with iptables -i.
	VirtualInterfaces []string
}

// MaxVirtualInterfaces bounds PodConfig.VirtualInterfaces: each name costs
// a rule per family, and an annotation is not a place for hundreds.
const MaxVirtualInterfaces = 32

// validInterface accepts what the kernel accepts as an interface name (1 to
// 15 bytes, no '/', ':' or whitespace, not "." or "..") in printable ASCII
// without quotes or backslashes, with an optional trailing "+" wildcard.
func validInterface(name string) error {
	base := strings.TrimSuffix(name, "+")
	if base == "" || len(name) > 15 || name == "." || name == ".." {
		return fmt.Errorf("virtual interface name %q: want 1 to 15 characters", name)
	}
	for i := 0; i < len(base); i++ {
		c := base[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte("/:\"'+*", c) >= 0 {
			return fmt.Errorf("virtual interface name %q: character %q not allowed", name, c)
		}
	}
	return nil
}

// withDefaults fills in the probe addresses.
func (c PodConfig) withDefaults() PodConfig {
	if !c.ProbeSNATv4.IsValid() {
		c.ProbeSNATv4 = ambient.DefaultProbeSNATv4
	}
	if !c.ProbeSNATv6.IsValid() {
		c.ProbeSNATv6 = ambient.DefaultProbeSNATv6
	}
	return c
}

// Validate rejects probe addresses of the wrong family or with a zone.
func (c PodConfig) Validate() error {
	c = c.withDefaults()
	if !c.ProbeSNATv4.Unmap().Is4() {
		return fmt.Errorf("probe SNAT v4 address %s is not IPv4", c.ProbeSNATv4)
	}
	if !c.ProbeSNATv6.Is6() || c.ProbeSNATv6.Is4In6() || c.ProbeSNATv6.Zone() != "" {
		return fmt.Errorf("probe SNAT v6 address %s is not a plain IPv6 address", c.ProbeSNATv6)
	}
	if len(c.VirtualInterfaces) > MaxVirtualInterfaces {
		return fmt.Errorf("%d virtual interfaces, at most %d", len(c.VirtualInterfaces), MaxVirtualInterfaces)
	}
	for _, n := range c.VirtualInterfaces {
		if err := validInterface(n); err != nil {
			return err
		}
	}
	return nil
}

// probe returns the probe SNAT address for f.
func (c PodConfig) probe(f Family) netip.Addr {
	c = c.withDefaults()
	if f == IPv6 {
		return c.ProbeSNATv6
	}
	return c.ProbeSNATv4.Unmap()
}

// ChainRules is one of our chains with its rules in order. Each rule is the
// rule specification exactly as iptables-save prints it after "-A <chain> ",
// which makes comparison with a saved state a plain string comparison.
type ChainRules struct {
	Name  string
	Rules []string
}

// TableRules is what we want in one table.
type TableRules struct {
	Name   string
	Chains []ChainRules
}

// PolicyRoute is the fwmark rule and local route that keep replies of
// ztunnel-originated inbound connections inside the pod.
type PolicyRoute struct {
	// Mark and Mask select packets (ip rule fwmark Mark/Mask).
	Mark, Mask uint32
	// Table is the routing table the rule points to.
	Table int
	// Priority is the ip rule preference.
	Priority int
	// Local is the destination of the "local ... dev lo" route in Table.
	Local netip.Prefix
}

// String renders the rule and route the way `ip` would describe them.
func (p PolicyRoute) String() string {
	return fmt.Sprintf("rule pref %d fwmark %#x/%#x lookup %d; route local %s dev lo table %d",
		p.Priority, p.Mark, p.Mask, p.Table, p.Local, p.Table)
}

// RuleSet is the desired state of one address family in a network
// namespace: iptables chains and, for pods, the policy route.
type RuleSet struct {
	Family  Family
	Tables  []TableRules
	Routing PolicyRoute
	// scope is what the set owns; nil means the in-pod scope.
	scope *scope
}

func (rs RuleSet) sc() *scope {
	if rs.scope == nil {
		return podScope
	}
	return rs.scope
}

// markSpec renders value/mask in iptables' hex notation.
func markSpec(v, m uint32) string { return fmt.Sprintf("%#x/%#x", v, m) }

// PodRules builds the desired rule set of family f for a pod. It is pure:
// the same input always gives the same value. cfg should pass Validate.
func PodRules(cfg PodConfig, f Family) RuleSet {
	cfg = cfg.withDefaults()
	lo := f.loopback()
	probe := hostPrefix(cfg.probe(f))
	ztunnel := markSpec(ambient.ZtunnelMark, ambient.MarkMask)
	skip := markSpec(ambient.ConnSkipMark, ambient.MarkMask)

	var tables []TableRules

	if cfg.DNSCapture {
		// ztunnel's own upstream queries (marked) and the replies coming
		// back from port 53 get their own conntrack zone, so they never
		// collide with the application's redirected leg in zone 0.
		tables = append(tables, TableRules{Name: TableRaw, Chains: []ChainRules{
			{Name: ChainPrerouting, Rules: []string{
				fmt.Sprintf("-p udp -m udp --sport %d -m mark ! --mark %s -j CT --zone %d", ambient.DNSPort, ztunnel, DNSConntrackZone),
			}},
			{Name: ChainOutput, Rules: []string{
				fmt.Sprintf("-p udp -m udp --dport %d -m mark --mark %s -j CT --zone %d", ambient.DNSPort, ztunnel, DNSConntrackZone),
			}},
		}})
	}

	// Packets ztunnel sends into the pod (marked) tag their connection;
	// replies get the mark back so policy routing keeps them local. The
	// restore copies the whole connmark into the packet mark, as Istio's
	// does (masks 0xffffffff).
	tables = append(tables, TableRules{Name: TableMangle, Chains: []ChainRules{
		{Name: ChainPrerouting, Rules: []string{
			fmt.Sprintf("-m mark --mark %s -j CONNMARK --set-xmark %s", ztunnel, skip),
		}},
		{Name: ChainOutput, Rules: []string{
			fmt.Sprintf("-m connmark --mark %s -j CONNMARK --restore-mark --nfmask %#x --ctmask %#x", skip, RestoreMask, RestoreMask),
		}},
	}})

	// Exceptions RETURN rather than ACCEPT so rules others put after our
	// jump in the built-in chain still run.
	var nat []ChainRules
	var pre []string
	// TCP arriving from a virtual interface is the VM's outbound traffic:
	// to ztunnel's outbound port, ahead of every inbound rule. REDIRECT
	// ends the nat traversal, so no RETURN is needed after it.
	for _, vif := range cfg.VirtualInterfaces {
		pre = append(pre, fmt.Sprintf("-i %s -p tcp -j REDIRECT --to-ports %d", vif, ambient.ZtunnelOutboundPort))
	}
	if !cfg.BypassInbound {
		pre = append(pre,
			fmt.Sprintf("-s %s -p tcp -j RETURN", probe),
			fmt.Sprintf("! -d %s -p tcp -m tcp ! --dport %d -m mark ! --mark %s -j REDIRECT --to-ports %d",
				lo, ambient.ZtunnelInboundHBONEPort, ztunnel, ambient.ZtunnelInboundPlaintextPort))
	}
	if len(pre) > 0 {
		nat = append(nat, ChainRules{Name: ChainPrerouting, Rules: pre})
	}
	out := []string{
		fmt.Sprintf("-d %s -p tcp -j RETURN", probe),
	}
	if cfg.DNSCapture {
		// Before the lo exception, as Istio orders them: UDP DNS to a
		// resolver outside the pod, and TCP DNS to anything but the
		// loopback address, even when it leaves via lo (to the pod's own
		// address, say).
		out = append(out,
			fmt.Sprintf("! -o lo -p udp -m udp --dport %d -m mark ! --mark %s -j REDIRECT --to-ports %d",
				ambient.DNSPort, ztunnel, ambient.ZtunnelDNSPort),
			fmt.Sprintf("! -d %s -p tcp -m tcp --dport %d -m mark ! --mark %s -j REDIRECT --to-ports %d",
				lo, ambient.DNSPort, ztunnel, ambient.ZtunnelDNSPort))
	}
	out = append(out,
		// Packets routed by the connmark (mark 0x111: policy routing keeps
		// them in the pod) are never redirected, as in Istio.
		fmt.Sprintf("-p tcp -m mark --mark %s -j RETURN", skip),
		"-o lo -j RETURN",
		fmt.Sprintf("! -d %s -p tcp -m mark ! --mark %s -j REDIRECT --to-ports %d",
			lo, ztunnel, ambient.ZtunnelOutboundPort))
	nat = append(nat, ChainRules{Name: ChainOutput, Rules: out})
	tables = append(tables, TableRules{Name: TableNAT, Chains: nat})

	local := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if f == IPv6 {
		local = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	return RuleSet{
		Family: f,
		Tables: tables,
		Routing: PolicyRoute{
			Mark:     ambient.ConnSkipMark,
			Mask:     ambient.MarkMask,
			Table:    ambient.RouteTable,
			Priority: ambient.RulePriority,
			Local:    local,
		},
	}
}

// jumpSpec is the rule spec of the jump from a built-in chain to ours.
func jumpSpec(chain string) string { return "-j " + chain }

// addJump is the restore command that adds the jump to chain: appended, or
// inserted at 1 for a chain that must come first.
func (s *scope) addJump(chain string) string {
	if s.first[chain] {
		return "-I " + s.hook[chain] + " 1 " + jumpSpec(chain)
	}
	return "-A " + s.hook[chain] + " " + jumpSpec(chain)
}

// Render returns iptables-restore --noflush input that installs the rule set
// into a namespace that has none of our chains yet. The Applier does not use
// it directly: it plans against the namespace's current state so that
// re-applying never duplicates a jump (see PlanApply).
func (rs RuleSet) Render() string {
	var b strings.Builder
	for _, t := range rs.Tables {
		fmt.Fprintf(&b, "*%s\n", t.Name)
		for _, c := range t.Chains {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c.Name)
		}
		for _, c := range t.Chains {
			b.WriteString(rs.sc().addJump(c.Name) + "\n")
		}
		for _, c := range t.Chains {
			for _, r := range c.Rules {
				fmt.Fprintf(&b, "-A %s %s\n", c.Name, r)
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}
