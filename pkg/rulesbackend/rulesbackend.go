// Package rulesbackend picks the backend that installs the capture rules,
// iptables (pkg/iptables) or native nftables (pkg/nftables), and moves pods
// and the host between them: the active backend's Apply, Verify and Remove
// also see and clear what the other one left (a pod enrolled by an agent
// configured the other way, say), so switching backends needs no manual
// cleanup and never leaves two sets of capture rules in a pod.
package rulesbackend

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Choice is the configured backend.
type Choice string

// The choices. An iptables flavour (nft, legacy) also selects iptables.
const (
	// Auto picks nftables when the kernel supports what the rules need,
	// else iptables.
	Auto Choice = "auto"
	// NFTables installs native nf_tables tables over netlink.
	NFTables Choice = "nftables"
	// IPTables runs iptables-restore, in the flavour the node uses.
	IPTables Choice = "iptables"
)

// Parse reads a configured value: "" or "auto", "nftables", "iptables",
// or an iptables flavour ("nft", "legacy"), which means iptables with that
// flavour.
func Parse(s string) (Choice, string, error) {
	switch v := strings.ToLower(strings.TrimSpace(s)); v {
	case "", "auto":
		return Auto, "", nil
	case "nftables":
		return NFTables, "", nil
	case "iptables":
		return IPTables, "", nil
	default:
		b, err := iptables.ParseBackend(v)
		if err != nil {
			return "", "", fmt.Errorf("unknown rules backend %q (want auto, nftables, iptables, nft or legacy)", s)
		}
		return IPTables, string(b), nil
	}
}

// Rules installs, verifies and removes one pod's rules (what the node
// agent's RuleApplier needs).
type Rules interface {
	Apply(netnsPath string, cfg ruleset.PodConfig) error
	Verify(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, error)
	Remove(netnsPath string) error
}

// HostProbe keeps the host's kubelet probe SNAT.
type HostProbe interface {
	Ensure() error
	Verify() (ruleset.Drift, error)
	Remove() error
	AddIP(ip netip.Addr) error
	DelIP(ip netip.Addr) error
	IPs() ([]netip.Addr, error)
}

// Config selects and configures a backend.
type Config struct {
	// Backend is the configured value (see Parse).
	Backend string
	// HostNetns is the namespace of the host probe ("" = the caller's).
	HostNetns string
	// Probe holds the probe SNAT addresses.
	Probe ruleset.HostProbeConfig
	// Logger receives structured logs (default: discarded).
	Logger *slog.Logger
}

// Backend is the chosen backend's rules and host probe.
type Backend struct {
	// Name says what was chosen: "nftables", "iptables-nft" or
	// "iptables-legacy".
	Name  string
	Rules Rules
	Probe HostProbe

	// closers are every applier and host probe New built, the active
	// backend's and the others'.
	closers []io.Closer
}

// Close releases what the backends hold once nobody uses Rules or Probe
// any more: it closes the nftables host probe's netlink connection and
// waits for the connections the appliers close in the background. The
// rules stay. A closed Backend still works (connections are dialled again
// on use), but its owner must close it again.
func (b *Backend) Close() error {
	var errs []error
	for _, c := range b.closers {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// New chooses the backend and builds it. With Auto it probes the kernel
// once, in a throwaway network namespace.
func New(cfg Config) (*Backend, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	choice, flavour, err := Parse(cfg.Backend)
	if err != nil {
		return nil, err
	}
	if choice == Auto {
		if err := ProbeNFTables(); err != nil {
			log.Info("nftables unusable, using iptables", "err", err)
			choice = IPTables
		} else {
			choice = NFTables
		}
	}
	// The iptables side is needed for NFTables too, to clear what an
	// iptables agent left; missing binaries then only disable that.
	var ipt []*iptables.Applier
	var iptHosts []*iptables.HostProbe
	var primaryIPT iptables.Backend
	if choice == IPTables {
		b, err := iptables.DetectBackend(flavour)
		if err != nil {
			return nil, fmt.Errorf("detect iptables backend: %w", err)
		}
		primaryIPT = b
	}
	for _, b := range []iptables.Backend{iptables.BackendNFT, iptables.BackendLegacy} {
		if b != primaryIPT && !iptablesUsable(b) {
			continue
		}
		a := iptables.NewApplier(log.With("component", "iptables"), b)
		h := iptables.NewHostProbe(log.With("component", "host-probe"), b, cfg.HostNetns, cfg.Probe)
		if b == primaryIPT {
			ipt, iptHosts = append([]*iptables.Applier{a}, ipt...), append([]*iptables.HostProbe{h}, iptHosts...)
		} else {
			ipt, iptHosts = append(ipt, a), append(iptHosts, h)
		}
	}
	nft := nftables.NewApplier(log)
	nftHost := nftables.NewHostProbe(log, cfg.HostNetns, cfg.Probe)
	legacyLoaded := legacyTablesLoaded()
	closers := []io.Closer{nft, nftHost}
	for i := range ipt {
		closers = append(closers, ipt[i], iptHosts[i])
	}

	if choice == NFTables {
		var others []remnants
		var hostOthers []otherHost
		for i, a := range ipt {
			others = append(others, iptRemnants{a: a, legacy: a.Backend() == iptables.BackendLegacy, legacyLoaded: legacyLoaded})
			hostOthers = append(hostOthers, otherHost{p: iptHosts[i]})
		}
		return &Backend{Name: "nftables",
			Rules:   &migrating{log: log, primary: nft, others: others},
			Probe:   &migratingHost{log: log, HostProbe: nftHost, others: hostOthers},
			closers: closers}, nil
	}
	primary := ipt[0]
	others := []remnants{nftRemnants{nft}}
	hostOthers := []otherHost{{p: nftHost}}
	for i, a := range ipt[1:] {
		others = append(others, iptRemnants{a: a, legacy: a.Backend() == iptables.BackendLegacy, legacyLoaded: legacyLoaded})
		hostOthers = append(hostOthers, otherHost{p: iptHosts[i+1], sharesSets: true})
	}
	return &Backend{Name: "iptables-" + string(primary.Backend()),
		Rules:   &migrating{log: log, primary: primary, others: others},
		Probe:   &migratingHost{log: log, HostProbe: iptHosts[0], others: hostOthers},
		closers: closers}, nil
}

// iptablesUsable reports whether b's binaries exist, without running them.
func iptablesUsable(b iptables.Backend) bool {
	for _, f := range ruleset.Families {
		for _, bin := range []string{b.SaveCmd(f), b.RestoreCmd(f)} {
			if _, err := lookPath(bin); err != nil {
				return false
			}
		}
	}
	return true
}

// legacyTablesLoaded reports whether x_tables (iptables-legacy) is in use on
// the node at all: without it no pod can hold legacy rules, and checking
// for them can be skipped.
func legacyTablesLoaded() bool {
	for _, p := range []string{"/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"} {
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	return false
}

// ProbeNFTables checks, in a throwaway network namespace, that the kernel
// accepts what the nftables backend installs (inet tables with nat, route
// and filter base chains, sets). It leaves nothing behind.
func ProbeNFTables() error {
	return netns.DoInNew(nftables.Probe)
}

// remnants is the other backend as the active one sees it.
type remnants interface {
	name() string
	// possible reports whether, by what the nftables backend saw at no
	// cost, the namespace may hold this backend's rules.
	possible(seen nftables.Others) bool
	// present reports whether the namespace holds the other backend's
	// rules.
	present(netnsPath string) (bool, error)
	// drift names them for Verify.
	drift() ruleset.DriftItem
	// removeRules deletes them, keeping the shared policy routes.
	removeRules(netnsPath string) error
}

// migrating is the active backend plus cleanup of the others.
type migrating struct {
	log     *slog.Logger
	primary interface {
		Rules
		RemoveRules(netnsPath string) error
	}
	others []remnants
}

// seer is a backend that reports what it saw of the others (nftables:
// from the namespace state and table list it reads anyway), so that the
// costlier checks run only where something may be left.
type seer interface {
	ApplySeeing(netnsPath string, cfg ruleset.PodConfig) (nftables.Others, error)
	VerifySeeing(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, nftables.Others, error)
	RemoveSeeing(netnsPath string) (nftables.Others, error)
}

// everything stands in for what a backend that does not report saw.
var everything = nftables.Others{IPTablesNFT: true, XTables: true}

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

func (m *migrating) clear(netnsPath string, seen nftables.Others) error {
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

func (nftRemnants) name() string                       { return "nftables" }
func (nftRemnants) possible(seen nftables.Others) bool { return true }
func (nftRemnants) present(netnsPath string) (bool, error) {
	return nftables.HasTables(netnsPath, nftables.PodTables)
}
func (nftRemnants) drift() ruleset.DriftItem {
	return ruleset.DriftItem{Kind: ruleset.DriftExtra, Object: "table", Table: "istio-ambient-* (nftables backend)"}
}
func (r nftRemnants) removeRules(netnsPath string) error { return r.a.RemoveRules(netnsPath) }

// iptRemnants is an iptables flavour seen from the other backends.
type iptRemnants struct {
	a            *iptables.Applier
	legacy       bool
	legacyLoaded bool
}

func (r iptRemnants) name() string { return "iptables-" + string(r.a.Backend()) }

func (r iptRemnants) possible(seen nftables.Others) bool {
	if r.legacy {
		return r.legacyLoaded && seen.XTables
	}
	return seen.IPTablesNFT
}

// present: iptables-nft chains show in nf_tables (one netlink dump);
// legacy ones only where the namespace has x_tables tables registered
// (x_tables registers them per namespace on first use), and then
// iptables-legacy-save tells.
func (r iptRemnants) present(netnsPath string) (bool, error) {
	if !r.legacy {
		return nftables.HasChains(netnsPath, []string{iptables.ChainPrerouting, iptables.ChainOutput})
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
// cannot go while a rule uses it, then the sets.
func (m *migratingHost) Remove() error {
	var errs []error
	for _, o := range m.others {
		errs = append(errs, o.p.RemoveRules())
	}
	errs = append(errs, m.HostProbe.Remove())
	for _, o := range m.others {
		errs = append(errs, o.p.Remove())
	}
	return errors.Join(errs...)
}

// KeepHostProbe runs p.Ensure every interval until ctx ends: it puts back
// what another tool removed and, with iptables, moves the SNAT jump back
// to the top of POSTROUTING when a rule got above it.
func KeepHostProbe(ctx context.Context, p HostProbe, every time.Duration, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := p.Ensure(); err != nil && log != nil {
				log.Warn("host probe SNAT resync failed", "err", err)
			}
		}
	}
}

func lookPath(bin string) (string, error) { return exec.LookPath(bin) }
