package policyroute

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// earlyDemuxSysctl is the setting AWS requires to be 0 on every node
// running security groups for pods (the kernel's default is 1). Read in the
// calling thread's namespace: net sysctls are per namespace.
const earlyDemuxSysctl = "/proc/sys/net/ipv4/tcp_early_demux"

// BranchENINode reports whether the namespace the calling thread is in is
// prepared for branch ENI pods (net.ipv4.tcp_early_demux = 0). Elsewhere
// nothing is looked for, so the branch ENI path costs nothing on other
// nodes. Unreadable counts as not prepared.
func BranchENINode() bool {
	b, err := os.ReadFile(earlyDemuxSysctl)
	return err == nil && len(b) > 0 && b[0] == '0'
}

func prefix(n *net.IPNet) netip.Prefix {
	if n == nil {
		return netip.Prefix{}
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a.Unmap(), ones)
}

func ipnet(p netip.Prefix) *net.IPNet {
	if !p.IsValid() {
		return nil
	}
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

func ipFamily(ip netip.Addr) ruleset.Family {
	if ip.Unmap().Is4() {
		return ruleset.IPv4
	}
	return ruleset.IPv6
}

// FindBranchENI reads the rules and routes of ip's family and reports how
// the VPC CNI routes ip, if it is a branch ENI pod (ruleset.FindBranchENI).
func (c *Conn) FindBranchENI(ip netip.Addr) (ruleset.BranchENI, bool, error) {
	fam := nlFamily(ipFamily(ip))
	rules, err := c.h.RuleList(fam)
	if err != nil {
		return ruleset.BranchENI{}, false, fmt.Errorf("list rules: %w", err)
	}
	var rv []ruleset.RuleView
	for _, r := range rules {
		if r.IifName != "" {
			rv = append(rv, ruleset.RuleView{Priority: r.Priority, Iif: r.IifName, Table: r.Table, Protocol: r.Protocol})
		}
	}
	if len(rv) == 0 {
		return ruleset.BranchENI{}, false, nil // no iif rule: no branch ENI pod on the node
	}
	// One dump of every table, and only the pod's host routes named.
	rs, err := c.h.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return ruleset.BranchENI{}, false, fmt.Errorf("list routes: %w", err)
	}
	host := netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen())
	var routes []ruleset.RouteView
	for _, r := range rs {
		if r.LinkIndex == 0 || prefix(r.Dst) != host {
			continue
		}
		l, err := c.h.LinkByIndex(r.LinkIndex)
		if err != nil {
			continue // gone meanwhile: not the pod's device
		}
		routes = append(routes, ruleset.RouteView{Table: r.Table, Dst: host, Dev: l.Attrs().Name})
	}
	b, ok := ruleset.FindBranchENI(ip, rv, routes)
	return b, ok, nil
}

func nlRule(r ruleset.IPRule) *netlink.Rule {
	n := netlink.NewRule()
	n.Family = nlFamily(r.Family)
	n.Priority = r.Priority
	n.Src, n.Dst = ipnet(r.Src), ipnet(r.Dst)
	n.IifName = r.Iif
	switch r.Proto {
	case ruleset.TCP:
		n.IPProto = unix.IPPROTO_TCP
	case ruleset.UDP:
		n.IPProto = unix.IPPROTO_UDP
	}
	n.Table = r.Table
	n.Protocol = r.Protocol
	return n
}

// AddRules adds rules in order; one that exists is kept. On error it
// removes the ones it added.
func (c *Conn) AddRules(rules []ruleset.IPRule) error {
	var added []*netlink.Rule
	for _, r := range rules {
		n := nlRule(r)
		err := c.h.RuleAdd(n)
		if err == nil {
			added = append(added, n)
			continue
		}
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		err = fmt.Errorf("add rule %s: %w", r, err)
		for _, a := range added {
			if derr := c.h.RuleDel(a); derr != nil && !errors.Is(derr, unix.ENOENT) {
				err = errors.Join(err, fmt.Errorf("undo: %w", derr))
			}
		}
		return err
	}
	return nil
}

// RemoveTagged deletes the rules of family f tagged with protocol whose
// source or destination is ip's host prefix, or all of them when ip is
// the zero Addr. Idempotent.
func (c *Conn) RemoveTagged(f ruleset.Family, protocol uint8, ip netip.Addr) error {
	rules, err := c.h.RuleList(nlFamily(f))
	if errors.Is(err, unix.EAFNOSUPPORT) {
		return nil // a kernel without the family has none of its rules
	}
	if err != nil {
		return fmt.Errorf("list %s rules: %w", f, err)
	}
	var errs []error
	for _, r := range rules {
		if r.Protocol != protocol {
			continue
		}
		if ip.IsValid() {
			h := netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen())
			if prefix(r.Src) != h && prefix(r.Dst) != h {
				continue
			}
		}
		r := r
		if err := c.h.RuleDel(&r); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete %s rule pref %d lookup %d: %w", f, r.Priority, r.Table, err))
		}
	}
	return errors.Join(errs...)
}

// AddBranchENI puts the branch ENI probe path in place for the pod at ip
// in the namespace the calling thread is in (run it inside netns.Do): a
// no-op unless the node is prepared for branch ENI pods and ip is one.
// Reports whether the pod is a branch ENI pod.
func AddBranchENI(ip netip.Addr) (bool, error) {
	if !BranchENINode() {
		return false, nil
	}
	c, err := Dial(0)
	if err != nil {
		return false, err
	}
	defer c.Close()
	b, ok, err := c.FindBranchENI(ip)
	if err != nil || !ok {
		return false, err
	}
	if err := c.AddRules(ruleset.BranchENIRules(ip, b)); err != nil {
		return true, fmt.Errorf("branch ENI probe path of %s: %w", ip, err)
	}
	return true, nil
}

// RemoveBranchENI deletes the branch ENI probe path of the pod at ip, or of
// every pod when ip is the zero Addr, in the namespace the calling thread
// is in (run it inside netns.Do). It looks at the rules' tags, not at the
// node's setting, so a path added before the node changed still goes.
func RemoveBranchENI(ip netip.Addr) error {
	c, err := Dial(0)
	if err != nil {
		return err
	}
	defer c.Close()
	fams := ruleset.Families
	if ip.IsValid() {
		fams = []ruleset.Family{ipFamily(ip)}
	}
	var errs []error
	for _, f := range fams {
		errs = append(errs, c.RemoveTagged(f, ruleset.BranchENIProtocol, ip))
	}
	return errors.Join(errs...)
}
