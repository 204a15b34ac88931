// Package ourrules checks and tampers with the agent's own capture rules of
// either backend inside a pod's namespace. It is apart from dataplanetest,
// which the backends' own tests import, because it imports the backends.
package ourrules

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
)

// NFTablesBackend is the name pkg/rulesbackend gives the nftables backend;
// the iptables ones are "iptables-" and the flavour.
const NFTablesBackend = "nftables"

// IPTablesFlavour is the iptables flavour of a backend name as
// pkg/rulesbackend gives it ("iptables-nft" is nft).
func IPTablesFlavour(t testing.TB, backend string) iptables.Backend {
	t.Helper()
	f, ok := strings.CutPrefix(backend, "iptables-")
	if !ok {
		t.Fatalf("rules backend %q is not an iptables flavour", backend)
	}
	return iptables.Backend(f)
}

// OurRules reports whether the namespace holds the agent's capture rules
// of either backend: our iptables chains (either flavour) or our nftables
// tables.
func OurRules(t testing.TB, netnsPath string) (ipt, nft bool) {
	t.Helper()
	nft, err := nftables.HasTables(netnsPath, nftables.PodTables)
	if err != nil {
		t.Fatalf("look for nftables tables: %v", err)
	}
	ours := []string{iptables.ChainPrerouting, iptables.ChainOutput}
	if ipt, err = netfilter.HasChains(netnsPath, ours); err != nil {
		t.Fatalf("look for iptables-nft chains: %v", err)
	}
	if !ipt {
		if _, err := exec.LookPath(iptables.BackendLegacy.SaveCmd(ruleset.IPv4)); err == nil {
			legacy := dataplanetest.Run(t, netnsPath, iptables.BackendLegacy.SaveCmd(ruleset.IPv4)) +
				dataplanetest.Run(t, netnsPath, iptables.BackendLegacy.SaveCmd(ruleset.IPv6))
			ipt = strings.Contains(legacy, ":"+iptables.ChainOutput+" ") || strings.Contains(legacy, ":"+iptables.ChainPrerouting+" ")
		}
	}
	return ipt, nft
}

// DeleteFirstOutputRule deletes by hand the first rule of the namespace's
// outbound capture chain in the named backend: drift for CHECK and the
// agent's repair to find.
func DeleteFirstOutputRule(t testing.TB, backend, netnsPath string) {
	t.Helper()
	if backend != NFTablesBackend {
		dataplanetest.Run(t, netnsPath, IPTablesFlavour(t, backend).Cmd(ruleset.IPv4), "-t", "nat", "-D", iptables.ChainOutput, "1")
		return
	}
	list := dataplanetest.Run(t, netnsPath, "nft", "-a", "list", "chain", "inet", nftables.TableNAT, "output")
	for l := range strings.SplitSeq(list, "\n") {
		l = strings.TrimSpace(l)
		if !strings.Contains(l, "# handle ") || strings.HasPrefix(l, "table ") || strings.HasPrefix(l, "chain ") {
			continue
		}
		_, h, _ := strings.Cut(l, "# handle ")
		dataplanetest.Run(t, netnsPath, "nft", "delete", "rule", "inet", nftables.TableNAT, "output", "handle", h)
		return
	}
	t.Fatalf("no rule in the pod's nat output chain:\n%s", list)
}
