package iptables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Host probe SNAT: kubelet's health probes come from sockets in the host
// network namespace. SNATing them to the probe address lets the in-pod
// rules tell them apart from other traffic (kube-proxy's, say) and let them
// reach the application directly. Only locally generated TCP to an
// enrolled pod IP is rewritten: forwarded traffic has no local socket.

// IPSets manages ipsets in a network namespace; NetlinkIPSets is the real
// one, tests of the control flow substitute a fake.
type IPSets interface {
	// EnsureSet creates a hash:ip set of family f unless it exists.
	EnsureSet(netnsPath, name string, f ruleset.Family) error
	// DestroySet deletes the set; a missing set is not an error.
	DestroySet(netnsPath, name string) error
	// AddIP adds ip; already present is not an error.
	AddIP(netnsPath, name string, ip netip.Addr) error
	// DelIP removes ip; already absent is not an error.
	DelIP(netnsPath, name string, ip netip.Addr) error
	// ListSet returns the members and whether the set exists.
	ListSet(netnsPath, name string) ([]netip.Addr, bool, error)
}

// WithIPSets replaces the ipset side of a HostProbe (tests use a fake).
func WithIPSets(s IPSets) Option { return func(a *Applier) { a.sets = s } }

// NetlinkIPSets implements IPSets over netlink in the target namespace.
type NetlinkIPSets struct{}

func isNoSet(err error) bool {
	return errors.Is(err, unix.ENOENT) || errors.Is(err, nl.IPSetError(nl.IPSET_ERR_PROTOCOL))
}

// EnsureSet implements IPSets.
func (NetlinkIPSets) EnsureSet(netnsPath, name string, f ruleset.Family) error {
	h, err := handle(netnsPath)
	if err != nil {
		return err
	}
	defer h.Close()
	// Without NLM_F_EXCL (Replace) an identical existing set is success.
	if err := h.IpsetCreate(name, "hash:ip", netlink.IpsetCreateOptions{Replace: true, Family: uint8(nlFamily(f))}); err != nil {
		return fmt.Errorf("create ipset %s: %w", name, err)
	}
	return nil
}

// DestroySet implements IPSets.
func (NetlinkIPSets) DestroySet(netnsPath, name string) error {
	h, err := handle(netnsPath)
	if err != nil {
		return err
	}
	defer h.Close()
	if err := h.IpsetDestroy(name); err != nil && !isNoSet(err) {
		return fmt.Errorf("destroy ipset %s: %w", name, err)
	}
	return nil
}

// AddIP implements IPSets.
func (NetlinkIPSets) AddIP(netnsPath, name string, ip netip.Addr) error {
	h, err := handle(netnsPath)
	if err != nil {
		return err
	}
	defer h.Close()
	if err := h.IpsetAdd(name, &netlink.IPSetEntry{IP: net.IP(ip.AsSlice()), Replace: true}); err != nil {
		return fmt.Errorf("add %s to ipset %s: %w", ip, name, err)
	}
	return nil
}

// DelIP implements IPSets.
func (NetlinkIPSets) DelIP(netnsPath, name string, ip netip.Addr) error {
	h, err := handle(netnsPath)
	if err != nil {
		return err
	}
	defer h.Close()
	// Without NLM_F_EXCL deleting an absent member is success.
	if err := h.IpsetDel(name, &netlink.IPSetEntry{IP: net.IP(ip.AsSlice()), Replace: true}); err != nil {
		return fmt.Errorf("delete %s from ipset %s: %w", ip, name, err)
	}
	return nil
}

// ListSet implements IPSets.
func (NetlinkIPSets) ListSet(netnsPath, name string) ([]netip.Addr, bool, error) {
	h, err := handle(netnsPath)
	if err != nil {
		return nil, false, err
	}
	defer h.Close()
	res, err := h.IpsetList(name)
	if err != nil {
		if isNoSet(err) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("list ipset %s: %w", name, err)
	}
	var out []netip.Addr
	for _, e := range res.Entries {
		if a, ok := netip.AddrFromSlice(e.IP); ok {
			out = append(out, a.Unmap())
		}
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out, true, nil
}

// Lacks implements the optional test of IPSets HostProbe.Lacks uses: one
// IPSET_CMD_TEST per address, so the cost does not grow with the set. A
// missing set lacks every address.
func (NetlinkIPSets) Lacks(netnsPath, name string, ips []netip.Addr) ([]netip.Addr, error) {
	h, err := handle(netnsPath)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	var out []netip.Addr
	for _, ip := range ips {
		ok, err := h.IpsetTest(name, &netlink.IPSetEntry{IP: net.IP(ip.AsSlice()), Replace: true})
		if err != nil && !isNoSet(err) {
			return nil, fmt.Errorf("test %s in ipset %s: %w", ip, name, err)
		}
		if !ok {
			out = append(out, ip)
		}
	}
	return out, nil
}

// HostProbe keeps the probe SNAT in one network namespace: the node's
// (netnsPath "") in production, a stand-in in tests. Ensure installs the
// sets and rule, AddIP/DelIP track enrolled pod IPs, Remove undoes it all.
// Safe for concurrent use.
type HostProbe struct {
	a     *Applier
	netns string
	cfg   ruleset.HostProbeConfig
	mu    sync.Mutex // serialises Ensure/Remove against each other
}

// NewHostProbe returns a HostProbe for the namespace at netnsPath ("" =
// the caller's) using backend b. Options are the Applier's, plus
// WithIPSets.
func NewHostProbe(log *slog.Logger, b Backend, netnsPath string, cfg ruleset.HostProbeConfig, opts ...Option) *HostProbe {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := NewApplier(log.With("part", "host-probe"), b, opts...)
	return &HostProbe{a: a, netns: netnsPath, cfg: cfg}
}

// Close waits for the netlink connections the HostProbe closes in the
// background (see Applier.Close); the rules stay.
func (h *HostProbe) Close() error { return h.a.Close() }

// desired returns the host probe rule sets of the families the namespace
// has enabled, and, when the options leave IPv6 alone on a host that has
// it, an empty IPv6 one, last: the desired state there is none of ours, so
// applying it removes what a previous configuration left. sets says which
// families get a probe set.
func (h *HostProbe) desired() (plans []*familyPlan, sets []ruleset.Family, stale bool, err error) {
	v6, err := h.a.router.State(h.netns)
	if err != nil {
		return nil, nil, false, err
	}
	sets = h.cfg.Families(v6.IPv6)
	for _, f := range sets {
		plans = append(plans, &familyPlan{f: f, rs: HostProbeRules(h.cfg, f)})
	}
	stale = h.cfg.IPv4Only && v6.IPv6
	if stale {
		plans = append(plans, &familyPlan{f: ruleset.IPv6, rs: Render(ruleset.RuleSet{Kind: ruleset.Host, Family: ruleset.IPv6})})
	}
	return plans, sets, stale, nil
}

// Ensure creates the ipsets and installs the SNAT rule (one
// iptables-restore per family, skipped when already in place; both
// families or neither), and puts the jump back at the top of POSTROUTING
// if another rule got above it. Existing set members are kept, so it is
// safe at every agent start and as a periodic resync.
func (h *HostProbe) Ensure() error {
	if err := h.cfg.Validate(); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	plans, sets, stale, err := h.desired()
	if err != nil {
		return err
	}
	ctx, cancel := h.a.bound(context.Background())
	defer cancel()
	for _, f := range sets {
		// The rule refers to the set, so the set comes first.
		if err := h.a.sets.EnsureSet(h.netns, ruleset.ProbeSet(f), f); err != nil {
			return fmt.Errorf("host probe %s: %w", f, err)
		}
	}
	err = each(plans, func(p *familyPlan) error {
		cur, err := h.a.save(ctx, h.netns, p.f)
		if err != nil {
			return err
		}
		p.cur, p.plan = cur, PlanApply(p.rs, cur)
		return nil
	})
	if err != nil {
		return err
	}
	if err := h.a.applyPlans(ctx, h.netns, plans, hostScope); err != nil {
		return err
	}
	if stale {
		p := plans[len(plans)-1]
		h.a.dropOwnedTables(h.netns, p.f, touchedTables(p.plan))
		// The IPv6 rule is gone, so the set can go; iptables of the other
		// flavour may still refer to it until its own removal, which
		// costs only an inert set.
		if err := h.a.sets.DestroySet(h.netns, ruleset.ProbeSetV6); err != nil {
			h.a.log.Debug("IPv6 probe set left in place", "err", err)
		}
	}
	return nil
}

// AddIP adds an enrolled pod IP to its family's set (idempotent). Call
// after the pod's rules are in place.
func (h *HostProbe) AddIP(ip netip.Addr) error {
	ip, f, err := ruleset.ProbeIP(ip)
	if err != nil {
		return err
	}
	if f == ruleset.IPv6 && h.cfg.IPv4Only {
		// No IPv6 probe SNAT: the pod's IPv6 is not captured, so kubelet's
		// IPv6 probes reach the app as they are.
		return nil
	}
	if err := h.a.sets.AddIP(h.netns, ruleset.ProbeSet(f), ip); err != nil {
		return err
	}
	return addBranchENI(h.netns, h.cfg, ip)
}

// DelIP removes a pod IP from its family's set (idempotent).
func (h *HostProbe) DelIP(ip netip.Addr) error {
	ip, f, err := ruleset.ProbeIP(ip)
	if err != nil {
		return err
	}
	if err := h.a.sets.DelIP(h.netns, ruleset.ProbeSet(f), ip); err != nil {
		return err
	}
	return removeBranchENI(h.netns, ip)
}

// RemoveBranchENI deletes the probe path of every branch ENI pod. Remove
// leaves it: the ip rules are the node's, not one backend's, and a switch
// of backends removes the old one's after the new one has added its own.
func (h *HostProbe) RemoveBranchENI() error { return removeBranchENI(h.netns, netip.Addr{}) }

// addBranchENI puts the probe path of the pod at ip in place if it is a
// branch ENI pod (pkg/policyroute.AddBranchENI) and cfg allows.
func addBranchENI(netnsPath string, cfg ruleset.HostProbeConfig, ip netip.Addr) error {
	if cfg.NoBranchENI {
		return nil
	}
	return netns.Do(netnsPath, func() error {
		_, err := policyroute.AddBranchENI(ip)
		return err
	})
}

// removeBranchENI deletes the probe path of the pod at ip (every pod's for
// the zero Addr), whatever cfg says now.
func removeBranchENI(netnsPath string, ip netip.Addr) error {
	return netns.Do(netnsPath, func() error { return policyroute.RemoveBranchENI(ip) })
}

// IPs lists the IPs in both sets, for reconciliation after a restart.
func (h *HostProbe) IPs() ([]netip.Addr, error) {
	var out []netip.Addr
	for _, f := range ruleset.Families {
		ips, _, err := h.a.sets.ListSet(h.netns, ruleset.ProbeSet(f))
		if err != nil {
			return nil, err
		}
		out = append(out, ips...)
	}
	return out, nil
}

// Lacks returns those of ips the probe sets lack: what the verifier asks
// for every pod it proves. Without listing the sets where the ipset side
// can test addresses one by one (NetlinkIPSets), so a proof costs the
// same on a node of 10 pods or 500.
func (h *HostProbe) Lacks(ips []netip.Addr) ([]netip.Addr, error) {
	tester, ok := h.a.sets.(interface {
		Lacks(netnsPath, name string, ips []netip.Addr) ([]netip.Addr, error)
	})
	var out []netip.Addr
	for _, f := range ruleset.Families {
		if f == ruleset.IPv6 && h.cfg.IPv4Only {
			continue // AddIP puts none there
		}
		var mine []netip.Addr
		for _, ip := range ips {
			if ip, fam, err := ruleset.ProbeIP(ip); err == nil && fam == f {
				mine = append(mine, ip)
			}
		}
		if len(mine) == 0 {
			continue
		}
		if ok {
			lack, err := tester.Lacks(h.netns, ruleset.ProbeSet(f), mine)
			if err != nil {
				return nil, err
			}
			out = append(out, lack...)
			continue
		}
		have, _, err := h.a.sets.ListSet(h.netns, ruleset.ProbeSet(f))
		if err != nil {
			return nil, err
		}
		for _, ip := range mine {
			if !slices.Contains(have, ip) {
				out = append(out, ip)
			}
		}
	}
	return out, nil
}

// Verify reports drift of the SNAT rule and missing sets.
func (h *HostProbe) Verify() (ruleset.Drift, error) {
	plans, sets, stale, err := h.desired()
	if err != nil {
		return ruleset.Drift{}, err
	}
	ctx, cancel := h.a.bound(context.Background())
	defer cancel()
	var d ruleset.Drift
	for _, p := range plans {
		cur, err := h.a.save(ctx, h.netns, p.f)
		if err != nil {
			return ruleset.Drift{}, err
		}
		d.Items = append(d.Items, p.rs.Diff(cur).Items...)
	}
	if stale {
		if _, ok, err := h.a.sets.ListSet(h.netns, ruleset.ProbeSetV6); err != nil {
			return ruleset.Drift{}, err
		} else if ok {
			d.Items = append(d.Items, ruleset.DriftItem{Family: ruleset.IPv6, Kind: ruleset.DriftExtra, Object: "ipset", Have: ruleset.ProbeSetV6})
		}
	}
	for _, f := range sets {
		if _, ok, err := h.a.sets.ListSet(h.netns, ruleset.ProbeSet(f)); err != nil {
			return ruleset.Drift{}, err
		} else if !ok {
			d.Items = append(d.Items, ruleset.DriftItem{Family: f, Kind: ruleset.DriftMissing, Object: "ipset", Want: ruleset.ProbeSet(f) + " hash:ip"})
		}
	}
	return d, nil
}

// Remove deletes the rule, its chain and the sets (with their members),
// leaving the namespace as before Ensure. With the nft backend a nat table
// that Ensure created is deleted too once empty (never one that was there
// before, see Applier.dropOwnedTables). Idempotent.
func (h *HostProbe) Remove() error { return h.remove(true) }

// RemoveRules deletes the rule and its chain but keeps the sets, which
// iptables of the other flavour uses too (ipsets are one per namespace).
func (h *HostProbe) RemoveRules() error { return h.remove(false) }

func (h *HostProbe) remove(sets bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	v6, err := h.a.router.State(h.netns)
	if err != nil {
		return err
	}
	ctx, cancel := h.a.bound(context.Background())
	defer cancel()
	for _, f := range ruleset.Families {
		cur, err := h.a.save(ctx, h.netns, f)
		if err != nil {
			if f == ruleset.IPv6 && !v6.IPv6 {
				continue
			}
			return err
		}
		if plan := planRemoveScope(hostScope, cur); plan != "" {
			if err := h.a.restore(ctx, h.netns, f, plan); err != nil {
				return err
			}
			h.a.dropOwnedTables(h.netns, f, touchedTables(plan))
		}
		if !sets {
			continue
		}
		// The rule is gone, so the kernel lets the set go.
		if err := h.a.sets.DestroySet(h.netns, ruleset.ProbeSet(f)); err != nil {
			return fmt.Errorf("host probe %s: %w", f, err)
		}
	}
	return nil
}
