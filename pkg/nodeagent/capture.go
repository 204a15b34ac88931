package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
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
//
// Like every way out, every way in is a plan, then its execution: the
// event and what the agent knows of the pod, read under the pod's lock,
// go to planCapture, and runCapture carries out its steps in order.
func (a *Agent) captureIfHeld(ctx context.Context, pod *corev1.Pod, ns *netns.Handle, sb *Sandbox, t *phaseTimer, held, resetZtunnel bool) error {
	if pod == nil || pod.UID == "" {
		_ = ns.Close()
		return errors.New("capture: pod without uid")
	}
	ev := capEnroll
	switch {
	case held:
		ev = capRecapture
	case sb != nil:
		ev = capAdd
	}
	own := t == nil
	if own {
		// The phases' durations, logged at debug level: the breakdown of
		// the capture's critical path (docs/performance.md).
		t = newPhaseTimer(a.log)
	}
	unlock := a.lock(pod.UID)
	defer unlock()
	c, f := a.arrival(pod, ns, sb, t)
	c.requestTimer = !own
	f.resetZtunnel = resetZtunnel
	if err := a.runCapture(ctx, c, planCapture(ev, f)); err != nil {
		return err
	}
	if own {
		t.log(c.log, captureTimings)
	}
	return nil
}

// capturing is the event a capture is planned for.
type capturing string

// The events.
const (
	// capAdd: a CNI ADD, which names the sandbox and its IPs.
	capAdd capturing = "CNI ADD"
	// capEnroll: the pod controller, or the verifier's search for pods
	// that should be captured and are not, found the pod running; its
	// IPs are its status's.
	capEnroll capturing = "enroll"
	// capRecapture: the verifier's repair of a pod it found drifted, in
	// the namespace the agent holds it in.
	capRecapture capturing = "recapture"
)

// captureFacts is what a capture's plan depends on, read under the pod's
// lock.
type captureFacts struct {
	// held: the agent holds the pod (or a capture of it is in flight);
	// unresolved: without its netns handle, since a restart.
	held, unresolved bool
	// ztunnel: the agent has a ztunnel to hand pods to; resetZtunnel:
	// a recapture asked that ztunnel drop the pod before the new Add.
	ztunnel, resetZtunnel bool
}

// The steps of a capture, each carried out by runCapture.
const (
	// stepStillHeld refuses (ErrNotHeld) a pod that moved on while the
	// recapture let go of its lock.
	stepStillHeld step = "check the pod is still held in the netns"
	// stepNotTorn refuses (Retryable) a namespace whose sandbox a CNI DEL
	// just tore down: a process lingers in it.
	stepNotTorn step = "refuse a netns a DEL tore down"
	// stepNotOthers refuses a namespace another live pod is held in.
	stepNotOthers step = "refuse another pod's netns"
	// stepWriteRecord writes the capture record, first: from the moment
	// rules may exist in the namespace, a crashed agent's successor knows
	// of the pod.
	stepWriteRecord step = "write the record"
	// stepHandoffStart hands a pod not held yet to ztunnel while its rules
	// go in (the entry in flight in its life first, so a ztunnel that
	// connects meanwhile finds the pod in its snapshot); stepHandoffWait
	// waits for that handoff's outcome.
	stepHandoffStart step = "hand to ztunnel while the rules go in"
	stepHandoffWait  step = "wait for the ztunnel handoff"
	// stepApply applies the rules; a failure undoes the handoff and what
	// the capture wrote, and ends it with a Retryable error.
	stepApply step = "apply rules"
	// stepEnterState makes the pod held by its new entry, through its
	// life's transition.
	stepEnterState step = "enter the state"
	// stepLetOldGo closes the handle the pod was held by and drops the
	// IPs only it had from the probe set.
	stepLetOldGo step = "let the old hold go"
	// stepProbeIPsAdd adds the pod's IPs to the host probe set.
	stepProbeIPsAdd step = "add probe-set IPs"
	// stepZtunnelAdd hands a held pod to ztunnel again (ztunnel replaces
	// the old netns on Add); stepZtunnelReAdd first has it drop the pod.
	stepZtunnelAdd   step = "ztunnel Add"
	stepZtunnelReAdd step = "ztunnel Del, then Add"
	// stepAck makes the pod enabled once ztunnel acked it.
	stepAck step = "ztunnel acked"
	// stepAnnotate queues the annotation enabled.
	stepAnnotate step = "annotate enabled"
)

// planCapture is the ordered list of steps event ev takes on a pod the
// agent knows as f. Pure, like planRemoval; TestPlanCapture holds each
// (event, facts) to its steps. A pod already held keeps the order rules,
// then handoff: a failed apply then leaves ztunnel serving it as before.
// One not held yet goes to ztunnel while its rules go in: the two are
// independent until the pod starts, which waits for both.
func planCapture(ev capturing, f captureFacts) []step {
	var s []step
	if ev == capRecapture {
		s = append(s, stepStillHeld)
	}
	if ev != capAdd {
		s = append(s, stepNotTorn)
	}
	s = append(s, stepNotOthers, stepWriteRecord)
	inFlight := f.ztunnel && !f.held
	if inFlight {
		s = append(s, stepHandoffStart)
	}
	s = append(s, stepApply, stepEnterState)
	if f.held {
		s = append(s, stepLetOldGo)
	}
	s = append(s, stepProbeIPsAdd)
	if f.held && f.unresolved {
		s = append(s, stepUnresolvedGone)
	}
	switch {
	case inFlight:
		s = append(s, stepHandoffWait)
	case f.ztunnel && f.resetZtunnel:
		s = append(s, stepZtunnelReAdd)
	case f.ztunnel:
		s = append(s, stepZtunnelAdd)
	}
	return append(s, stepAck, stepAnnotate)
}

// arriving is the pod a capture works on, as its steps need it.
type arriving struct {
	pod *corev1.Pod
	ns  *netns.Handle
	l   *podLife
	// old is the entry the pod was held by (nil if not held); e the one
	// it is to be held by; ips are e's.
	old, e *entry
	ips    []netip.Addr
	// prevRec is the pod's capture record before this capture, if hadRec.
	prevRec Record
	hadRec  bool
	// handoff is the in-flight handoff's outcome (stepHandoffStart);
	// acked is when ztunnel acked the pod (written before the send on
	// handoff).
	handoff chan error
	acked   time.Time
	// requestTimer is whether t is the request's (an ADD's): its start is
	// the ADD's arrival, for ztunnel's ack time (Config.OnAddAcked).
	requestTimer bool
	log          *slog.Logger
	t            *phaseTimer
}

// arrival reads what the agent knows of the pod a capture in ns (with
// sb, at an ADD) works on: the facts its plan depends on, and the entry
// it is to be held by. Called with the pod's lock held.
func (a *Agent) arrival(pod *corev1.Pod, ns *netns.Handle, sb *Sandbox, t *phaseTimer) (*arriving, captureFacts) {
	c := &arriving{pod: pod, ns: ns, t: t, log: a.log.With("pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID)}
	sandboxID, network, ips := "", "", enablement.PodIPs(pod)
	if sb != nil {
		sandboxID, network, ips = sb.ID, sb.Network, sb.IPs
	}
	a.mu.Lock()
	c.l = a.lifeLocked(pod.UID)
	c.old = c.l.entry
	a.mu.Unlock()
	c.prevRec, c.hadRec = a.records.get(pod.UID)
	if old := c.old; old != nil && old.ns.SameAs(ns) {
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
	c.ips = ips
	c.e = &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		SandboxID: sandboxID, Network: network, Netns: ns.Source(), NetnsID: ns.ID(), IPs: slices.Clone(ips),
		State: StatePending, Rules: a.ruleConfig(pod), Since: time.Now(),
	}}
	f := captureFacts{held: c.old != nil, unresolved: c.old != nil && c.old.Unresolved, ztunnel: a.cfg.Ztunnel != nil}
	return c, f
}

// runCapture carries out steps on the arriving pod c, in order. A step
// that fails ends the capture: the refusals and a failed record or apply
// close c's netns and leave the pod as it was; a failed ztunnel handoff
// leaves it captured and pending (the runtime retries the ADD). Called
// with the pod's lock held.
func (a *Agent) runCapture(ctx context.Context, c *arriving, steps []step) error {
	pod, ns, l, e, log := c.pod, c.ns, c.l, c.e, c.log
	for _, st := range steps {
		switch st {
		case stepStillHeld:
			if c.old == nil || !c.old.ns.SameAs(ns) {
				// The pod moved on while the lock was let go (released, or
				// captured in its new sandbox's namespace): ns may be kept
				// alive by this copy alone, and handing it to ztunnel would
				// blackhole the pod.
				_ = ns.Close()
				return fmt.Errorf("pod %s/%s is no longer held in netns %s: %w", pod.Namespace, pod.Name, ns.Source(), ErrNotHeld)
			}
		case stepNotTorn:
			if a.tornDown(ns, pod.UID) {
				// The controller found a namespace whose sandbox a CNI DEL
				// just tore down (a process lingers): the pod's next
				// sandbox comes through its own ADD.
				_ = ns.Close()
				return Retryable(fmt.Errorf("netns %s of pod %s/%s %w", ns.Source(), pod.Namespace, pod.Name, ErrSandboxTornDown))
			}
		case stepNotOthers:
			a.mu.Lock()
			holder := a.holderOf(ns, pod.UID)
			a.mu.Unlock()
			if holder != nil {
				// Handing it to ztunnel under this pod's uid would give
				// this pod the other pod's traffic and identity.
				_ = ns.Close()
				return invalid(fmt.Errorf("netns %s of pod %s/%s is the network namespace of live pod %s/%s (uid %s)",
					ns.Source(), pod.Namespace, pod.Name, holder.Namespace, holder.Name, holder.UID))
			}
			a.reportInvalidAnnotations(log, pod)
			c.t.lap("prepare")
		case stepWriteRecord:
			if err := a.records.write(e.record()); err != nil {
				_ = ns.Close()
				return Retryable(err)
			}
			c.t.lap("record")
		case stepHandoffStart:
			a.mu.Lock()
			l.entry = e
			a.mu.Unlock()
			c.handoff = make(chan error, 1)
			w := a.workload(e)
			go func() {
				zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
				defer cancel()
				err := a.cfg.Ztunnel.Add(zctx, w)
				c.acked = time.Now()
				c.handoff <- err
			}()
		case stepApply:
			if err := a.cfg.Rules.Apply(ns.Path(), e.Rules); err != nil {
				a.ruleError("apply")
				if c.handoff != nil {
					a.undoHandoff(log, l, e, <-c.handoff)
				}
				a.undoFailedApply(log, pod.UID, c.old, ns, c.prevRec, c.hadRec)
				_ = ns.Close()
				return Retryable(fmt.Errorf("apply in-pod rules in netns %s: %w", ns.Source(), err))
			}
			c.t.lap("rules")
		case stepEnterState:
			a.mu.Lock()
			if err := a.transit(l, evCapture, e); err == nil {
				l.sandboxGone = nil
				if e.snapshotAcked {
					_ = a.transit(l, evAck, nil)
				}
			}
			a.mu.Unlock()
		case stepLetOldGo:
			// Same netns: a repeated ADD. Another netns: the sandbox was
			// recreated; ztunnel replaces the old netns on Add.
			_ = c.old.ns.Close()
			a.dropProbeIPs(log, c.old.IPs, c.ips)
		case stepProbeIPsAdd:
			a.addProbeIPs(log, c.ips)
		case stepUnresolvedGone:
			a.unresolvedGone()
		case stepHandoffWait, stepZtunnelAdd, stepZtunnelReAdd:
			c.t.lap("probe")
			var err error
			if st == stepHandoffWait {
				err = <-c.handoff
			} else {
				zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
				if st == stepZtunnelReAdd {
					if derr := a.cfg.Ztunnel.Del(zctx, string(pod.UID)); derr != nil {
						log.Warn("ztunnel did not ack the Del before the new Add", "err", derr)
					}
				}
				err = a.cfg.Ztunnel.Add(zctx, a.workload(e))
				c.acked = time.Now()
				cancel()
			}
			if err != nil {
				// A snapshot may have acked the pod meanwhile.
				a.mu.Lock()
				if l.entry == e && l.state == statePending {
					_ = a.transit(l, evAckTimeout, nil)
				}
				state := e.State
				a.mu.Unlock()
				a.wantAnnotation(&e.EnrolledPod, state, nil)
				return Retryable(fmt.Errorf("hand pod %s/%s to ztunnel: %w", pod.Namespace, pod.Name, err))
			}
		case stepAck:
			if a.cfg.Ztunnel == nil {
				c.t.lap("probe")
			}
			c.t.lap("ztunnel")
			if c.requestTimer && a.cfg.Ztunnel != nil && a.cfg.OnAddAcked != nil {
				a.cfg.OnAddAcked(c.acked.Sub(c.t.begun))
			}
			a.mu.Lock()
			if l.entry == e && l.state == statePending {
				_ = a.transit(l, evAck, nil)
			}
			a.mu.Unlock()
		case stepAnnotate:
			a.wantAnnotation(&e.EnrolledPod, StateEnabled, nil)
		}
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
