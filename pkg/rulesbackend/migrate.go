package rulesbackend

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// remnants is the other backend as the active one sees it.
type remnants interface {
	name() string
	// possible reports whether, by what the nftables backend saw at no
	// cost, the namespace may hold this backend's rules.
	possible(seen netfilter.Seen) bool
	// present reports whether the namespace holds the other backend's
	// rules.
	present(netnsPath string) (bool, error)
	// drift names them for Verify.
	drift() ruleset.DriftItem
	// removeRules deletes them, keeping the shared policy routes.
	removeRules(netnsPath string) error
	// inNFTables: its rules live in nf_tables, so they cannot have
	// appeared while the namespace's nf_tables generation stood still.
	inNFTables() bool
}

// migrating is the active backend plus cleanup of the others.
type migrating struct {
	log     *slog.Logger
	primary interface {
		ruleset.Applier
		RemoveRules(netnsPath string) error
	}
	others []remnants
}

// seer is a backend that reports what it saw of the others (nftables:
// from the namespace state and table list it reads anyway), so that the
// costlier checks run only where something may be left.
type seer interface {
	ApplySeeing(netnsPath string, cfg ruleset.PodConfig) (netfilter.Seen, error)
	VerifySeeing(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, netfilter.Seen, error)
	RemoveSeeing(netnsPath string) (netfilter.Seen, error)
}

// everything stands in for what a backend that does not report saw.
var everything = netfilter.Seen{IPTables: true, XTables: true}

// Apply implements Rules: the active backend's apply, then removal of
// rules another backend left in the pod. Capture holds throughout: both
// sets redirect to the same ports until the old one goes.
func (m *migrating) Apply(netnsPath string, cfg ruleset.PodConfig) error {
	seen := everything
	if s, ok := m.primary.(seer); ok {
		var err error
		if seen, err = s.ApplySeeing(netnsPath, cfg); err != nil {
			return err
		}
	} else if err := m.primary.Apply(netnsPath, cfg); err != nil {
		return err
	}
	return m.clear(netnsPath, seen)
}

func (m *migrating) clear(netnsPath string, seen netfilter.Seen) error {
	var errs []error
	for _, o := range m.others {
		if !o.possible(seen) {
			continue
		}
		ok, err := o.present(netnsPath)
		if err != nil {
			errs = append(errs, fmt.Errorf("look for %s rules: %w", o.name(), err))
			continue
		}
		if !ok {
			continue
		}
		if err := o.removeRules(netnsPath); err != nil {
			errs = append(errs, fmt.Errorf("remove %s rules: %w", o.name(), err))
			continue
		}
		m.log.Info("removed rules of another backend", "netns", netnsPath, "backend", o.name())
	}
	return errors.Join(errs...)
}

// Verify implements Rules: the active backend's drift, plus an extra item
// per other backend whose rules are still in the pod.
func (m *migrating) Verify(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, error) {
	seen := everything
	var d ruleset.Drift
	var err error
	if s, ok := m.primary.(seer); ok {
		d, seen, err = s.VerifySeeing(netnsPath, cfg)
	} else {
		d, err = m.primary.Verify(netnsPath, cfg)
	}
	if err != nil {
		return d, err
	}
	for _, o := range m.others {
		if !o.possible(seen) {
			continue
		}
		ok, err := o.present(netnsPath)
		if err != nil {
			return d, fmt.Errorf("look for %s rules: %w", o.name(), err)
		}
		if ok {
			d.Items = append(d.Items, o.drift())
		}
	}
	return d, nil
}

// VerifyGen implements ruleset.GenVerifier: Verify, where the active
// backend skips its netfilter read while the namespace's nf_tables
// generation stays gen, and so does the look for another backend's rules
// kept in nf_tables.
func (m *migrating) VerifyGen(netnsPath string, cfg ruleset.PodConfig, gen uint32) (ruleset.Drift, uint32, error) {
	seen := everything
	var d ruleset.Drift
	var now uint32
	var err error
	switch p := m.primary.(type) {
	case genSeer:
		d, seen, now, err = p.VerifySeeingGen(netnsPath, cfg, gen)
	case ruleset.GenVerifier:
		d, now, err = p.VerifyGen(netnsPath, cfg, gen)
	default:
		d, err = m.primary.Verify(netnsPath, cfg)
	}
	if err != nil {
		return d, 0, err
	}
	unchanged := gen != 0 && now == gen
	for _, o := range m.others {
		if !o.possible(seen) || (unchanged && o.inNFTables()) {
			continue
		}
		ok, err := o.present(netnsPath)
		if err != nil {
			return d, 0, fmt.Errorf("look for %s rules: %w", o.name(), err)
		}
		if ok {
			d.Items = append(d.Items, o.drift())
		}
	}
	return d, now, nil
}

// genSeer is a seer that also verifies by generation (nftables).
type genSeer interface {
	VerifySeeingGen(netnsPath string, cfg ruleset.PodConfig, gen uint32) (ruleset.Drift, netfilter.Seen, uint32, error)
}

// Remove implements Rules: every backend's rules and the policy routes.
func (m *migrating) Remove(netnsPath string) error {
	seen := everything
	if s, ok := m.primary.(seer); ok {
		var err error
		if seen, err = s.RemoveSeeing(netnsPath); err != nil {
			return err
		}
	} else if err := m.primary.Remove(netnsPath); err != nil {
		return err
	}
	return m.clear(netnsPath, seen)
}

// nftRemnants is the nftables backend seen from iptables.
type nftRemnants struct{ a *nftables.Applier }

func (nftRemnants) name() string                      { return "nftables" }
func (nftRemnants) possible(seen netfilter.Seen) bool { return true }
func (nftRemnants) present(netnsPath string) (bool, error) {
	return nftables.HasTables(netnsPath, nftables.PodTables)
}
func (nftRemnants) drift() ruleset.DriftItem {
	return ruleset.DriftItem{Kind: ruleset.DriftExtra, Object: "table", Table: "istio-ambient-* (nftables backend)"}
}
func (r nftRemnants) removeRules(netnsPath string) error { return r.a.RemoveRules(netnsPath) }
func (nftRemnants) inNFTables() bool                     { return true }

// iptRemnants is an iptables flavour seen from the other backends.
type iptRemnants struct {
	a            *iptables.Applier
	legacy       bool
	legacyLoaded bool
}

func (r iptRemnants) name() string { return "iptables-" + string(r.a.Backend()) }

func (r iptRemnants) possible(seen netfilter.Seen) bool {
	if r.legacy {
		return r.legacyLoaded && seen.XTables
	}
	return seen.IPTables
}

// present: iptables-nft chains show in nf_tables (one netlink dump);
// legacy ones only where the namespace has x_tables tables registered
// (x_tables registers them per namespace on first use), and then
// iptables-legacy-save tells.
func (r iptRemnants) present(netnsPath string) (bool, error) {
	if !r.legacy {
		return netfilter.HasChains(netnsPath, []string{iptables.ChainPrerouting, iptables.ChainOutput})
	}
	if !r.legacyLoaded {
		return false, nil
	}
	st, err := netns.StateOf(netnsPath)
	if err != nil || len(st.XTables) == 0 {
		return false, err
	}
	return r.a.HasRules(netnsPath)
}

func (r iptRemnants) drift() ruleset.DriftItem {
	return ruleset.DriftItem{Kind: ruleset.DriftExtra, Object: "chain", Chain: "ISTIO_* (" + r.name() + " backend)"}
}
func (r iptRemnants) removeRules(netnsPath string) error { return r.a.RemoveRules(netnsPath) }
func (r iptRemnants) inNFTables() bool                   { return !r.legacy }

// otherHost is another backend's host probe SNAT as the active one sees
// it. sharesSets: both are iptables flavours, which use the same ipsets.
type otherHost struct {
	p interface {
		Remove() error
		RemoveRules() error
		IPs() ([]netip.Addr, error)
	}
	sharesSets bool
}

// migratingHost is the active host probe plus removal of the others'.
type migratingHost struct {
	log *slog.Logger
	HostProbe
	others []otherHost
	mu     sync.Mutex
	clean  bool // the others' leftovers are gone, or no longer tried
	tries  int
}

// cleanupTries bounds the attempts to remove another backend's host probe
// SNAT: on a node where that backend cannot even run, trying every resync
// would only repeat the same warning.
const cleanupTries = 3

// Ensure installs the active backend's probe SNAT, then, until that has
// once succeeded, moves what another backend installed over: the members
// of its probe sets into the active ones (so kubelet probes of enrolled
// pods keep their SNAT through the switch), then its rules, and its sets
// unless the active backend uses them too.
func (m *migratingHost) Ensure() error {
	if err := m.HostProbe.Ensure(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.clean {
		return nil
	}
	var errs []error
	for _, o := range m.others {
		if o.sharesSets {
			errs = append(errs, o.p.RemoveRules())
			continue
		}
		ips, err := o.p.IPs()
		for _, ip := range ips {
			err = errors.Join(err, m.HostProbe.AddIP(ip))
		}
		if err != nil {
			errs = append(errs, err)
			continue // keep the old set until its members are over
		}
		errs = append(errs, o.p.Remove())
	}
	if err := errors.Join(errs...); err != nil {
		if m.tries++; m.tries < cleanupTries {
			m.log.Warn("could not remove another backend's host probe SNAT; retrying at the next resync", "err", err)
			return nil
		}
		m.log.Warn("could not remove another backend's host probe SNAT; giving up", "err", err, "tries", m.tries)
	}
	m.clean = true
	return nil
}

// Remove removes every backend's probe SNAT: all rules first, since a set
// cannot go while a rule uses it, then the sets, then the branch ENI pods'
// probe path.
func (m *migratingHost) Remove() error {
	var errs []error
	for _, o := range m.others {
		errs = append(errs, o.p.RemoveRules())
	}
	errs = append(errs, m.HostProbe.Remove())
	for _, o := range m.others {
		errs = append(errs, o.p.Remove())
	}
	errs = append(errs, m.HostProbe.RemoveBranchENI())
	return errors.Join(errs...)
}
