package nodeagent

import (
	"slices"
	"testing"
)

// TestPlanCapture holds every way in to its steps: for each event (CNI
// ADD, the controller's or verifier's enroll, the verifier's recapture),
// each life the pod may have (not held, held with its handle, held
// without it since a restart) and whether there is a ztunnel. The record
// always goes first; a pod not held yet goes to ztunnel while its rules
// go in; a held one keeps rules, then handoff.
func TestPlanCapture(t *testing.T) {
	zt := captureFacts{ztunnel: true}
	held := captureFacts{ztunnel: true, held: true}
	unresolved := captureFacts{ztunnel: true, held: true, unresolved: true}
	reset := func(f captureFacts) captureFacts { f.resetZtunnel = true; return f }
	cat := func(parts ...[]step) []step { return slices.Concat(parts...) }
	fresh := []step{stepWriteRecord, stepHandoffStart, stepApply, stepEnterState, stepProbeIPsAdd, stepHandoffWait, stepAck, stepAnnotate}
	again := []step{stepWriteRecord, stepApply, stepEnterState, stepLetOldGo, stepProbeIPsAdd, stepZtunnelAdd, stepAck, stepAnnotate}
	for _, c := range []struct {
		name string
		ev   capturing
		f    captureFacts
		want []step
	}{
		{"ADD, not held", capAdd, zt, cat([]step{stepNotOthers}, fresh)},
		{"ADD, held (a repeated ADD, a recreated sandbox)", capAdd, held, cat([]step{stepNotOthers}, again)},
		{"ADD, held without its netns", capAdd, unresolved, []step{stepNotOthers, stepWriteRecord, stepApply, stepEnterState,
			stepLetOldGo, stepProbeIPsAdd, stepUnresolvedGone, stepZtunnelAdd, stepAck, stepAnnotate}},
		{"ADD, no ztunnel", capAdd, captureFacts{}, []step{stepNotOthers, stepWriteRecord, stepApply, stepEnterState, stepProbeIPsAdd, stepAck, stepAnnotate}},
		{"enroll, not held", capEnroll, zt, cat([]step{stepNotTorn, stepNotOthers}, fresh)},
		{"enroll, held", capEnroll, held, cat([]step{stepNotTorn, stepNotOthers}, again)},
		{"enroll, not held, reset asked", capEnroll, reset(zt), cat([]step{stepNotTorn, stepNotOthers}, fresh)},
		{"recapture", capRecapture, held, cat([]step{stepStillHeld, stepNotTorn, stepNotOthers}, again)},
		{"recapture, ztunnel reset", capRecapture, reset(held), []step{stepStillHeld, stepNotTorn, stepNotOthers, stepWriteRecord,
			stepApply, stepEnterState, stepLetOldGo, stepProbeIPsAdd, stepZtunnelReAdd, stepAck, stepAnnotate}},
		{"recapture, no longer held", capRecapture, zt, cat([]step{stepStillHeld, stepNotTorn, stepNotOthers}, fresh)},
	} {
		if got := planCapture(c.ev, c.f); !slices.Equal(got, c.want) {
			t.Errorf("%s: planCapture(%q, %+v)\n got  %q\n want %q", c.name, c.ev, c.f, got, c.want)
		}
	}
}
