package iptables

import (
	"fmt"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// tableState is what one table holds of ours, computed from a save.
type tableState struct {
	// chains maps each of our chains present to its canonical rules.
	chains map[string][]string
	// jumps counts exact desired-form jumps per target chain.
	jumps map[string]int
	// refs are other rules referring to our chains (chain, spec), in order.
	refs [][2]string
	// dupJumps are surplus exact jumps (chain, spec), in order.
	dupJumps [][2]string
	// atTop tells, for chains whose jump must come first, whether the hook
	// chain's first rule is that exact jump.
	atTop map[string]bool
}

// reinsert reports whether the jump to a chain that must come first has
// to be rebuilt: present, but not alone at the top of its hook chain.
// Deleting by spec removes the first copy, so the plan deletes every copy
// and inserts one at 1.
func (st tableState) reinsert(sc *scope, chain string) bool {
	return sc.first[chain] && st.jumps[chain] > 0 && (!st.atTop[chain] || st.jumps[chain] > 1)
}

// scanTable collects our chains and every reference to them in t.
func scanTable(sc *scope, t *SavedTable, want map[string]bool) tableState {
	st := tableState{chains: map[string][]string{}, jumps: map[string]int{}, atTop: map[string]bool{}}
	if t == nil {
		return st
	}
	for _, c := range t.Chains {
		if sc.owns(c.Name) {
			rules := make([]string, len(c.Rules))
			for i, r := range c.Rules {
				rules[i] = r.Spec()
			}
			st.chains[c.Name] = rules
		}
	}
	for _, c := range t.Chains {
		if sc.owns(c.Name) {
			continue // their contents are compared or flushed as a whole
		}
		for i, r := range c.Rules {
			target := r.Target()
			if !sc.owns(target) {
				continue
			}
			spec := r.Spec()
			if want[target] && c.Name == sc.hook[target] && spec == jumpSpec(target) {
				st.atTop[target] = st.atTop[target] || i == 0
				st.jumps[target]++
				if st.jumps[target] > 1 {
					st.dupJumps = append(st.dupJumps, [2]string{c.Name, spec})
				}
				continue
			}
			st.refs = append(st.refs, [2]string{c.Name, spec})
		}
	}
	return st
}

// wanted returns the desired chains of table as name → canonical rules.
func (rs RuleSet) wanted(table string) map[string][]string {
	m := map[string][]string{}
	for _, t := range rs.Tables {
		if t.Name != table {
			continue
		}
		for _, c := range t.Chains {
			rules := make([]string, len(c.Rules))
			for i, r := range c.Rules {
				rules[i] = canonical(r)
			}
			m[c.Name] = rules
		}
	}
	return m
}

func keys(m map[string][]string) map[string]bool {
	k := make(map[string]bool, len(m))
	for n := range m {
		k[n] = true
	}
	return k
}

func equalRules(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Diff compares the iptables part of the desired rule set with a parsed
// save of the same family. Rules that do not involve our chains are ignored.
func (rs RuleSet) Diff(cur *Save) ruleset.Drift {
	var d ruleset.Drift
	sc := rs.sc()
	for _, table := range sc.tables {
		want := rs.wanted(table)
		st := scanTable(sc, cur.Table(table), keys(want))
		item := func(kind ruleset.DriftKind, obj, chain string) ruleset.DriftItem {
			return ruleset.DriftItem{Family: rs.Family, Kind: kind, Object: obj, Table: table, Chain: chain}
		}
		for _, name := range sc.chains {
			rules, wanted := want[name]
			have, present := st.chains[name]
			switch {
			case wanted && !present:
				d.Items = append(d.Items, item(ruleset.DriftMissing, "chain", name))
				for i, r := range rules {
					it := item(ruleset.DriftMissing, "rule", name)
					it.Position, it.Want = i+1, "-A "+name+" "+r
					d.Items = append(d.Items, it)
				}
			case wanted:
				d.Items = append(d.Items, ruleset.DiffRules(item(ruleset.DriftMissing, "rule", name), rules, have)...)
			case present:
				d.Items = append(d.Items, item(ruleset.DriftExtra, "chain", name))
			}
			if wanted && st.jumps[name] == 0 {
				it := item(ruleset.DriftMissing, "rule", sc.hook[name])
				it.Want = "-A " + sc.hook[name] + " " + jumpSpec(name)
				if sc.first[name] {
					it.Position = 1
				}
				d.Items = append(d.Items, it)
			}
			if wanted && sc.first[name] && st.jumps[name] > 0 && !st.atTop[name] {
				it := item(ruleset.DriftMoved, "rule", sc.hook[name])
				it.Position, it.Want = 1, "-A "+sc.hook[name]+" "+jumpSpec(name)
				d.Items = append(d.Items, it)
			}
		}
		for _, r := range st.dupJumps {
			it := item(ruleset.DriftExtra, "rule", r[0])
			it.Have = "-A " + r[0] + " " + r[1]
			d.Items = append(d.Items, it)
		}
		for _, r := range st.refs {
			it := item(ruleset.DriftExtra, "rule", r[0])
			it.Have = "-A " + r[0] + " " + r[1]
			d.Items = append(d.Items, it)
		}
	}
	return d
}

// PlanApply returns iptables-restore --noflush input that turns cur into the
// desired state, touching only our chains and references to them, or "" when
// cur already matches. Chains whose rules differ are rewritten whole, which
// is atomic within the restore transaction.
func PlanApply(desired RuleSet, cur *Save) string {
	var b strings.Builder
	sc := desired.sc()
	for _, table := range sc.tables {
		want := desired.wanted(table)
		st := scanTable(sc, cur.Table(table), keys(want))
		var decl, del, add, body, drop []string
		for _, name := range sc.chains {
			rules, wanted := want[name]
			have, present := st.chains[name]
			switch {
			case wanted && (!present || !equalRules(rules, have)):
				decl = append(decl, ":"+name+" - [0:0]")
				for _, r := range rules {
					body = append(body, "-A "+name+" "+r)
				}
			case !wanted && present:
				drop = append(drop, name)
			}
			switch {
			case wanted && st.reinsert(sc, name):
				for range st.jumps[name] {
					del = append(del, "-D "+sc.hook[name]+" "+jumpSpec(name))
				}
				add = append(add, sc.addJump(name))
			case wanted && st.jumps[name] == 0:
				add = append(add, sc.addJump(name))
			}
		}
		for _, r := range st.dupJumps {
			if target := strings.TrimPrefix(r[1], "-j "); !st.reinsert(sc, target) {
				del = append(del, "-D "+r[0]+" "+r[1])
			}
		}
		for _, r := range st.refs {
			del = append(del, "-D "+r[0]+" "+r[1])
		}
		if len(decl)+len(del)+len(add)+len(drop) == 0 {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", table)
		for _, l := range append(append(append(decl, del...), add...), body...) {
			b.WriteString(l + "\n")
		}
		for _, c := range drop {
			b.WriteString("-F " + c + "\n")
		}
		for _, c := range drop {
			b.WriteString("-X " + c + "\n")
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// PlanRemove returns iptables-restore --noflush input that deletes our
// in-pod chains and every rule referring to them, or "" when there is
// nothing.
func PlanRemove(cur *Save) string { return PlanApply(RuleSet{}, cur) }

// planRemoveScope is PlanRemove for any scope.
func planRemoveScope(sc *scope, cur *Save) string { return PlanApply(RuleSet{scope: sc}, cur) }

// touchedTables lists the tables a plan writes to.
func touchedTables(plan string) []string {
	var ts []string
	for _, l := range strings.Split(plan, "\n") {
		if strings.HasPrefix(l, "*") {
			ts = append(ts, l[1:])
		}
	}
	return ts
}

// planRevert returns iptables-restore --noflush input that turns what sc
// owns in after back into what it was in before: our chains with their
// rules, and every rule elsewhere that refers to them, each at its old
// position. It undoes a failed apply. Rules of others are not touched.
func planRevert(sc *scope, before, after *Save) string {
	var b strings.Builder
	for _, table := range sc.tables {
		bt, at := before.Table(table), after.Table(table)
		var decl, del, ins, body, drop []string
		for _, name := range sc.chains {
			bc, ac := bt.Chain(name), at.Chain(name)
			switch {
			case bc != nil:
				decl = append(decl, ":"+name+" - [0:0]")
				for _, r := range bc.Rules {
					body = append(body, "-A "+name+" "+r.Spec())
				}
			case ac != nil:
				drop = append(drop, name)
			}
		}
		// References now: all go. Then the old ones come back in order,
		// at their old positions among the other rules.
		if at != nil {
			for _, c := range at.Chains {
				if sc.owns(c.Name) {
					continue
				}
				for _, r := range c.Rules {
					if sc.owns(r.Target()) {
						del = append(del, "-D "+c.Name+" "+r.Spec())
					}
				}
			}
		}
		if bt != nil {
			for _, c := range bt.Chains {
				if sc.owns(c.Name) {
					continue
				}
				others := 0
				if ac := at.Chain(c.Name); ac != nil {
					for _, r := range ac.Rules {
						if !sc.owns(r.Target()) {
							others++
						}
					}
				}
				inserted := 0
				for i, r := range c.Rules {
					if !sc.owns(r.Target()) {
						continue
					}
					// Position i+1 as before, unless others' rules changed
					// meanwhile and the chain is now shorter.
					pos := min(i+1, others+inserted+1)
					ins = append(ins, fmt.Sprintf("-I %s %d %s", c.Name, pos, r.Spec()))
					inserted++
				}
			}
		}
		if len(decl)+len(del)+len(ins)+len(drop) == 0 {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", table)
		for _, l := range append(append(append(decl, del...), ins...), body...) {
			b.WriteString(l + "\n")
		}
		for _, c := range drop {
			b.WriteString("-F " + c + "\n")
		}
		for _, c := range drop {
			b.WriteString("-X " + c + "\n")
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}
