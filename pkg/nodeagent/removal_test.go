package nodeagent

import (
	"slices"
	"testing"
)

// TestPlanRemoval holds every way out to its steps, in the crash-safe
// orders of docs/reliability.md: for each event, each life the pod may
// have (held with its netns handle, held without it after a restart,
// known by its record alone, unknown) and each fact the event depends on.
func TestPlanRemoval(t *testing.T) {
	held := lifeFacts{held: true, handle: true, record: true}
	unresolved := lifeFacts{held: true, record: true}
	recorded := lifeFacts{record: true}
	with := func(f lifeFacts, set func(*lifeFacts)) lifeFacts { set(&f); return f }
	named := func(f *lifeFacts) { f.named = true }
	forget := []step{stepLeaveState, stepZtunnelDelNoWait, stepCloseHandle, stepProbeIPs, stepForgetAnnotation, stepRecord}
	cat := func(parts ...[]step) []step { return slices.Concat(parts...) }
	for _, c := range []struct {
		name string
		ev   removal
		f    lifeFacts
		want []step
	}{
		// A live CNI DEL: the rules go with the namespace, the annotation
		// stays; ztunnel, state, probe set, record go.
		{"DEL, held", rmDel, with(held, named), cat([]step{stepMarkTorn}, forget, []step{stepNoteReleased})},
		{"DEL, held, its netns still there", rmDel, with(held, func(f *lifeFacts) { f.named, f.delNetns, f.delNetnsHeld = true, true, true }),
			cat([]step{stepMarkTorn}, forget, []step{stepNoteReleased})},
		{"DEL, held, another sandbox", rmDel, held, nil},
		{"DEL, unresolved, netns gone", rmDel, with(unresolved, named), cat(forget, []step{stepUnresolvedGone, stepNoteReleased})},
		{"DEL, unresolved, netns there", rmDel, with(unresolved, func(f *lifeFacts) { f.named, f.delNetns = true, true }),
			cat([]step{stepMarkTorn}, forget, []step{stepUnresolvedGone, stepNoteReleased})},
		{"DEL, unresolved, another sandbox", rmDel, unresolved, nil},
		{"DEL, recorded", rmDel, with(recorded, named), []step{stepProbeIPs, stepRecord, stepNoteReleased}},
		{"DEL, recorded, another sandbox", rmDel, recorded, nil},
		{"DEL, unknown", rmDel, lifeFacts{}, nil},
		{"DEL, unknown, its netns there", rmDel, lifeFacts{delNetns: true}, nil},

		// A spooled DEL: the same, but a namespace the runtime left in
		// place loses our rules first.
		{"spooled DEL, held, its netns there", rmSpooledDel, with(held, func(f *lifeFacts) { f.named, f.delNetns, f.delNetnsHeld = true, true, true }),
			cat([]step{stepRulesTry, stepMarkTorn}, forget, []step{stepNoteReleased})},
		{"spooled DEL, held, its netns gone", rmSpooledDel, with(held, named), cat([]step{stepMarkTorn}, forget, []step{stepNoteReleased})},
		{"spooled DEL, held, the path names another netns", rmSpooledDel, with(held, func(f *lifeFacts) { f.named, f.delNetns = true, true }),
			cat([]step{stepMarkTorn}, forget, []step{stepNoteReleased})},
		{"spooled DEL, held, another sandbox", rmSpooledDel, with(held, func(f *lifeFacts) { f.delNetns, f.delNetnsHeld = true, true }), nil},
		{"spooled DEL, unresolved, netns gone", rmSpooledDel, with(unresolved, named),
			cat([]step{stepRulesAtDel}, forget, []step{stepUnresolvedGone, stepNoteReleased})},
		{"spooled DEL, unresolved, netns there", rmSpooledDel, with(unresolved, func(f *lifeFacts) { f.named, f.delNetns = true, true }),
			cat([]step{stepRulesAtDel, stepMarkTorn}, forget, []step{stepUnresolvedGone, stepNoteReleased})},
		{"spooled DEL, recorded", rmSpooledDel, with(recorded, named), []step{stepRulesAtRecord, stepProbeIPs, stepRecord, stepNoteReleased}},
		{"spooled DEL, recorded, another sandbox", rmSpooledDel, recorded, nil},
		{"spooled DEL, unknown", rmSpooledDel, lifeFacts{}, []step{stepRulesAtDel}},

		// Unenroll: rules first (a failure stops it), then the state and
		// ztunnel (waited for), the probe set, the annotation, the record
		// last; no API request for a pod being deleted.
		{"unenroll, held", rmUnenroll, held,
			[]step{stepRules, stepLeaveState, stepZtunnelDel, stepCloseHandle, stepProbeIPs, stepClearThenRecord}},
		{"unenroll, held, deleting", rmUnenroll, with(held, func(f *lifeFacts) { f.deleting = true }),
			[]step{stepRules, stepLeaveState, stepZtunnelDel, stepCloseHandle, stepProbeIPs, stepForgetAnnotation, stepRecord}},
		{"unenroll, unresolved", rmUnenroll, unresolved,
			[]step{stepRules, stepLeaveState, stepZtunnelDel, stepCloseHandle, stepProbeIPs, stepClearThenRecord, stepUnresolvedGone}},
		{"unenroll, recorded", rmUnenroll, recorded, []step{stepRulesAtRecord, stepProbeIPs, stepClearThenRecord}},
		{"unenroll, recorded, deleting", rmUnenroll, with(recorded, func(f *lifeFacts) { f.deleting = true }),
			[]step{stepRulesAtRecord, stepProbeIPs, stepForgetAnnotation, stepRecord}},
		{"unenroll, unknown", rmUnenroll, lifeFacts{}, nil},

		// Release at startup (not held; its netns handle given).
		{"release", rmRelease, lifeFacts{}, []step{stepRules, stepProbeIPs, stepClearThenRecord}},
		{"release, recorded", rmRelease, recorded, []step{stepRules, stepProbeIPs, stepClearThenRecord}},

		// Uninstall, once the annotations were cleared: rules (a failure
		// is reported, the pod goes regardless), then as a DEL.
		{"uninstall, held", rmUninstall, held, cat([]step{stepRulesTry}, forget)},
		{"uninstall, unresolved", rmUninstall, unresolved, cat([]step{stepRulesTry}, forget, []step{stepUnresolvedGone})},
		{"uninstall, recorded", rmUninstall, recorded, []step{stepRulesAtRecord, stepProbeIPs, stepForgetAnnotation, stepRecord}},
		{"uninstall, unknown", rmUninstall, lifeFacts{}, nil},
	} {
		if got := planRemoval(c.ev, c.f); !slices.Equal(got, c.want) {
			t.Errorf("%s: planRemoval(%q, %+v)\n got  %q\n want %q", c.name, c.ev, c.f, got, c.want)
		}
	}
}
