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
