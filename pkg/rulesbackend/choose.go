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
	"strings"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
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

// Selection is a configured rules backend, parsed once (Parse): the
// choice and, for iptables, the flavour asked for ("" = the node's). The
// zero value is Auto.
type Selection struct {
	Choice  Choice
	Flavour iptables.Backend
}

// String renders the selection as Parse reads it.
func (s Selection) String() string {
	switch {
	case s.Flavour != "":
		return string(s.Flavour)
	case s.Choice == "":
		return string(Auto)
	}
	return string(s.Choice)
}

// Parse reads a configured value: "" or "auto", "nftables", "iptables",
// or an iptables flavour ("nft", "legacy"), which means iptables with that
// flavour. It is the one place the value is validated.
func Parse(s string) (Selection, error) {
	switch v := strings.ToLower(strings.TrimSpace(s)); v {
	case "", "auto":
		return Selection{Choice: Auto}, nil
	case "nftables":
		return Selection{Choice: NFTables}, nil
	case "iptables":
		return Selection{Choice: IPTables}, nil
	default:
		b, err := iptables.ParseBackend(v)
		if err != nil {
			return Selection{}, fmt.Errorf("unknown rules backend %q (want auto, nftables, iptables, nft or legacy)", s)
		}
		return Selection{Choice: IPTables, Flavour: b}, nil
	}
}

// HostProbe keeps the host's kubelet probe SNAT.
type HostProbe interface {
	Ensure() error
	Verify() (ruleset.Drift, error)
	Remove() error
	AddIP(ip netip.Addr) error
	DelIP(ip netip.Addr) error
	IPs() ([]netip.Addr, error)
	// Lacks returns those of ips the probe sets lack, without listing
	// them where it can (the verifier asks for every proof).
	Lacks(ips []netip.Addr) ([]netip.Addr, error)
	// RemoveBranchENI deletes the branch ENI pods' probe path, which
	// Remove leaves (it is the node's, not one backend's).
	RemoveBranchENI() error
}

// Config selects and configures a backend.
type Config struct {
	// Backend is the configured backend (see Parse).
	Backend Selection
	// HostNetns is the namespace of the host probe ("" = the caller's).
	HostNetns string
	// Probe holds the probe SNAT addresses.
	Probe ruleset.HostProbeConfig
	// Logger receives structured logs (default: discarded).
	Logger *slog.Logger
	// FollowIstioCNI: iptables with no flavour asked for takes the one
	// istio-cni's agent uses on the node, where its host chain shows it
	// (iptables.IstioCNIFlavour), before the node's own detection. Set
	// where the agent takes istio-cni's pods over and may give them back.
	FollowIstioCNI bool
}

// Backend is the chosen backend's rules and host probe.
type Backend struct {
	// Name says what was chosen: "nftables", "iptables-nft" or
	// "iptables-legacy".
	Name  string
	Rules ruleset.Applier
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
	choice, flavour := cfg.Backend.Choice, cfg.Backend.Flavour
	if choice == "" {
		choice = Auto
	}
	if flavour != "" && choice != IPTables {
		return nil, fmt.Errorf("rules backend %s takes no iptables flavour (%s)", choice, flavour)
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
	if choice == IPTables && flavour == "" && cfg.FollowIstioCNI {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if f, ok := iptables.IstioCNIFlavour(ctx); ok {
			log.Info("iptables flavour follows istio-cni's on the node", "flavour", f)
			flavour = f
		}
		cancel()
	}
	if choice == IPTables {
		b, err := iptables.DetectBackend(string(flavour))
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
