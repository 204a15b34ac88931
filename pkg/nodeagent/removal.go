package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/netip"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// Every way out is a plan, then its execution: planRemoval, a pure
// function, turns an event and what the agent knows of the pod (its
// lifeFacts) into an ordered list of steps; runRemoval carries them out,
// in that order. The orders are the crash-safe ones of docs/reliability.md:
// whatever a crash interrupts, what is left (the record, the annotation,
// the spool entry) makes the next agent finish the job.

// removal is the event a removal is planned for.
type removal string

// The events.
const (
	// rmDel: a CNI DEL (live, or found by GC): the runtime is destroying
	// the namespace, so the rules go with it and the annotation stays.
	rmDel removal = "CNI DEL"
	// rmSpooledDel: a DEL the plugin spooled and the DEL queue replays:
	// the runtime has moved on, so a namespace still there is one it will
	// not destroy soon, and loses our rules first.
	rmSpooledDel removal = "spooled DEL"
	// rmUnenroll: the controller no longer wants the pod captured.
	rmUnenroll removal = "unenroll"
	// rmRelease: the startup Release of a pod captured before the restart
	// that is not wanted any more (not held; its netns handle given).
	rmRelease removal = "release"
	// rmUninstall: ReleaseAll's second pass, once the agent stopped (the
	// annotation was cleared in its first).
	rmUninstall removal = "uninstall"
)

// lifeFacts is what a removal's plan depends on, read under the pod's lock.
type lifeFacts struct {
	// held: the agent holds the pod (pending or enabled); handle: with
	// its netns handle (false for a pod restored without it, Unresolved).
	held, handle bool
	// record: a capture record of the pod exists.
	record bool
	// named: the DEL names the pod's current sandbox (DEL events only;
	// see delNames and delNamesRecord).
	named bool
	// delNetns: the DEL's netns path is still a namespace the agent may
	// open and identify; delNetnsHeld: the one the pod is held in.
	delNetns, delNetnsHeld bool
	// deleting: the pod cache knows the pod gone or being deleted, so
	// its annotation is not worth an API request.
	deleting bool
}

// step is one thing a removal does.
type step string

// The steps, each carried out by runRemoval.
const (
	// stepRules removes our rules from the pod's namespace: through its
	// netns handle, or, for a pod restored without it, from the namespace
	// its record names. A failure stops the removal (retried), except
	// that rules no namespace is known for cannot be reached.
	stepRules step = "remove rules"
	// stepRulesTry is stepRules whose failure is said and the removal
	// goes on.
	stepRulesTry step = "remove rules, go on if that fails"
	// stepRulesAtDel removes our rules by path from the DEL's namespace,
	// stepRulesAtRecord from the one the record names (see removeRulesAt).
	stepRulesAtDel    step = "remove rules at the DEL's netns"
	stepRulesAtRecord step = "remove rules at the record's netns"
	// stepMarkTorn notes the namespace the runtime tears down.
	stepMarkTorn step = "mark the netns torn"
	// stepLeaveState takes the pod out of the state (the ZDS snapshot
	// source) through its life's transition.
	stepLeaveState step = "leave the state"
	// stepZtunnelDel tells ztunnel and waits for its ack (bounded);
	// stepZtunnelDelNoWait queues the Del without waiting.
	stepZtunnelDel       step = "ztunnel Del"
	stepZtunnelDelNoWait step = "ztunnel Del, no wait"
	// stepCloseHandle closes the held netns handle.
	stepCloseHandle step = "close the netns handle"
	// stepProbeIPs drops the pod's IPs from the host probe set.
	stepProbeIPs step = "drop probe-set IPs"
	// stepForgetAnnotation drops any annotation write still wanted.
	stepForgetAnnotation step = "forget the annotation"
	// stepRecord removes the capture record.
	stepRecord step = "remove the record"
	// stepClearThenRecord clears the annotation, then (once written, or
	// the pod gone) removes the record.
	stepClearThenRecord step = "clear the annotation, then remove the record"
	// stepUnresolvedGone runs the probe-set prune an unresolved pod
	// deferred.
	stepUnresolvedGone step = "run the deferred probe-set prune"
	// stepNoteReleased remembers the runtime removed the pod's sandbox.
	stepNoteReleased step = "note the sandbox released"
)

// planRemoval is the ordered list of steps event ev takes on a pod the
// agent knows as f. Pure: every branch of every way out is here, and
// TestPlanRemoval holds each (event, facts) to its steps.
func planRemoval(ev removal, f lifeFacts) []step {
	var s []step
	add := func(more ...step) { s = append(s, more...) }
	switch ev {
	case rmDel, rmSpooledDel:
		spooled := ev == rmSpooledDel
		switch {
		case f.held && !f.named, !f.held && f.record && !f.named:
			// Another sandbox of the pod: its enrollment stays.
			return nil
		case f.held:
			if spooled && (!f.handle || f.delNetnsHeld) {
				// The namespace stays: do not leave our rules in it.
				if f.handle {
					add(stepRulesTry)
				} else {
					add(stepRulesAtDel)
				}
			}
			if f.handle || f.delNetns {
				add(stepMarkTorn)
			}
			add(stepLeaveState, stepZtunnelDelNoWait, stepCloseHandle, stepProbeIPs, stepForgetAnnotation, stepRecord)
			if !f.handle {
				add(stepUnresolvedGone)
			}
			add(stepNoteReleased)
		case f.record:
			if spooled {
				add(stepRulesAtRecord)
			}
			add(stepProbeIPs, stepRecord, stepNoteReleased)
		case spooled:
			add(stepRulesAtDel)
		}
	case rmUnenroll:
		switch {
		case f.held:
			add(stepRules, stepLeaveState, stepZtunnelDel, stepCloseHandle, stepProbeIPs)
		case f.record:
			add(stepRulesAtRecord, stepProbeIPs)
		default:
			return nil
		}
		if f.deleting {
			add(stepForgetAnnotation, stepRecord)
		} else {
			add(stepClearThenRecord)
		}
		if f.held && !f.handle {
			add(stepUnresolvedGone)
		}
	case rmRelease:
		add(stepRules, stepProbeIPs, stepClearThenRecord)
	case rmUninstall:
		switch {
		case f.held:
			add(stepRulesTry, stepLeaveState, stepZtunnelDelNoWait, stepCloseHandle, stepProbeIPs, stepForgetAnnotation, stepRecord)
			if !f.handle {
				add(stepUnresolvedGone)
			}
		case f.record:
			add(stepRulesAtRecord, stepProbeIPs, stepForgetAnnotation, stepRecord)
		}
	}
	return s
}

// leaving is the pod a removal works on, as its steps need it.
type leaving struct {
	uid             types.UID
	namespace, name string
	// e is the entry the pod is held by (nil if not held); ns its netns
	// handle, or the one Release was given.
	e  *entry
	ns *netns.Handle
	// rec is the pod's capture record, if hasRec.
	rec    Record
	hasRec bool
	// del is the DEL (DEL events); delID the identity of its namespace,
	// if delNetns.
	del      SandboxDel
	delID    netns.Identity
	delNetns bool
	// ips are the IPs to drop from the probe set.
	ips []netip.Addr
}

// runRemoval carries out steps on pod p for event ev, in order, and says
// so in the log. Every step is best effort but stepRules, whose failure
// ends the removal with a Retryable error; stepRulesTry's failure is
// returned once the others ran. Called with the pod's lock held (for a
// DEL of an unknown pod, there is no pod to lock).
func (a *Agent) runRemoval(ctx context.Context, ev removal, p *leaving, steps []step) error {
	log := a.log.With("pod", p.namespace+"/"+p.name, "uid", p.uid)
	if p.del.SandboxID != "" {
		log = log.With("sandbox", p.del.SandboxID)
	}
	var failed error
	for _, st := range steps {
		switch st {
		case stepRules, stepRulesTry:
			err := a.removeRules(log, p)
			switch {
			case err == nil:
			case st == stepRules && errors.Is(err, errNetnsUnknown):
				// Nothing to reach; the rest of the removal goes on.
			case st == stepRules:
				return Retryable(fmt.Errorf("remove rules of %s/%s: %w", p.namespace, p.name, err))
			case errors.Is(err, errNetnsUnknown):
				// Said, not hidden: the pod needs a restart to leave the mesh.
				failed = fmt.Errorf("remove rules of %s/%s: its network namespace was never found since the agent restarted; restart the pod", p.namespace, p.name)
			default:
				log.Warn("remove rules", "err", err)
				failed = fmt.Errorf("remove rules of %s/%s: %w", p.namespace, p.name, err)
			}
		case stepRulesAtDel:
			var want *netns.Identity
			if id, ok := recordedNetns(p.rec, p.hasRec); ok {
				want = &id
			}
			_ = a.removeRulesAt(log, p.del.Netns, want, p.uid)
		case stepRulesAtRecord:
			_ = a.removeRulesAt(log, p.rec.Netns, &netns.Identity{Dev: p.rec.NetnsDev, Ino: p.rec.NetnsIno}, p.uid)
		case stepMarkTorn:
			id := p.delID
			if p.ns != nil {
				id = p.ns.Identity()
			}
			a.markTorn(id, p.uid, p.ips)
		case stepLeaveState:
			lev := evUnenroll
			if ev == rmDel || ev == rmSpooledDel {
				lev = evDel
			}
			a.drop(p.e, lev)
		case stepZtunnelDel:
			if a.cfg.Ztunnel != nil {
				zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
				if err := a.cfg.Ztunnel.Del(zctx, string(p.uid)); err != nil {
					// A ztunnel that missed the Del drops the pod at its next snapshot.
					log.Warn("ztunnel del", "err", err)
				}
				cancel()
			}
		case stepZtunnelDelNoWait:
			if a.cfg.Ztunnel != nil {
				if err := a.cfg.Ztunnel.DelNoWait(string(p.uid)); err != nil {
					log.Warn("ztunnel del", "err", err)
				}
			}
		case stepCloseHandle:
			_ = p.ns.Close()
		case stepProbeIPs:
			a.dropProbeIPs(log, p.ips, nil)
		case stepForgetAnnotation:
			a.annotations.forget(p.uid)
		case stepRecord:
			if err := a.records.remove(p.uid); err != nil {
				log.Warn("remove capture record", "err", err)
			}
		case stepClearThenRecord:
			a.clearThenForget(p.namespace, p.name, p.uid)
		case stepUnresolvedGone:
			a.unresolvedGone()
		case stepNoteReleased:
			// The DEL's names for a pod known by its record alone (which
			// may be empty: GC's), the held entry's otherwise.
			namespace, name := p.del.Namespace, p.del.Name
			if p.e != nil {
				namespace, name = p.namespace, p.name
			}
			a.noteReleased(namespace, name, p.uid, p.ips)
		}
	}
	if len(steps) > 0 && (p.e != nil || p.hasRec || ev == rmRelease) {
		log.Info(removedMessage(ev, p.e != nil), "event", string(ev))
	}
	return failed
}

// removedMessage is the log line of a removal done.
func removedMessage(ev removal, held bool) string {
	switch {
	case ev == rmUnenroll && held:
		return "pod unenrolled"
	case ev == rmRelease:
		return "released a pod captured before the restart"
	case held:
		return "pod removed"
	}
	return "released a recorded pod the agent did not hold"
}

// errNetnsUnknown: a pod restored without its netns whose capture record
// names none (an older agent's pod): its rules cannot be reached.
var errNetnsUnknown = errors.New("the pod's network namespace is not known")

// removeRules removes our rules from p's namespace: through its handle,
// or, for a pod restored without its netns, from the namespace its
// capture record names if that still exists (see removeRulesAt; if it
// does not, neither do the rules).
func (a *Agent) removeRules(log *slog.Logger, p *leaving) error {
	if p.ns != nil {
		if err := a.cfg.Rules.Remove(p.ns.Path()); err != nil {
			a.ruleError("remove")
			return err
		}
		return nil
	}
	want, known := recordedNetns(p.rec, p.hasRec)
	if !known {
		return errNetnsUnknown
	}
	return a.removeRulesAt(log, p.rec.Netns, &want, p.uid)
}

// removeRulesAt removes our rules from the namespace at path, for a
// pod the agent does not hold a handle of: only a namespace that still
// exists, is the one expected (want, when known), and that no enrolled pod
// holds and no other pod's record names. A /proc/<pid>/ns/net path (the
// pid may have been reused) is only trusted with a known identity. It
// returns only the removal's own failure: a namespace that is gone or
// another one now has none of the pod's rules left to remove.
func (a *Agent) removeRulesAt(log *slog.Logger, path string, want *netns.Identity, uid types.UID) error {
	if path == "" || (want == nil && strings.HasPrefix(path, "/proc/")) {
		return nil
	}
	ns, err := a.cfg.Netns.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrPermission) {
			// The agent's own rights, not a namespace torn down: rules
			// may be left behind, so say so where an operator looks.
			log.Warn("cannot open the namespace to remove rules", "netns", path, "err", err)
		} else {
			log.Debug("namespace gone; no rules to remove", "netns", path, "err", err)
		}
		return nil
	}
	defer ns.Close()
	id := ns.Identity()
	if want != nil && id != *want {
		log.Debug("path names another namespace now; left alone", "netns", path)
		return nil
	}
	if a.heldElsewhere(id, uid) {
		log.Info("namespace belongs to another captured pod; left alone", "netns", path)
		return nil
	}
	if err := a.cfg.Rules.Remove(ns.Path()); err != nil {
		a.ruleError("remove")
		log.Warn("remove rules by path", "netns", path, "err", err)
		return err
	}
	log.Info("removed rules from the namespace of a pod the agent did not hold", "netns", path)
	return nil
}

// drop lets go of e, the entry its pod is held by, through ev (unenroll,
// CNI DEL): the pod leaves the state (the ZDS snapshot source). Called
// with the pod's lock held.
func (a *Agent) drop(e *entry, ev lifeEvent) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if l := a.lives[e.UID]; l != nil && l.entry == e {
		_ = a.transit(l, ev, nil)
	}
}

// clearThenForget removes the pod's annotation and, once that is done (or
// the pod is gone), its record: the last two steps of every removal that
// leaves a pod living on. Called with the pod's lock held.
func (a *Agent) clearThenForget(namespace, name string, uid types.UID) {
	gen := a.records.generation(uid)
	a.annotations.set(namespace, name, uid, "", func() {
		if err := a.records.removeIf(uid, gen); err != nil {
			a.log.Warn("remove capture record", "uid", uid, "err", err)
		}
	})
}

// noteReleased records that the runtime removed uid's captured sandbox,
// unless the pod cache already knows the pod's object gone. The cache is
// asked with a.mu held: PodGone, which drops the mark, then has run or
// runs next (the cache holds the deletion before it tells, and PodGone
// waits for a.mu), and a mark made after it would stay for releasedTTL: a
// DEL often comes after the object is gone.
func (a *Agent) noteReleased(namespace, name string, uid types.UID, ips []netip.Addr) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.noteReleasedLocked(uid, ips, a.podObjectGone(namespace, name, uid))
}

// The facts a plan is made from.

// delFacts reads what a DEL's (ev's) plan depends on, for pod uid (held by e,
// nil if not; its record rec, if hasRec). Called with the pod's lock held.
func (a *Agent) delFacts(ev removal, uid types.UID, e *entry, rec Record, hasRec bool, d SandboxDel) (lifeFacts, *leaving) {
	p := &leaving{uid: uid, namespace: d.Namespace, name: d.Name, e: e, rec: rec, hasRec: hasRec, del: d}
	// The DEL's namespace is looked at only where the plan depends on it:
	// a live DEL of a pod captured at its ADD (the common one) needs not.
	if ev == rmSpooledDel || (e != nil && (e.SandboxID == "" || e.ns == nil)) || (e == nil && hasRec && rec.SandboxID == "") {
		p.delID, p.delNetns = a.netnsIdentity(d.Netns)
	}
	f := lifeFacts{held: e != nil, record: hasRec, delNetns: p.delNetns}
	switch {
	case e != nil:
		p.namespace, p.name, p.ns, p.ips = e.Namespace, e.Name, e.ns, e.IPs
		f.handle = e.ns != nil
		f.named = a.delNames(e, p)
		f.delNetnsHeld = f.handle && p.delNetns && p.delID == e.ns.Identity()
	case hasRec:
		p.ips = rec.IPs
		recID := netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}
		// The recorded sandbox, or (a pod the controller captured) the
		// recorded namespace when the DEL's can be told.
		f.named = (rec.SandboxID == "" || rec.SandboxID == d.SandboxID) &&
			!(p.delNetns && rec.SandboxID == "" && p.delID != recID)
	}
	return f, p
}

// delNames reports whether a DEL (p.del) names the sandbox e is enrolled
// in: its sandbox id when it has one; otherwise (a pod the controller
// captured) its namespace, held or (restored without it) recorded, when
// the DEL's can be told; when not, only if the pod itself is going.
func (a *Agent) delNames(e *entry, p *leaving) bool {
	if e.SandboxID != "" {
		return e.SandboxID == p.del.SandboxID
	}
	held, known := netns.Identity{}, e.ns != nil
	if known {
		held = e.ns.Identity()
	} else {
		held, known = recordedNetns(p.rec, p.hasRec)
	}
	if p.delNetns && known {
		return p.delID == held
	}
	return a.podGoing(e.Namespace, e.Name, e.UID)
}

// podDeleting reports whether the pod cache knows the pod is gone (no pod
// with this uid under the name) or being deleted: its annotation is not
// worth an API request. Without a cache nothing is known.
func (a *Agent) podDeleting(namespace, name string, uid types.UID) bool {
	p, gone, known := a.cachedPod(namespace, name, uid)
	return known && (gone || p.DeletionTimestamp != nil)
}

// cachedPod looks uid's pod up in the pod cache: gone when no object with
// uid exists under the name, p the object otherwise; known is false when
// there is no cache or the lookup failed.
func (a *Agent) cachedPod(namespace, name string, uid types.UID) (p *corev1.Pod, gone, known bool) {
	if a.cfg.Pods == nil {
		return nil, false, false
	}
	p, err := a.cfg.Pods.Pod(namespace, name)
	switch {
	case apierrors.IsNotFound(err):
		return nil, true, true
	case err != nil:
		return nil, false, false
	}
	return p, p.UID != uid, true
}

// podGoing reports whether the pod is going away for good: gone,
// terminating or finished.
func (a *Agent) podGoing(namespace, name string, uid types.UID) bool {
	p, gone, known := a.cachedPod(namespace, name, uid)
	return known && (gone || p.DeletionTimestamp != nil || enablement.IsTerminal(p))
}

// podObjectGone reports whether the pod cache knows that no object with
// uid exists under the name. Without a cache, or a name, nothing is known.
func (a *Agent) podObjectGone(namespace, name string, uid types.UID) bool {
	if namespace == "" || name == "" {
		return false
	}
	_, gone, _ := a.cachedPod(namespace, name, uid)
	return gone
}

// netnsIdentity identifies the namespace at a DEL's netns path, when the
// path is one the agent accepts and still a network namespace.
func (a *Agent) netnsIdentity(path string) (netns.Identity, bool) {
	if path == "" {
		return netns.Identity{}, false
	}
	id, err := a.cfg.Netns.Identify(path)
	if err != nil {
		return netns.Identity{}, false
	}
	return id, true
}

// heldElsewhere reports whether an enrolled pod holds namespace id, or a
// record of a pod other than uid names it.
func (a *Agent) heldElsewhere(id netns.Identity, uid types.UID) bool {
	a.mu.Lock()
	for _, e := range a.entriesLocked() {
		if e.ns != nil && e.ns.Identity() == id {
			a.mu.Unlock()
			return true
		}
	}
	a.mu.Unlock()
	for _, r := range a.records.all() {
		if r.UID != uid && (netns.Identity{Dev: r.NetnsDev, Ino: r.NetnsIno}) == id {
			return true
		}
	}
	return false
}

// uidOfDel is the pod a DEL names: its K8S_POD_UID, else the pod held
// or recorded with its sandbox id, else the one held or recorded under
// its name.
func (a *Agent) uidOfDel(d SandboxDel) types.UID {
	if d.UID != "" {
		return d.UID
	}
	if uid := a.uidOfSandbox(d.SandboxID); uid != "" {
		return uid
	}
	if d.Namespace == "" {
		return ""
	}
	uid, _ := a.EnrolledUID(d.Namespace, d.Name)
	return uid
}

func (a *Agent) uidOfSandbox(sandboxID string) types.UID {
	a.mu.Lock()
	for uid, e := range a.entriesLocked() {
		if e.SandboxID == sandboxID {
			a.mu.Unlock()
			return uid
		}
	}
	a.mu.Unlock()
	for _, r := range a.records.all() {
		if r.SandboxID == sandboxID {
			return r.UID
		}
	}
	return ""
}

// EnrolledUID reports the uid enrolled under namespace/name, if any: in
// the state, or known by a capture record only (the agent may have left
// capture on it, so it is not free of us yet).
func (a *Agent) EnrolledUID(namespace, name string) (types.UID, bool) {
	a.mu.Lock()
	for uid, e := range a.entriesLocked() {
		if e.Namespace == namespace && e.Name == name {
			a.mu.Unlock()
			return uid, true
		}
	}
	a.mu.Unlock()
	if r, ok := a.records.byName(namespace, name); ok {
		return r.UID, true
	}
	return "", false
}

// recordedNetns is the identity of the namespace a capture record names,
// if there is a record (ok) and it names one.
func recordedNetns(rec Record, ok bool) (netns.Identity, bool) {
	if !ok || (rec.NetnsDev == 0 && rec.NetnsIno == 0) {
		return netns.Identity{}, false
	}
	return netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}, true
}
