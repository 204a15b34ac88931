package ruleset

import (
	"fmt"
	"net/netip"
)

// Branch ENI pods (EKS "security groups for pods"): the VPC CNI gives such
// a pod a VLAN sub-interface of a trunk ENI and routes it with a table of
// its own, selected by "iif <host veth>" and "iif <vlan>" rules, whose
// default route leaves through the VLAN. The node has no route to the pod
// in its main table: kubelet's probes reach it through the VPC, and the
// pod's replies go back the same way. Once the host probe SNAT rewrites a
// probe's source to the link-local probe address, neither direction can
// cross the VPC, so the probes fail. Two ip rules per captured branch ENI
// pod, on the node, send them through the pod's veth instead:
//
//   - forward: host-originated TCP to the pod (what the SNAT rewrites)
//     looks up the pod's table, whose host route names the veth;
//   - return: TCP from the pod arriving on its veth looks up the local
//     table first, so replies to the host are delivered on the node
//     rather than sent out the VLAN.
//
// Both carry the pod's IP and BranchENIProtocol, so they are found again
// without state and never confused with the VPC CNI's own.

// BranchENIProtocol tags the ip rules of the branch ENI probe path (the
// rule's protocol, as `ip rule ... protocol` shows it).
const BranchENIProtocol = 0xac

// BranchENIForwardPriority is the preference of the forward rule: the one
// the VPC CNI gives its "to <pod> lookup main" rules of ordinary pods, after
// its iif rules of branch ENI pods (which never match host-originated
// packets).
const BranchENIForwardPriority = 512

// BranchENI is how the VPC CNI routes one branch ENI pod on the node.
type BranchENI struct {
	// Table is the pod's route table.
	Table int
	// Veth is the host side of the pod's veth, which the table's host
	// route to the pod names.
	Veth string
	// VethPriority is the preference of the VPC CNI's "iif <veth> lookup
	// <table>" rule; the return rule goes just before it.
	VethPriority int
}

// IPRule is one ip rule as data: every set field must match.
type IPRule struct {
	Family   Family
	Priority int
	// Src and Dst match the source or destination prefix when valid.
	Src, Dst netip.Prefix
	// Iif matches the input interface; "lo" matches host-originated
	// packets.
	Iif string
	// Proto matches the transport protocol when set.
	Proto Proto
	// Table is the table the rule looks up.
	Table int
	// Protocol tags the rule's origin (BranchENIProtocol for ours).
	Protocol uint8
}

// String renders the rule the way `ip rule` shows it.
func (r IPRule) String() string {
	s := fmt.Sprintf("pref %d", r.Priority)
	if r.Src.IsValid() {
		s += " from " + r.Src.String()
	}
	if r.Dst.IsValid() {
		s += " to " + r.Dst.String()
	}
	if r.Iif != "" {
		s += " iif " + r.Iif
	}
	if r.Proto != AnyProto {
		s += " ipproto " + string(r.Proto)
	}
	return s + fmt.Sprintf(" lookup %d proto %d", r.Table, r.Protocol)
}

// LocalTable is the kernel's local routing table.
const LocalTable = 255

// BranchENIRules builds the forward and return rules for the branch ENI pod
// at ip. Pure. Narrower than Istio's (which send all traffic to the pod
// through the veth, and deliver all of the pod's traffic to the node's
// addresses locally): only host-originated TCP goes direct, and only the
// pod's own TCP is delivered locally, so traffic of other pods keeps
// crossing the VPC and its security groups.
func BranchENIRules(ip netip.Addr, b BranchENI) []IPRule {
	ip = ip.Unmap()
	f := IPv4
	if ip.Is6() {
		f = IPv6
	}
	pod := host(ip)
	ret := b.VethPriority - 1
	if ret < 0 {
		ret = 0
	}
	return []IPRule{
		{Family: f, Priority: BranchENIForwardPriority, Dst: pod, Iif: "lo", Proto: TCP, Table: b.Table, Protocol: BranchENIProtocol},
		{Family: f, Priority: ret, Src: pod, Iif: b.Veth, Proto: TCP, Table: LocalTable, Protocol: BranchENIProtocol},
	}
}

// RouteView is what branch ENI detection needs of one route: its table, its
// destination and its device's name.
type RouteView struct {
	Table int
	Dst   netip.Prefix
	Dev   string
}

// RuleView is what branch ENI detection needs of one ip rule.
type RuleView struct {
	Priority int
	Iif      string
	Table    int
	Protocol uint8
}

// FindBranchENI looks for the VPC CNI's routing of ip among the node's
// rules and routes: a table other than main and local, selected by an iif
// rule naming the very device the table's host route to ip leaves by. An
// ordinary pod has a main-table route and no such rule, so it is never
// found. Pure.
func FindBranchENI(ip netip.Addr, rules []RuleView, routes []RouteView) (BranchENI, bool) {
	ip = ip.Unmap()
	for _, rt := range routes {
		if rt.Table <= 0 || rt.Table == 254 || rt.Table == LocalTable || rt.Dev == "" ||
			rt.Dst != host(ip) {
			continue
		}
		for _, r := range rules {
			// Our own return rule names the veth too, but looks up local.
			if r.Table == rt.Table && r.Iif == rt.Dev && r.Protocol != BranchENIProtocol && r.Priority > 0 {
				return BranchENI{Table: rt.Table, Veth: rt.Dev, VethPriority: r.Priority}, true
			}
		}
	}
	return BranchENI{}, false
}
