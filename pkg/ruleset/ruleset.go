// Package ruleset holds the in-pod capture rules and the host's kubelet
// probe SNAT as data: which packets each rule matches and what it does,
// per table and hook, plus the policy route, built from a PodConfig or
// HostProbeConfig by pure functions. The iptables and nftables backends
// render this one value (pkg/iptables to iptables-restore input,
// pkg/nftables to netlink and nft text) and report drift with the types
// here.
package ruleset

import (
	"fmt"
	"net/netip"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// Family is an IP address family.
type Family int

const (
	// IPv4 is the IPv4 family (iptables, ip).
	IPv4 Family = 4
	// IPv6 is the IPv6 family (ip6tables, ip6).
	IPv6 Family = 6
)

// Families lists both families in the order they are applied.
var Families = []Family{IPv4, IPv6}

// String returns "ipv4" or "ipv6" ("inet" for the zero value, which drift
// of an nftables inet table uses for both).
func (f Family) String() string {
	switch f {
	case IPv4:
		return "ipv4"
	case IPv6:
		return "ipv6"
	case 0:
		return "inet"
	}
	return fmt.Sprintf("family(%d)", int(f))
}

// Loopback is the loopback address of f as a host prefix: the destination
// the redirect rules exclude (REDIRECT in OUTPUT rewrites to it, and local
// services bind to it).
func (f Family) Loopback() netip.Prefix {
	if f == IPv6 {
		return netip.MustParsePrefix("::1/128")
	}
	return netip.MustParsePrefix("127.0.0.1/32")
}

// Table is the netfilter table a chain belongs to (iptables' names; the
// nftables backend uses the same priorities and chain types).
type Table string

// The tables the rules use, in the order they are rendered.
const (
	Raw    Table = "raw"
	Mangle Table = "mangle"
	NAT    Table = "nat"
)

// Hook is where a chain is attached (iptables' built-in chain names).
type Hook string

// The hooks the rules use.
const (
	Prerouting  Hook = "PREROUTING"
	Output      Hook = "OUTPUT"
	Postrouting Hook = "POSTROUTING"
)

// Kind says which rule set a value is: a pod's or the host's.
type Kind int

const (
	// Pod is the in-pod capture rule set.
	Pod Kind = iota
	// Host is the host's kubelet probe SNAT.
	Host
)

// Proto is a transport protocol match.
type Proto string

// Protocols.
const (
	AnyProto Proto = ""
	TCP      Proto = "tcp"
	UDP      Proto = "udp"
)

// AddrMatch matches a source or destination prefix; the zero value
// matches everything.
type AddrMatch struct {
	Prefix netip.Prefix
	Not    bool
}

// IsSet reports whether the match is present.
func (m AddrMatch) IsSet() bool { return m.Prefix.IsValid() }

// IfaceMatch matches an input or output interface name; a trailing "+"
// matches every name with that prefix. The zero value matches everything.
type IfaceMatch struct {
	Name string
	Not  bool
}

// IsSet reports whether the match is present.
func (m IfaceMatch) IsSet() bool { return m.Name != "" }

// PortMatch matches a source or destination port of Rule.Proto; port 0 is
// no match.
type PortMatch struct {
	Port uint16
	Not  bool
}

// IsSet reports whether the match is present.
func (m PortMatch) IsSet() bool { return m.Port != 0 }

// MarkMatch matches (mark & Mask) == Value on the packet mark or the
// connection mark; Mask 0 is no match.
type MarkMatch struct {
	Value, Mask uint32
	Not         bool
}

// IsSet reports whether the match is present.
func (m MarkMatch) IsSet() bool { return m.Mask != 0 }

// ActionKind is what a rule does with a packet it matches.
type ActionKind int

// Actions.
const (
	// Return ends our rules for the packet (iptables RETURN from our
	// chain; nftables return from our base chain): rules of others at the
	// same hook still run.
	Return ActionKind = iota
	// Redirect rewrites the destination to a local port (REDIRECT).
	Redirect
	// CTZone puts the connection into conntrack zone Zone (raw table).
	CTZone
	// SetConnMark sets connmark = (connmark & ^Mask) ^ Value.
	SetConnMark
	// RestoreMark copies the whole connmark into the packet mark
	// (CONNMARK --restore-mark with masks RestoreMask).
	RestoreMark
	// SNAT rewrites the source to To.
	SNAT
)

// Action is a rule's verdict and its argument.
type Action struct {
	Kind        ActionKind
	Port        uint16
	Zone        uint16
	Value, Mask uint32
	To          netip.Addr
}

// Rule is one rule: every set match must hold, then Action applies.
type Rule struct {
	Proto        Proto
	Src, Dst     AddrMatch
	In, Out      IfaceMatch
	SPort, DPort PortMatch
	Mark         MarkMatch
	ConnMark     MarkMatch
	// SocketExists matches packets of a local socket (iptables -m owner
	// --socket-exists): locally generated, not forwarded.
	SocketExists bool
	// DstSet names a set of destination addresses (an ipset, or a set in
	// the nftables table).
	DstSet string
	Action Action
}

// Chain is our rules at one hook of one table, in order.
type Chain struct {
	Table Table
	Hook  Hook
	Rules []Rule
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
// namespace: our chains and, for pods, the policy route.
type RuleSet struct {
	Kind   Kind
	Family Family
	// Chains in render order: by table (raw, mangle, nat), then
	// PREROUTING before OUTPUT. A hook without rules has no chain.
	Chains  []Chain
	Routing PolicyRoute
}

// Chain returns the chain of table at hook, or nil.
func (rs RuleSet) Chain(t Table, h Hook) *Chain {
	for i := range rs.Chains {
		if rs.Chains[i].Table == t && rs.Chains[i].Hook == h {
			return &rs.Chains[i]
		}
	}
	return nil
}

// Tables lists the tables the set uses, in order.
func (rs RuleSet) Tables() []Table {
	var out []Table
	for _, c := range rs.Chains {
		if len(out) == 0 || out[len(out)-1] != c.Table {
			out = append(out, c.Table)
		}
	}
	return out
}

// RestoreMask is the nfmask and ctmask of the connmark restore: the whole
// connmark becomes the packet mark, as in Istio's rules.
const RestoreMask uint32 = 0xffffffff

// DNSConntrackZone is the conntrack zone for ztunnel's upstream DNS leg, so
// it never shares conntrack entries with the application's (redirected) leg.
const DNSConntrackZone = 1

// Names of the host's probe address sets (ipsets, or sets in the nftables
// table), one per family.
const (
	ProbeSetV4 = "ambient-probes-v4"
	ProbeSetV6 = "ambient-probes-v6"
)

// ProbeSet names the probe set of family f.
func ProbeSet(f Family) string {
	if f == IPv6 {
		return ProbeSetV6
	}
	return ProbeSetV4
}

// ProbeIP checks ip as a pod IP for the host's probe set and returns it
// as the set holds it (an IPv4-mapped IPv6 address unmapped) with its
// family; what can never be a pod's IP is an error.
func ProbeIP(ip netip.Addr) (netip.Addr, Family, error) {
	if !ip.IsValid() || ip.Zone() != "" || ip.IsUnspecified() || ip.IsLoopback() || ip.IsMulticast() {
		return netip.Addr{}, 0, fmt.Errorf("not a pod IP: %s", ip)
	}
	ip = ip.Unmap()
	if ip.Is4() {
		return ip, IPv4, nil
	}
	return ip, IPv6, nil
}

func host(a netip.Addr) netip.Prefix { return netip.PrefixFrom(a, a.BitLen()) }

// PodRules builds the desired rule set of family f for a pod. It is pure:
// the same input always gives the same value. cfg should pass Validate.
func PodRules(cfg PodConfig, f Family) RuleSet {
	cfg = cfg.WithDefaults()
	lo := AddrMatch{Prefix: f.Loopback(), Not: true}
	probe := host(cfg.Probe(f))
	ztunnel := MarkMatch{Value: ambient.ZtunnelMark, Mask: ambient.MarkMask}
	notZtunnel := MarkMatch{Value: ambient.ZtunnelMark, Mask: ambient.MarkMask, Not: true}
	skip := MarkMatch{Value: ambient.ConnSkipMark, Mask: ambient.MarkMask}
	redirect := func(port uint16) Action { return Action{Kind: Redirect, Port: port} }
	ret := Action{Kind: Return}

	var chains []Chain
	if cfg.DNSCapture {
		// ztunnel's own upstream queries (marked) and the replies coming
		// back from port 53 get their own conntrack zone, so they never
		// collide with the application's redirected leg in zone 0.
		zone := Action{Kind: CTZone, Zone: DNSConntrackZone}
		chains = append(chains,
			Chain{Table: Raw, Hook: Prerouting, Rules: []Rule{
				{Proto: UDP, SPort: PortMatch{Port: ambient.DNSPort}, Mark: notZtunnel, Action: zone},
			}},
			Chain{Table: Raw, Hook: Output, Rules: []Rule{
				{Proto: UDP, DPort: PortMatch{Port: ambient.DNSPort}, Mark: ztunnel, Action: zone},
			}})
	}

	// Packets ztunnel sends into the pod (marked) tag their connection;
	// replies get the mark back so policy routing keeps them local. The
	// restore copies the whole connmark into the packet mark, as Istio's
	// does.
	chains = append(chains,
		Chain{Table: Mangle, Hook: Prerouting, Rules: []Rule{
			{Mark: ztunnel, Action: Action{Kind: SetConnMark, Value: ambient.ConnSkipMark, Mask: ambient.MarkMask}},
		}},
		Chain{Table: Mangle, Hook: Output, Rules: []Rule{
			{ConnMark: skip, Action: Action{Kind: RestoreMark}},
		}})

	// Exceptions return rather than accept, so rules others put after
	// ours at the same hook still run.
	var pre []Rule
	// TCP arriving from a virtual interface is the VM's outbound traffic:
	// to ztunnel's outbound port, ahead of every inbound rule. A redirect
	// ends the nat traversal, so no return is needed after it.
	for _, vif := range cfg.VirtualInterfaces {
		pre = append(pre, Rule{In: IfaceMatch{Name: vif}, Proto: TCP, Action: redirect(ambient.ZtunnelOutboundPort)})
	}
	if !cfg.BypassInbound {
		pre = append(pre,
			Rule{Src: AddrMatch{Prefix: probe}, Proto: TCP, Action: ret},
			Rule{Dst: lo, Proto: TCP, DPort: PortMatch{Port: ambient.ZtunnelInboundHBONEPort, Not: true}, Mark: notZtunnel,
				Action: redirect(ambient.ZtunnelInboundPlaintextPort)})
	}
	if len(pre) > 0 {
		chains = append(chains, Chain{Table: NAT, Hook: Prerouting, Rules: pre})
	}
	out := []Rule{{Dst: AddrMatch{Prefix: probe}, Proto: TCP, Action: ret}}
	if cfg.DNSCapture {
		// Before the lo exception, as Istio orders them: UDP DNS to a
		// resolver outside the pod, and TCP DNS to anything but the
		// loopback address, even when it leaves via lo (to the pod's own
		// address, say).
		out = append(out,
			Rule{Out: IfaceMatch{Name: "lo", Not: true}, Proto: UDP, DPort: PortMatch{Port: ambient.DNSPort}, Mark: notZtunnel,
				Action: redirect(ambient.ZtunnelDNSPort)},
			Rule{Dst: lo, Proto: TCP, DPort: PortMatch{Port: ambient.DNSPort}, Mark: notZtunnel,
				Action: redirect(ambient.ZtunnelDNSPort)})
	}
	out = append(out,
		// Packets routed by the connmark (mark 0x111: policy routing keeps
		// them in the pod) are never redirected, as in Istio.
		Rule{Proto: TCP, Mark: skip, Action: ret},
		Rule{Out: IfaceMatch{Name: "lo"}, Action: ret},
		Rule{Dst: lo, Proto: TCP, Mark: notZtunnel, Action: redirect(ambient.ZtunnelOutboundPort)})
	chains = append(chains, Chain{Table: NAT, Hook: Output, Rules: out})

	local := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if f == IPv6 {
		local = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	return RuleSet{
		Kind:   Pod,
		Family: f,
		Chains: chains,
		Routing: PolicyRoute{
			Mark:     ambient.ConnSkipMark,
			Mask:     ambient.MarkMask,
			Table:    ambient.RouteTable,
			Priority: ambient.RulePriority,
			Local:    local,
		},
	}
}

// HostProbeRules builds the host's probe SNAT rule set for family f:
// locally generated TCP (a socket exists) to an address in the probe set is
// SNATed to the probe address. Pure. Its chain must run before any other
// nat rule at POSTROUTING (a MASQUERADE or ACCEPT there would otherwise
// take kubelet's probes first).
func HostProbeRules(cfg HostProbeConfig, f Family) RuleSet {
	return RuleSet{
		Kind:   Host,
		Family: f,
		Chains: []Chain{{Table: NAT, Hook: Postrouting, Rules: []Rule{{
			Proto: TCP, SocketExists: true, DstSet: ProbeSet(f),
			Action: Action{Kind: SNAT, To: cfg.Probe(f)},
		}}}},
	}
}
