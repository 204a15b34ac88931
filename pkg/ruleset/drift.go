package ruleset

import (
	"fmt"
	"strings"
)

// DriftKind says how the namespace differs from the desired state.
type DriftKind string

const (
	// DriftMissing: something we want is absent.
	DriftMissing DriftKind = "missing"
	// DriftExtra: something refers to our chains that we did not put there
	// (a duplicate jump, a stray rule in our chain, a chain we no longer want).
	DriftExtra DriftKind = "extra"
	// DriftChanged: the rule at a position differs from the one we want.
	DriftChanged DriftKind = "changed"
	// DriftMoved: a rule we want is present but at the wrong position.
	DriftMoved DriftKind = "moved"
)

// DriftItem is one difference. For rules, Want and Have hold the full
// "-A <chain> <spec>" text; Position is 1-based within the chain (the
// desired position for missing/changed/moved, the actual one for extra).
type DriftItem struct {
	Family   Family
	Kind     DriftKind
	Object   string // "table", "chain", "rule", "set", "ip rule", "route"
	Table    string // empty for routing
	Chain    string
	Position int
	Want     string
	Have     string
}

// String describes the item in one line.
func (d DriftItem) String() string {
	where := d.Family.String()
	if d.Table != "" {
		where += " " + d.Table
	}
	if d.Chain != "" && d.Object != "chain" {
		where += " " + d.Chain
	}
	obj := d.Object
	if d.Position > 0 {
		obj = fmt.Sprintf("%s #%d", obj, d.Position)
	}
	switch {
	case d.Object == "table":
		return fmt.Sprintf("%s: %s table", where, d.Kind)
	case d.Object == "chain":
		return fmt.Sprintf("%s: %s chain %s", where, d.Kind, d.Chain)
	case d.Kind == DriftChanged:
		return fmt.Sprintf("%s: changed %s: want %q, have %q", where, obj, d.Want, d.Have)
	case d.Kind == DriftExtra:
		return fmt.Sprintf("%s: extra %s %q", where, obj, d.Have)
	case d.Kind == DriftMoved:
		return fmt.Sprintf("%s: moved %s %q", where, obj, d.Want)
	default:
		return fmt.Sprintf("%s: missing %s %q", where, obj, d.Want)
	}
}

// Drift is the difference between a namespace and its desired rule set.
type Drift struct {
	Items []DriftItem
}

// Empty reports whether the namespace matches the desired state.
func (d Drift) Empty() bool { return len(d.Items) == 0 }

// String lists every item, one per line, or "no drift".
func (d Drift) String() string {
	if d.Empty() {
		return "no drift"
	}
	lines := make([]string, len(d.Items))
	for i, it := range d.Items {
		lines[i] = it.String()
	}
	return strings.Join(lines, "\n")
}

// DiffRules aligns want and have with a longest common subsequence and
// reports the gaps: paired gaps as changed, the rest as missing or extra,
// and a missing rule that also appears as extra as moved. proto gives every
// item its family, object, table and chain; Want and Have are the rules as
// "-A <chain> <rule>", or as bare text when proto.Object is "nft rule".
func DiffRules(proto DriftItem, want, have []string) []DriftItem {
	n, m := len(want), len(have)
	lcs := make([][]int, n+1)
	for i := range lcs {
		lcs[i] = make([]int, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if want[i] == have[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	type gap struct{ miss, extra []int }
	var gaps []gap
	var g gap
	flush := func() {
		if len(g.miss)+len(g.extra) > 0 {
			gaps = append(gaps, g)
		}
		g = gap{}
	}
	i, j := 0, 0
	for i < n || j < m {
		switch {
		case i < n && j < m && want[i] == have[j]:
			flush()
			i, j = i+1, j+1
		case j < m && (i == n || lcs[i][j+1] >= lcs[i+1][j]):
			g.extra = append(g.extra, j)
			j++
		default:
			g.miss = append(g.miss, i)
			i++
		}
	}
	flush()

	chain := proto.Chain
	full := func(spec string) string { return "-A " + chain + " " + spec }
	if proto.Object == "nft rule" {
		full = func(spec string) string { return spec }
	}
	var missing, extra, out []DriftItem
	for _, g := range gaps {
		k := min(len(g.miss), len(g.extra))
		for x := 0; x < k; x++ {
			it := proto
			it.Kind, it.Position = DriftChanged, g.miss[x]+1
			it.Want, it.Have = full(want[g.miss[x]]), full(have[g.extra[x]])
			out = append(out, it)
		}
		for _, w := range g.miss[k:] {
			it := proto
			it.Kind, it.Position, it.Want = DriftMissing, w+1, full(want[w])
			missing = append(missing, it)
		}
		for _, h := range g.extra[k:] {
			it := proto
			it.Kind, it.Position, it.Have = DriftExtra, h+1, full(have[h])
			extra = append(extra, it)
		}
	}
	for _, mi := range missing {
		for x, ex := range extra {
			if ex.Have == mi.Want {
				mi.Kind = DriftMoved
				extra = append(extra[:x], extra[x+1:]...)
				break
			}
		}
		out = append(out, mi)
	}
	return append(out, extra...)
}
