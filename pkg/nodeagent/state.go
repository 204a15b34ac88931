package nodeagent

import (
	"slices"
	"sort"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// Pending reports whether uid is enrolled with its rules in place but not
// yet acknowledged by ztunnel, or known only by its capture record (a
// restart did not restore it): either way not fully captured.
func (a *Agent) Pending(uid types.UID) bool {
	a.mu.Lock()
	var st PodState
	if l := a.lives[uid]; l != nil && l.entry != nil {
		st = l.entry.State
	}
	a.mu.Unlock()
	if st != "" {
		return st == StatePending
	}
	_, recorded := a.records.get(uid)
	return recorded
}

// TableSizes is how many pods the agent knows, by what it knows of them:
// lives (every pod the agent knows, see podLife), and of those: state
// (held pods), locks, released, torn (namespaces), annotations_wanted,
// annotations_written, records. Exported as a gauge: each must return to
// its size once the pods it counted are gone.
func (a *Agent) TableSizes() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pruneTornLocked(time.Now())
	out := map[string]int{
		"lives": len(a.lives), "state": 0, "locks": 0, "released": 0, "torn": 0,
		"annotations_wanted": 0, "annotations_written": 0, "records": 0,
	}
	for _, l := range a.lives {
		if l.entry != nil {
			out["state"]++
		}
		if l.refs > 0 {
			out["locks"]++
		}
		if l.sandboxGone != nil {
			out["released"]++
		}
		out["torn"] += len(l.torn)
		if l.annotation.want != nil {
			out["annotations_wanted"]++
		}
		if l.annotation.hasWritten {
			out["annotations_written"]++
		}
		if l.record != nil || l.recordGen != 0 {
			out["records"]++
		}
	}
	return out
}

// StateCounts counts the enrolled pods per state (the redirection
// annotation's value), every state present, for the metrics.
func (a *Agent) StateCounts() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[string]int{string(StatePending): 0, string(StateEnabled): 0}
	for _, e := range a.entriesLocked() {
		out[string(e.State)]++
	}
	return out
}

// Pods returns a copy of the enrolled-pod state, sorted by namespace/name.
func (a *Agent) Pods() []EnrolledPod {
	a.mu.Lock()
	out := make([]EnrolledPod, 0, len(a.lives))
	for _, e := range a.entriesLocked() {
		p := e.EnrolledPod
		p.IPs = slices.Clone(p.IPs)
		out = append(out, p)
	}
	a.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out
}

// Pod returns uid's entry, if enrolled: one pod without copying them all
// (the verifier looks one up per proof).
func (a *Agent) Pod(uid types.UID) (EnrolledPod, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	l := a.lives[uid]
	if l == nil || l.entry == nil {
		return EnrolledPod{}, false
	}
	e := l.entry
	p := e.EnrolledPod
	p.IPs = slices.Clone(p.IPs)
	return p, true
}

// Workloads lists every enrolled pod, including those whose ztunnel Add is
// still in flight, for the ZDS snapshot (zds.Config.Snapshot). It never
// waits on enroll work.
func (a *Agent) Workloads() []zds.Workload {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]zds.Workload, 0, len(a.lives))
	for _, e := range a.entriesLocked() {
		out = append(out, a.workload(e))
	}
	return out
}

// Close releases every held netns handle; the rules and the capture
// records stay, so a restarted agent can restore the pods without
// touching their traffic.
func (a *Agent) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, l := range a.lives {
		if l.entry == nil {
			continue
		}
		_ = l.entry.ns.Close()
		if l.state.held() {
			_ = a.transit(l, evStop, nil)
		} else {
			l.entry = nil // a capture in flight, which fails on the closed handle
		}
		a.tidyLocked(l)
	}
	return nil
}

// Inspection is one enrolled pod as the agent holds it, with its rules
// verified at the time of the call.
type Inspection struct {
	EnrolledPod
	// Drift lists, one item per line, how the pod's rules differ from what
	// the agent applied; empty when they match.
	Drift []string
	// VerifyError says why the rules could not be read; empty otherwise.
	VerifyError string
}

// Inspect returns uid's entry with its rules verified now, after any
// capture or release in progress on it; ok is false when uid is not
// enrolled. It changes nothing.
func (a *Agent) Inspect(uid types.UID) (in Inspection, ok bool) {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return Inspection{}, false
	}
	a.mu.Lock()
	in.EnrolledPod = e.EnrolledPod
	in.IPs = slices.Clone(e.IPs)
	a.mu.Unlock()
	if e.ns == nil {
		in.VerifyError = "the pod's network namespace has not been found since the agent restarted (ztunnel keeps serving it)"
		return in, true
	}
	drift, err := a.verifyRules(e)
	switch {
	case err != nil:
		in.VerifyError = err.Error()
	case !drift.Empty():
		for _, it := range drift.Items {
			in.Drift = append(in.Drift, it.String())
		}
	}
	return in, true
}

// verifyRules verifies e's rules, without reading them again when the
// backend can tell nothing changed since they were last found in place:
// the verifier proves every pod on a period, and a full read per proof
// (two iptables-save runs with iptables) would cost the node a share of a
// core. Called with e's pod lock held.
func (a *Agent) verifyRules(e *entry) (ruleset.Drift, error) {
	gv, ok := a.cfg.Rules.(ruleset.GenVerifier)
	if !ok {
		return a.cfg.Rules.Verify(e.ns.Path(), e.Rules)
	}
	drift, gen, err := gv.VerifyGen(e.ns.Path(), e.Rules, e.verifiedGen)
	e.verifiedGen = 0
	if err == nil && drift.Empty() {
		e.verifiedGen = gen
	}
	return drift, err
}
