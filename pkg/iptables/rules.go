// Package iptables renders the rule sets of pkg/ruleset to iptables-restore
// input, applies them inside a pod's network namespace (one
// iptables-restore --noflush transaction per address family plus the
// policy-routing rule and local route via netlink), reports drift, and
// removes exactly what it added.
//
// Everything lives in our own chains (ISTIO_PRERT, ISTIO_OUTPUT) reached by
// one jump from a built-in chain per table, so removal deletes only what this
// package created and never touches other rules in the namespace.
package iptables

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Our chain names, the same in every table that uses them. They match the
// names Istio's CNI agent uses, so a node moving between implementations
// never ends up with two competing sets of capture rules in one pod.
const (
	// ChainPrerouting holds our rules for packets entering the pod.
	ChainPrerouting = "ISTIO_PRERT"
	// ChainOutput holds our rules for packets the pod sends.
	ChainOutput = "ISTIO_OUTPUT"
	// ChainProbeSNAT holds the host's kubelet-probe SNAT rule (nat table,
	// jumped to from POSTROUTING).
	ChainProbeSNAT = "AMBIENT_PROBE_SNAT"
)

// Tables we write to, in the order they are rendered.
const (
	TableRaw    = string(ruleset.Raw)
	TableMangle = string(ruleset.Mangle)
	TableNAT    = string(ruleset.NAT)
)

// scope bounds what one kind of rule set may create or delete: its
// tables, its chains, and the built-in chain that jumps to each. Planning
// and removal never touch a chain outside the scope.
type scope struct {
	tables []string
	chains []string
	hook   map[string]string
	// first names chains whose jump must be the first rule of its hook
	// chain (inserted at 1, moved back there by every apply).
	first map[string]bool
}

func (s *scope) owns(chain string) bool {
	for _, c := range s.chains {
		if c == chain {
			return true
		}
	}
	return false
}

var (
	// podScope is what the in-pod rule set owns.
	podScope = &scope{
		tables: []string{TableRaw, TableMangle, TableNAT},
		chains: []string{ChainPrerouting, ChainOutput},
		hook:   map[string]string{ChainPrerouting: "PREROUTING", ChainOutput: "OUTPUT"},
	}
	// hostScope is what the host probe SNAT owns.
	// The probe SNAT jump goes first in POSTROUTING (Istio inserts it at
	// 1): a MASQUERADE or ACCEPT that other tools put earlier would
	// otherwise take kubelet's probes before they are SNATed.
	hostScope = &scope{
		tables: []string{TableNAT},
		chains: []string{ChainProbeSNAT},
		hook:   map[string]string{ChainProbeSNAT: "POSTROUTING"},
		first:  map[string]bool{ChainProbeSNAT: true},
	}
)

// isOurChain reports whether name is a chain this package owns anywhere.
func isOurChain(name string) bool { return podScope.owns(name) || hostScope.owns(name) }

// ChainRules is one of our chains with its rules in order. Each rule is the
// rule specification exactly as iptables-save prints it after "-A <chain> ",
// which makes comparison with a saved state a plain string comparison.
type ChainRules struct {
	Name  string
	Rules []string
}

// TableRules is what we want in one table.
type TableRules struct {
	Name   string
	Chains []ChainRules
}

// RuleSet is a ruleset.RuleSet rendered for iptables: our chains with
// their rules as iptables-save text, and, for pods, the policy route.
type RuleSet struct {
	Family  ruleset.Family
	Tables  []TableRules
	Routing ruleset.PolicyRoute
	// scope is what the set owns; nil means the in-pod scope.
	scope *scope
}

func (rs RuleSet) sc() *scope {
	if rs.scope == nil {
		return podScope
	}
	return rs.scope
}

// PodRules builds the desired iptables rules of family f for a pod from
// ruleset.PodRules. Pure. cfg should pass Validate.
func PodRules(cfg ruleset.PodConfig, f ruleset.Family) RuleSet {
	return Render(ruleset.PodRules(cfg, f))
}

// HostProbeRules builds the host's probe SNAT rules for family f (one chain
// in nat, jumped to from the top of POSTROUTING, with one rule) from
// ruleset.HostProbeRules. Pure.
func HostProbeRules(cfg ruleset.HostProbeConfig, f ruleset.Family) RuleSet {
	return Render(ruleset.HostProbeRules(cfg, f))
}

// chainName is our chain for hook h of a rule set of kind k.
func chainName(k ruleset.Kind, h ruleset.Hook) string {
	switch {
	case k == ruleset.Host:
		return ChainProbeSNAT
	case h == ruleset.Prerouting:
		return ChainPrerouting
	}
	return ChainOutput
}

// Render turns the model into iptables rules: one chain of ours per hook,
// each rule as iptables-save prints it.
func Render(m ruleset.RuleSet) RuleSet {
	rs := RuleSet{Family: m.Family, Routing: m.Routing}
	if m.Kind == ruleset.Host {
		rs.scope = hostScope
	}
	for _, c := range m.Chains {
		if len(rs.Tables) == 0 || rs.Tables[len(rs.Tables)-1].Name != string(c.Table) {
			rs.Tables = append(rs.Tables, TableRules{Name: string(c.Table)})
		}
		t := &rs.Tables[len(rs.Tables)-1]
		cr := ChainRules{Name: chainName(m.Kind, c.Hook)}
		for _, r := range c.Rules {
			cr.Rules = append(cr.Rules, Spec(r))
		}
		t.Chains = append(t.Chains, cr)
	}
	return rs
}

// not renders iptables' negation prefix.
func not(b bool) string {
	if b {
		return "! "
	}
	return ""
}

// markSpec renders value/mask in iptables' hex notation.
func markSpec(v, m uint32) string { return fmt.Sprintf("%#x/%#x", v, m) }

// hostPrefix renders a prefix the way iptables-save prints it.
func hostPrefix(p netip.Prefix) string { return p.String() }

// Spec renders one rule exactly as iptables-save prints it after
// "-A <chain> ": addresses, interfaces and protocol first, then each match
// module, then the target.
func Spec(r ruleset.Rule) string {
	var b []string
	add := func(format string, a ...any) { b = append(b, fmt.Sprintf(format, a...)) }
	if r.Src.IsSet() {
		add("%s-s %s", not(r.Src.Not), hostPrefix(r.Src.Prefix))
	}
	if r.Dst.IsSet() {
		add("%s-d %s", not(r.Dst.Not), hostPrefix(r.Dst.Prefix))
	}
	if r.In.IsSet() {
		add("%s-i %s", not(r.In.Not), r.In.Name)
	}
	if r.Out.IsSet() {
		add("%s-o %s", not(r.Out.Not), r.Out.Name)
	}
	if r.Proto != ruleset.AnyProto {
		add("-p %s", r.Proto)
	}
	if r.SPort.IsSet() || r.DPort.IsSet() {
		add("-m %s", r.Proto)
		if r.SPort.IsSet() {
			add("%s--sport %d", not(r.SPort.Not), r.SPort.Port)
		}
		if r.DPort.IsSet() {
			add("%s--dport %d", not(r.DPort.Not), r.DPort.Port)
		}
	}
	if r.Mark.IsSet() {
		add("-m mark %s--mark %s", not(r.Mark.Not), markSpec(r.Mark.Value, r.Mark.Mask))
	}
	if r.ConnMark.IsSet() {
		add("-m connmark %s--mark %s", not(r.ConnMark.Not), markSpec(r.ConnMark.Value, r.ConnMark.Mask))
	}
	if r.SocketExists {
		add("-m owner --socket-exists")
	}
	if r.DstSet != "" {
		add("-m set --match-set %s dst", r.DstSet)
	}
	switch a := r.Action; a.Kind {
	case ruleset.Return:
		add("-j RETURN")
	case ruleset.Redirect:
		add("-j REDIRECT --to-ports %d", a.Port)
	case ruleset.CTZone:
		add("-j CT --zone %d", a.Zone)
	case ruleset.SetConnMark:
		add("-j CONNMARK --set-xmark %s", markSpec(a.Value, a.Mask))
	case ruleset.RestoreMark:
		add("-j CONNMARK --restore-mark --nfmask %#x --ctmask %#x", ruleset.RestoreMask, ruleset.RestoreMask)
	case ruleset.SNAT:
		add("-j SNAT --to-source %s", a.To)
	default:
		panic(fmt.Sprintf("iptables: no rendering for action %d", a.Kind))
	}
	return strings.Join(b, " ")
}

// jumpSpec is the rule spec of the jump from a built-in chain to ours.
func jumpSpec(chain string) string { return "-j " + chain }

// addJump is the restore command that adds the jump to chain: appended, or
// inserted at 1 for a chain that must come first.
func (s *scope) addJump(chain string) string {
	if s.first[chain] {
		return "-I " + s.hook[chain] + " 1 " + jumpSpec(chain)
	}
	return "-A " + s.hook[chain] + " " + jumpSpec(chain)
}

// Render returns iptables-restore --noflush input that installs the rule set
// into a namespace that has none of our chains yet. The Applier does not use
// it directly: it plans against the namespace's current state so that
// re-applying never duplicates a jump (see PlanApply).
func (rs RuleSet) Render() string {
	var b strings.Builder
	for _, t := range rs.Tables {
		fmt.Fprintf(&b, "*%s\n", t.Name)
		for _, c := range t.Chains {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c.Name)
		}
		for _, c := range t.Chains {
			b.WriteString(rs.sc().addJump(c.Name) + "\n")
		}
		for _, c := range t.Chains {
			for _, r := range c.Rules {
				fmt.Fprintf(&b, "-A %s %s\n", c.Name, r)
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}
