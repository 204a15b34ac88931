package nodeagent

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// Records lists the capture records a previous agent left, as loaded by
// LoadRecords, and those written since: the pods the agent may have left
// capture on. At startup they are restored together with the pods an
// older agent (one without records) annotated.
func (a *Agent) Records() []Record {
	return a.records.all()
}

// Restore adopts a pod captured before the agent restarted: it verifies the
// rules (re-applying only on drift) and puts the pod in the state the ZDS
// snapshot is built from, without a ztunnel Add of its own. It owns ns
// like Capture. The pod comes back Enabled if it is annotated so, else
// Pending (a previous agent crashed before ztunnel acked it or before the
// annotation was written); a Pending pod becomes Enabled, and is annotated
// so, as soon as a ztunnel acks it in its snapshot (SnapshotAcked).
func (a *Agent) Restore(ctx context.Context, pod *corev1.Pod, ns *netns.Handle) error {
	unlock := a.lock(pod.UID)
	defer unlock()
	cfg := a.ruleConfig(pod)
	drift, err := a.cfg.Rules.Verify(ns.Path(), cfg)
	if err != nil {
		a.ruleError("verify")
		_ = ns.Close()
		return Retryable(fmt.Errorf("verify rules of %s/%s: %w", pod.Namespace, pod.Name, err))
	}
	if !drift.Empty() {
		a.log.Warn("repairing drifted in-pod rules", "pod", pod.Namespace+"/"+pod.Name, "drift", drift.String())
		if err := a.cfg.Rules.Apply(ns.Path(), cfg); err != nil {
			a.ruleError("apply")
			_ = ns.Close()
			return Retryable(fmt.Errorf("repair rules of %s/%s: %w", pod.Namespace, pod.Name, err))
		}
		if a.cfg.OnDriftRepaired != nil {
			a.cfg.OnDriftRepaired()
		}
	}
	e := &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		Netns: ns.Source(), NetnsID: ns.ID(), IPs: enablement.PodIPs(pod), State: StatePending, Rules: cfg, Since: time.Now(),
	}}
	rec, recorded := a.records.get(pod.UID)
	if recorded && (netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}) == ns.Identity() {
		// The same sandbox the record names: keep its id (a later DEL
		// names it) and the runtime's path.
		e.SandboxID, e.Network, e.Netns = rec.SandboxID, rec.Network, rec.Netns
		if len(e.IPs) == 0 {
			e.IPs = rec.IPs
		}
	}
	a.mu.Lock()
	l := a.lifeLocked(pod.UID)
	old := l.entry
	if old != nil {
		e.SandboxID = old.SandboxID
	}
	a.restoreLocked(l, e, pod)
	a.mu.Unlock()
	if old != nil {
		_ = old.ns.Close()
	}
	if want := e.record(); !recorded || !sameRecord(rec, want) {
		// An older agent's pod (annotated, no record), or a sandbox the
		// record does not name: from now on the record knows it.
		if err := a.records.write(want); err != nil {
			a.log.Error("write capture record of a restored pod", "pod", pod.Namespace+"/"+pod.Name, "err", err)
		}
	}
	a.addProbeIPs(a.log, e.IPs)
	if old != nil && old.Unresolved {
		a.unresolvedGone()
	}
	return nil
}

// RestoreUnresolved adopts a pod a previous agent captured (it has a
// capture record, or carries the redirection annotation) whose netns
// cannot be found yet: its cgroup path did not match, its status lost its
// IPs in a kubelet restart, or its rules could not be verified. The pod
// enters the state without a netns, so every ZDS snapshot sends Keep for
// it and ztunnel goes on serving the netns it already has instead of
// dropping the pod (whose rules still redirect its traffic to ztunnel),
// and SyncHostProbe keeps whatever probe-set entries it has (none are
// added: its sandbox may be gone). Its rules are left untouched, and so is
// its capture record, which stays the source of truth across restarts:
// the sandbox id, netns path and IPs it names are taken from it (IPs only
// when the status has none). The pod stays unresolved until Capture or
// Restore hands over its netns, or Unenroll or a DEL removes it. A pod
// already in the state is left as it is.
func (a *Agent) RestoreUnresolved(pod *corev1.Pod) {
	unlock := a.lock(pod.UID)
	defer unlock()
	e := &entry{EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		IPs: enablement.PodIPs(pod), State: StatePending, Rules: a.ruleConfig(pod), Since: time.Now(), Unresolved: true,
	}}
	if rec, ok := a.records.get(pod.UID); ok {
		e.SandboxID, e.Network, e.Netns = rec.SandboxID, rec.Network, rec.Netns
		if len(e.IPs) == 0 {
			e.IPs = slices.Clone(rec.IPs)
		}
	}
	a.mu.Lock()
	l := a.lifeLocked(pod.UID)
	if l.entry != nil {
		a.mu.Unlock()
		return
	}
	a.restoreLocked(l, e, pod)
	a.mu.Unlock()
	a.log.Warn("restored a captured pod without its netns; ztunnel keeps it until the netns is found",
		"pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "ips", e.IPs, "recorded_netns", e.Netns)
}

// restoreLocked makes l held by e, restored: Pending, or Enabled when the
// pod is annotated so (a previous agent's ztunnel acked it). a.mu is held.
func (a *Agent) restoreLocked(l *podLife, e *entry, pod *corev1.Pod) {
	if a.transit(l, evRestore, e) != nil {
		return
	}
	if pod.Annotations[ambient.RedirectionAnnotation] == ambient.RedirectionEnabled {
		_ = a.transit(l, evAck, nil)
	}
}

// Unresolved reports whether uid was restored without its netns and has
// not been captured again since (see RestoreUnresolved).
func (a *Agent) Unresolved(uid types.UID) bool {
	e := a.get(uid)
	return e != nil && e.Unresolved
}

// SnapshotAcked is told (zds.Config.SnapshotAcked) that a ztunnel acked
// the Add of uid with netns in its snapshot: a Pending pod held in that
// very namespace becomes Enabled and is annotated so. This is what makes a
// pod whose ADD timed out waiting for ztunnel, or that a previous agent
// left pending, converge once a ztunnel is back.
func (a *Agent) SnapshotAcked(uid string, netns *os.File) {
	a.mu.Lock()
	l := a.lives[types.UID(uid)]
	if l == nil || l.entry == nil || l.entry.ns == nil || l.entry.ns.File() != netns {
		a.mu.Unlock()
		return
	}
	e := l.entry
	if !l.state.held() {
		// A capture in flight: it makes the pod enabled once its rules
		// are in. Annotating it now would mark a pod enabled whose rules
		// may yet fail.
		e.snapshotAcked = true
		a.mu.Unlock()
		return
	}
	if l.state != statePending || a.transit(l, evAck, nil) != nil {
		a.mu.Unlock()
		return
	}
	p := e.EnrolledPod
	a.mu.Unlock()
	a.log.Info("ztunnel acked a pending pod in its snapshot", "pod", p.Namespace+"/"+p.Name, "uid", uid)
	a.wantAnnotation(&p, StateEnabled, nil)
}
