package iptables

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"

	goipt "github.com/coreos/go-iptables/iptables"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Backend is the iptables flavour used in every namespace: the kernel's
// nf_tables through iptables-nft, or the legacy x_tables.
type Backend string

const (
	// BackendNFT drives nf_tables through iptables-nft.
	BackendNFT Backend = "nft"
	// BackendLegacy drives x_tables through iptables-legacy.
	BackendLegacy Backend = "legacy"
)

// ParseBackend accepts "nft" or "legacy" (also "iptables-nft" and
// "iptables-legacy").
func ParseBackend(s string) (Backend, error) {
	switch strings.TrimPrefix(strings.ToLower(strings.TrimSpace(s)), "iptables-") {
	case "nft", "nf_tables":
		return BackendNFT, nil
	case "legacy":
		return BackendLegacy, nil
	}
	return "", fmt.Errorf("unknown iptables backend %q (want nft or legacy)", s)
}

func (b Backend) bin(f ruleset.Family, suffix string) string {
	prefix := "iptables"
	if f == ruleset.IPv6 {
		prefix = "ip6tables"
	}
	return prefix + "-" + string(b) + suffix
}

// SaveCmd names the save binary for family f, e.g. "ip6tables-nft-save".
func (b Backend) SaveCmd(f ruleset.Family) string { return b.bin(f, "-save") }

// RestoreCmd names the restore binary for family f.
func (b Backend) RestoreCmd(f ruleset.Family) string { return b.bin(f, "-restore") }

// Cmd names the plain iptables binary for family f, e.g. "iptables-legacy".
func (b Backend) Cmd(f ruleset.Family) string { return b.bin(f, "") }

// DetectBackend picks the backend once, in the caller's network namespace
// (the node agent runs in the host's). A non-empty override ("nft" or
// "legacy") wins if its binaries work. Otherwise, with both flavours
// installed, it follows the node: the flavour holding kubelet's hint
// chains, else the one holding more rules, else the mode of the default
// `iptables` binary. go-iptables probes each binary and its version.
func DetectBackend(override string) (Backend, error) {
	if override != "" {
		b, err := ParseBackend(override)
		if err != nil {
			return "", err
		}
		if err := probeBackend(b); err != nil {
			return "", fmt.Errorf("iptables backend %s requested but unusable: %w", b, err)
		}
		return b, nil
	}
	var usable []Backend
	var errs []string
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		if err := probeBackend(b); err != nil {
			errs = append(errs, err.Error())
			continue
		}
		usable = append(usable, b)
	}
	switch len(usable) {
	case 0:
		return "", fmt.Errorf("no usable iptables backend: %s", strings.Join(errs, "; "))
	case 1:
		return usable[0], nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var st [2]nodeState
	for i, b := range usable {
		st[i] = inspectNode(ctx, b)
	}
	if choice, ok := chooseBackend(usable[0], st[0], usable[1], st[1]); ok {
		return choice, nil
	}
	return defaultMode(ctx)
}

// probeBackend checks that the iptables binary and both restore/save
// binaries of b exist and run.
func probeBackend(b Backend) error {
	ipt, err := goipt.New(goipt.Path(b.Cmd(ruleset.IPv4)))
	if err != nil {
		return fmt.Errorf("%s: %w", b.Cmd(ruleset.IPv4), err)
	}
	if v1, _, _ := ipt.GetIptablesVersion(); v1 < 1 {
		return fmt.Errorf("%s: unexpected version", b.Cmd(ruleset.IPv4))
	}
	for _, f := range ruleset.Families {
		for _, bin := range []string{b.SaveCmd(f), b.RestoreCmd(f)} {
			if _, err := exec.LookPath(bin); err != nil {
				return fmt.Errorf("%s: %w", bin, err)
			}
		}
	}
	return nil
}

// nodeState is what one backend shows in the caller's namespace.
type nodeState struct {
	hint  bool // kubelet's KUBE-IPTABLES-HINT or KUBE-KUBELET-CANARY chain
	rules int
}

// inspectNode reads both families' dumps.
func inspectNode(ctx context.Context, b Backend) nodeState {
	var st nodeState
	for _, f := range ruleset.Families {
		s, ok := nodeDump(ctx, b, f)
		if !ok {
			continue
		}
		for _, t := range s.Tables {
			for _, c := range t.Chains {
				if c.Name == "KUBE-IPTABLES-HINT" || c.Name == "KUBE-KUBELET-CANARY" {
					st.hint = true
				}
				st.rules += len(c.Rules)
			}
		}
	}
	return st
}

// nodeDump is flavour b's whole dump of family f in the caller's
// namespace. No -t: iptables-save never instantiates a table it lists
// unasked, while iptables-legacy-save loads the module of one it is asked
// for (and a legacy table that appears makes istio-cni, and the node's
// detection, choose legacy from then on); so looking changes nothing.
func nodeDump(ctx context.Context, b Backend, f ruleset.Family) (*Save, bool) {
	out, err := exec.CommandContext(ctx, b.SaveCmd(f)).Output()
	if err != nil {
		return nil, false
	}
	s, err := ParseSave(string(out))
	return s, err == nil
}

// IstioCNIHostChain is the chain istio-cni's agent puts in the host's nat
// table for its kubelet probe SNAT, in the flavour it writes every pod's
// rules in.
const IstioCNIHostChain = "ISTIO_POSTRT"

// IstioCNIFlavour reports the flavour istio-cni's agent uses on this node
// (the caller's namespace must be the host's): the one whose nat table
// holds its host chain. istio-cni picks its flavour with a rule of its
// own (legacy wherever iptables-legacy-save prints anything at all), so an
// agent taking its pods over follows the evidence rather than guess: with
// both in one flavour, istio-cni adopts our rules in place when the node
// is given back to it, and nothing of ours is left beside its own. False
// when neither flavour, or both, hold the chain.
func IstioCNIFlavour(ctx context.Context) (Backend, bool) {
	dumps := map[Backend]*Save{}
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		if s, ok := nodeDump(ctx, b, ruleset.IPv4); ok {
			dumps[b] = s
		}
	}
	return istioCNIFlavourIn(dumps)
}

// istioCNIFlavourIn is IstioCNIFlavour on each flavour's IPv4 dump.
func istioCNIFlavourIn(dumps map[Backend]*Save) (Backend, bool) {
	var found []Backend
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		if s := dumps[b]; s != nil {
			if t := s.Table("nat"); t != nil && t.Chain(IstioCNIHostChain) != nil {
				found = append(found, b)
			}
		}
	}
	if len(found) != 1 {
		return "", false
	}
	return found[0], true
}

// chooseBackend decides between two usable backends from what they show.
func chooseBackend(a Backend, sa nodeState, b Backend, sb nodeState) (Backend, bool) {
	switch {
	case sa.hint != sb.hint:
		if sa.hint {
			return a, true
		}
		return b, true
	case sa.rules != sb.rules:
		if sa.rules > sb.rules {
			return a, true
		}
		return b, true
	}
	return "", false
}

// defaultMode reports the mode of the `iptables` on PATH, which
// `iptables --version` prints as "(nf_tables)" or "(legacy)".
func defaultMode(ctx context.Context) (Backend, error) {
	out, err := exec.CommandContext(ctx, "iptables", "--version").Output()
	if err != nil {
		return "", fmt.Errorf("iptables --version: %w", err)
	}
	return modeFromVersion(string(out)), nil
}

// modeFromVersion maps `iptables --version` output to a backend; old
// versions without a mode are legacy.
func modeFromVersion(v string) Backend {
	if strings.Contains(v, "nf_tables") {
		return BackendNFT
	}
	return BackendLegacy
}
