package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// Capture is the one way a pod gets captured, for the CNI path and the pod
// controller alike: capture record, in-pod rules, host probe set, ztunnel
// handoff (waits for the ack; for a pod not held yet it runs while the
// rules go in); the status annotation is then written
// asynchronously (see Run). ns is the pod's network namespace, held open:
// Capture owns it, keeps it in the state on success and closes it
// otherwise. sb is the sandbox at CNI ADD; nil (the controller, a
// repair) takes the IPs from the pod's status, except in the namespace
// the agent already holds the pod in, whose IPs it keeps. Idempotent; a
// failure that may pass is Retryable.
//
// A failed apply leaves nothing behind (no rules of ours in a namespace
// that had none, no record, no state). A failed ztunnel handoff leaves
// the pod captured and Pending (annotated pending): the runtime retries
// the ADD, and any ztunnel that connects meanwhile acks it in its
// snapshot, which makes it Enabled (SnapshotAcked).
func (a *Agent) Capture(ctx context.Context, pod *corev1.Pod, ns *netns.Handle, sb *Sandbox) error {
	return a.capture(ctx, pod, ns, sb, nil)
}

// capture is Capture; t, when not nil, is the timer of the request that
// asked for it (the event server's), which goes on timing the capture's
// phases and logs them with its own; nil times the capture alone.
func (a *Agent) capture(ctx context.Context, pod *corev1.Pod, ns *netns.Handle, sb *Sandbox, t *phaseTimer) error {
	return a.captureIfHeld(ctx, pod, ns, sb, t, false, false)
}

// captureIfHeld is capture. With held, the pod must still be held in ns
// once its lock is taken (Recapture: ns is a copy of the agent's hold,
// made before the lock was let go); otherwise ns is closed, nothing is
// done, and the error wraps ErrNotHeld. With resetZtunnel, a pod already
// held is dropped from ztunnel before it is handed over again, once its
// rules are in: a capture that fails before leaves ztunnel serving it as
// before.
func (a *Agent) captureIfHeld(ctx context.Context, pod *corev1.Pod, ns *netns.Handle, sb *Sandbox, t *phaseTimer, held, resetZtunnel bool) error {
	if pod == nil || pod.UID == "" {
		_ = ns.Close()
		return errors.New("capture: pod without uid")
	}
	sandboxID, network, ips := "", "", enablement.PodIPs(pod)
	if sb != nil {
		sandboxID, network, ips = sb.ID, sb.Network, sb.IPs
	}
	own := t == nil
	if own {
		// The phases' durations, logged at debug level: the breakdown of
		// the capture's critical path (docs/performance.md).
		t = newPhaseTimer(a.log)
	}
	unlock := a.lock(pod.UID)
	defer unlock()
	log := a.log.With("pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID)

	if held {
		if e := a.get(pod.UID); e == nil || !e.ns.SameAs(ns) {
			// The pod moved on while the lock was let go (released, or
			// captured in its new sandbox's namespace): ns may be kept
			// alive by this copy alone, and handing it to ztunnel would
			// blackhole the pod.
			_ = ns.Close()
			return fmt.Errorf("pod %s/%s is no longer held in netns %s: %w", pod.Namespace, pod.Name, ns.Source(), ErrNotHeld)
		}
	}
	if sb == nil && a.tornDown(ns, pod.UID) {
		// The controller found a namespace whose sandbox a CNI DEL just
		// tore down (a process lingers): the pod's next sandbox comes
		// through its own ADD.
		_ = ns.Close()
		return Retryable(fmt.Errorf("netns %s of pod %s/%s %w", ns.Source(), pod.Namespace, pod.Name, ErrSandboxTornDown))
	}
	a.mu.Lock()
	l := a.lifeLocked(pod.UID)
	old := l.entry
	holder := a.holderOf(ns, pod.UID)
	a.mu.Unlock()
	if holder != nil {
		// Handing it to ztunnel under this pod's uid would give this pod
		// the other pod's traffic and identity.
		_ = ns.Close()
		return invalid(fmt.Errorf("netns %s of pod %s/%s is the network namespace of live pod %s/%s (uid %s)",
			ns.Source(), pod.Namespace, pod.Name, holder.Namespace, holder.Name, holder.UID))
	}
	prevRec, hadRec := a.records.get(pod.UID)
	if old != nil && old.ns.SameAs(ns) {
		// The controller re-enrolling a pod the CNI path enrolled, or the
		// verifier's repair: the same sandbox, so the same IPs. Those the
		// agent holds came with its ADD; the status may still show the
		// previous sandbox's (kubelet's update not in the cache yet, or an
		// API-server outage froze it), and taking them would drop the
		// pod's own from the probe set.
		if sandboxID == "" {
			sandboxID, network = old.SandboxID, old.Network
		}
		if sb == nil && len(old.IPs) > 0 {
			ips = old.IPs
		}
	}
	cfg := a.ruleConfig(pod)
	a.reportInvalidAnnotations(log, pod)
	e := &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		SandboxID: sandboxID, Network: network, Netns: ns.Source(), NetnsID: ns.ID(), IPs: slices.Clone(ips),
		State: StatePending, Rules: cfg, Since: time.Now(),
	}}
	// The record goes first: from the moment rules may exist in the
	// namespace, a crashed agent's successor knows of the pod.
	t.lap("prepare")
	if err := a.records.write(e.record()); err != nil {
		_ = ns.Close()
		return Retryable(err)
	}
	t.lap("record")
	// A pod the agent does not hold yet goes to ztunnel while its rules go
	// in: the two are independent until the pod starts, which waits for
	// both, and ztunnel's ack (queued behind the other pods' on its
	// connection) no longer follows the rules' time. The entry is in the
	// life first, in flight, so a ztunnel that connects meanwhile finds the
	// pod in its snapshot. A pod already held (a repeated ADD, a recreated
	// sandbox) keeps the order rules, then handoff: a failed apply then
	// leaves ztunnel serving it as before.
	var handoff chan error
	var acked time.Time // when ztunnel acked; written before the send on handoff
	if a.cfg.Ztunnel != nil && old == nil {
		a.mu.Lock()
		l.entry = e
		a.mu.Unlock()
		handoff = make(chan error, 1)
		w := a.workload(e)
		go func() {
			zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
			defer cancel()
			err := a.cfg.Ztunnel.Add(zctx, w)
			acked = time.Now()
			handoff <- err
		}()
	}
	if err := a.cfg.Rules.Apply(ns.Path(), cfg); err != nil {
		a.ruleError("apply")
		if handoff != nil {
			a.undoHandoff(log, l, e, <-handoff)
		}
		a.undoFailedApply(log, pod.UID, old, ns, prevRec, hadRec)
		_ = ns.Close()
		return Retryable(fmt.Errorf("apply in-pod rules in netns %s: %w", ns.Source(), err))
	}
	t.lap("rules")
	a.mu.Lock()
	if err := a.transit(l, evCapture, e); err == nil {
		l.sandboxGone = nil
		if e.snapshotAcked {
			_ = a.transit(l, evAck, nil)
		}
	}
	a.mu.Unlock()
	if old != nil {
		// Same netns: a repeated ADD. Another netns: the sandbox was
		// recreated; ztunnel replaces the old netns on Add.
		_ = old.ns.Close()
		a.dropProbeIPs(log, old.IPs, ips)
	}
	a.addProbeIPs(log, ips)
	if old != nil && old.Unresolved {
		a.unresolvedGone()
	}
	t.lap("probe")

	if a.cfg.Ztunnel != nil {
		var err error
		if handoff != nil {
			err = <-handoff
		} else {
			zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
			if resetZtunnel {
				if derr := a.cfg.Ztunnel.Del(zctx, string(pod.UID)); derr != nil {
					log.Warn("ztunnel did not ack the Del before the new Add", "err", derr)
				}
			}
			err = a.cfg.Ztunnel.Add(zctx, a.workload(e))
			acked = time.Now()
			cancel()
		}
		if err != nil {
			// A snapshot may have acked the pod meanwhile.
			a.mu.Lock()
			if l.entry == e && l.state == statePending {
				_ = a.transit(l, evAckTimeout, nil)
			}
			st := e.State
			a.mu.Unlock()
			a.wantAnnotation(&e.EnrolledPod, st, nil)
			return Retryable(fmt.Errorf("hand pod %s/%s to ztunnel: %w", pod.Namespace, pod.Name, err))
		}
	}
	t.lap("ztunnel")
	if !own && a.cfg.Ztunnel != nil && a.cfg.OnAddAcked != nil {
		// The request's timer: an ADD's capture.
		a.cfg.OnAddAcked(acked.Sub(t.begun))
	}
	a.mu.Lock()
	if l.entry == e && l.state == statePending {
		_ = a.transit(l, evAck, nil)
	}
	a.mu.Unlock()
	a.wantAnnotation(&e.EnrolledPod, StateEnabled, nil)
	if own {
		t.log(log, captureTimings)
	}
	return nil
}

// captureTimings is the message of the debug-level line that breaks one
// capture into its phases; a CNI ADD's line also has the event server's.
const captureTimings = "capture timings"

// phaseTimer records how long each phase of a capture took, only while
// debug logging is on.
type phaseTimer struct {
	on       bool
	t0, last time.Time
	attrs    []any
	// begun is when the timer was made, at any log level: the ADD's
	// arrival for ztunnel's ack time (Config.OnAddAcked).
	begun time.Time
}

// newPhaseTimer starts timing now if log logs at debug level.
func newPhaseTimer(log *slog.Logger) *phaseTimer {
	t := &phaseTimer{on: log.Enabled(context.Background(), slog.LevelDebug), begun: time.Now()}
	if t.on {
		t.t0 = time.Now()
		t.last = t.t0
	}
	return t
}

// lap ends phase name. A nil timer times nothing.
func (t *phaseTimer) lap(name string) {
	if t == nil || !t.on {
		return
	}
	now := time.Now()
	t.attrs = append(t.attrs, name, now.Sub(t.last))
	t.last = now
}

// log writes the phases and their total at debug level.
func (t *phaseTimer) log(log *slog.Logger, msg string) {
	if t == nil || !t.on {
		return
	}
	log.Debug(msg, append(t.attrs, "total", t.last.Sub(t.t0))...)
}

// reportInvalidAnnotations says, in the log and as a Warning event on the
// pod, which of its annotations the capture ignores because they do not
// parse: silently applying the default would hide the typo.
func (a *Agent) reportInvalidAnnotations(log *slog.Logger, pod *corev1.Pod) {
	for _, msg := range enablement.InvalidAnnotations(pod) {
		log.Warn("ignoring invalid pod annotation", "problem", msg)
		if a.cfg.Events != nil {
			a.cfg.Events.Eventf(pod, corev1.EventTypeWarning, "AmbientInvalidAnnotation", "%s", msg)
		}
	}
}

// holderOf returns the enrolled pod other than uid that holds namespace
// ns, or nil. Only a pod holding a handle counts: a held namespace is
// alive, so its identity (nsfs device and inode) cannot have been reused,
// unlike a torn-down one's. Called with a.mu held.
func (a *Agent) holderOf(ns *netns.Handle, uid types.UID) *entry {
	id := ns.Identity()
	for u, e := range a.entriesLocked() {
		if u != uid && e.ns != nil && e.ns.Identity() == id {
			return e
		}
	}
	return nil
}

// undoHandoff takes back a pod handed to ztunnel while its rules went in,
// once the rules failed (addErr is the handoff's outcome): the entry in
// flight leaves l (whose state never changed), and ztunnel, which may
// have the pod even when the Add failed (a lost ack), is told to forget
// it. Called with the pod's lock held.
func (a *Agent) undoHandoff(log *slog.Logger, l *podLife, e *entry, addErr error) {
	a.mu.Lock()
	if l.entry == e {
		l.entry = nil
	}
	a.mu.Unlock()
	uid := string(e.UID)
	if addErr == nil {
		ctx, cancel := context.WithTimeout(context.Background(), a.cfg.ZtunnelTimeout)
		err := a.cfg.Ztunnel.Del(ctx, uid)
		cancel()
		if err == nil {
			return
		}
		log.Warn("take back from ztunnel a pod whose rules failed", "err", err)
	}
	if err := a.cfg.Ztunnel.DelNoWait(uid); err != nil {
		log.Warn("take back from ztunnel a pod whose rules failed", "err", err)
	}
}

// undoFailedApply leaves the pod as it was before a capture whose apply
// failed: a namespace the agent did not hold the pod in loses whatever the
// failed apply left, and the record is the previous capture's again (or
// gone). A pod restored without its netns (Unresolved) may have a previous
// agent's rules in ns, which is the namespace its record names or, with
// no record naming one, may be: those rules stay (removing them would
// release a pod ztunnel still serves), and so does a record naming ns.
// Called with the pod's lock held.
func (a *Agent) undoFailedApply(log *slog.Logger, uid types.UID, old *entry, ns *netns.Handle, prevRec Record, hadRec bool) {
	if old != nil && old.Unresolved {
		prevID := netns.Identity{Dev: prevRec.NetnsDev, Ino: prevRec.NetnsIno}
		if !hadRec || prevID == (netns.Identity{}) || prevID == ns.Identity() {
			if hadRec {
				_ = a.records.write(prevRec)
			}
			return
		}
		if err := a.cfg.Rules.Remove(ns.Path()); err != nil {
			a.ruleError("remove")
			log.Warn("remove what a failed apply left", "netns", ns.Source(), "err", err)
		}
		_ = a.records.write(prevRec)
		return
	}
	if old != nil && old.ns.SameAs(ns) {
		// A re-apply over the pod's own rules: the capture stands.
		_ = a.records.write(old.record())
		return
	}
	if err := a.cfg.Rules.Remove(ns.Path()); err != nil {
		a.ruleError("remove")
		log.Warn("remove what a failed apply left", "netns", ns.Source(), "err", err)
	}
	if old != nil {
		_ = a.records.write(old.record())
		return
	}
	if err := a.records.remove(uid); err != nil {
		log.Warn("remove capture record", "err", err)
	}
}

// ErrDrift is wrapped by Check's error when the in-pod rules differ from
// what the agent applied.
var ErrDrift = errors.New("in-pod rules drifted")

// Check is the CNI CHECK once decided (d): a pod that should be captured
// must be enrolled in this very namespace with its rules intact. p.UID
// names the pod. It takes ownership of ns.
func (a *Agent) Check(ctx context.Context, p PodInfo, d enablement.Decision, ns *netns.Handle) error {
	defer ns.Close()
	uid := p.UID
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		if d.Enroll {
			return mismatch(fmt.Errorf("pod %s/%s should be captured (%s) but is not enrolled", p.Namespace, p.Name, d.Reason))
		}
		return nil
	}
	if e.ns == nil {
		return mismatch(fmt.Errorf("pod %s/%s was restored without its netns after the agent restarted; its rules cannot be checked until it is found", p.Namespace, p.Name))
	}
	if !e.ns.SameAs(ns) {
		return mismatch(fmt.Errorf("pod %s/%s is enrolled in netns %s (inode %d), not %s", p.Namespace, p.Name, e.Netns, e.NetnsID, ns.Source()))
	}
	drift, err := a.cfg.Rules.Verify(e.ns.Path(), e.Rules)
	if err != nil {
		a.ruleError("verify")
		return Retryable(fmt.Errorf("verify rules of %s/%s: %w", p.Namespace, p.Name, err))
	}
	if !drift.Empty() {
		return mismatch(fmt.Errorf("%w in pod %s/%s: %s", ErrDrift, p.Namespace, p.Name, drift.String()))
	}
	return nil
}
