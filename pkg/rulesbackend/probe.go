package rulesbackend

import (
	"os"
	"os/exec"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

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

func lookPath(bin string) (string, error) { return exec.LookPath(bin) }
