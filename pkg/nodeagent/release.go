package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// Unenroll removes capture from a pod the controller no longer wants
// captured (label removed, pod deleted or finished). The order makes every
// crash point one the next agent repairs: the rules go first (a failure
// leaves the pod fully captured, to be retried), then the pod leaves the
// state (no ztunnel snapshot names it from then on) and ztunnel is told,
// then its probe-set IPs go, then the annotation is cleared (not for a pod
// being deleted: no API request for a pod that is going away), and only
// once that is written does the capture record go. Until then the record (and
// the annotation) make the next agent adopt the pod and finish the job.
// The held netns handle keeps the namespace enterable even if the pod is
// gone. A pod the agent holds only a record of (not restored after a
// restart) is cleaned through the record. A pod restored without its
// netns (Unresolved) has no handle: our rules go from the namespace its
// record names if that still exists (the controller unenrolls such a pod
// only once its sandbox is gone, and otherwise finds its netns and
// restores it first). An unknown uid is fine.
func (a *Agent) Unenroll(ctx context.Context, uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		if rec, ok := a.records.get(uid); ok {
			a.releaseRecord(rec, releaseUnenroll)
		}
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid)
	if e.ns == nil {
		if err := a.removeRecordedRules(log, uid); err != nil {
			return Retryable(fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
		}
	} else if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
		a.ruleError("remove")
		return Retryable(fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
	}
	a.drop(e)
	if a.cfg.Ztunnel != nil {
		zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
		if err := a.cfg.Ztunnel.Del(zctx, string(e.UID)); err != nil {
			// A ztunnel that missed the Del drops the pod at its next snapshot.
			log.Warn("ztunnel del", "err", err)
		}
		cancel()
	}
	_ = e.ns.Close()
	a.dropProbeIPs(log, e.IPs, nil)
	if a.podDeleting(e.Namespace, e.Name, uid) {
		// Gone or going: nothing worth an API request to un-annotate.
		a.annotations.forget(uid)
		if err := a.records.remove(uid); err != nil {
			log.Warn("remove capture record", "err", err)
		}
	} else {
		a.clearThenForget(e.Namespace, e.Name, uid)
	}
	log.Info("pod unenrolled")
	return nil
}

// SandboxDel is a CNI DEL as the agent needs it.
type SandboxDel struct {
	SandboxID string
	// UID, Namespace and Name are the pod's (CNI_ARGS); UID may be empty
	// when the runtime does not pass K8S_POD_UID.
	UID             types.UID
	Namespace, Name string
	// Netns is the path the runtime passed; it may be empty, or gone.
	Netns string
	// Replayed marks a DEL from the plugin's spool: the runtime has moved
	// on, so a namespace that still exists is one the runtime will not
	// destroy soon, and gets our rules removed.
	Replayed bool
}

// RemoveSandbox is the CNI DEL: forget the pod whose sandbox this is. The
// namespace is about to be destroyed, so its rules are left to go with it,
// and the pod's annotation is left alone (the pod is going away, or a new
// sandbox's ADD follows): ztunnel is told, the pod leaves the state, its
// probe-set IPs and its capture record go. No API request. The DEL names
// the pod's current sandbox when its sandbox id is the one captured, or,
// for a pod the controller captured (no sandbox id), when the DEL's netns
// is the namespace the agent holds; when that cannot be told (no netns
// path, or gone), only if the pod itself is going (deleted, terminating or
// finished). A DEL of an older sandbox leaves the pod's current enrollment
// alone. Every step is best effort and an unknown sandbox is fine: DEL
// must not wedge the runtime.
func (a *Agent) RemoveSandbox(ctx context.Context, d SandboxDel) error {
	if d.SandboxID == "" {
		return invalid(errors.New("remove sandbox: empty sandbox id"))
	}
	uid := d.UID
	if uid == "" {
		uid = a.uidOfSandbox(d.SandboxID)
	}
	if uid == "" && d.Namespace != "" {
		uid, _ = a.EnrolledUID(d.Namespace, d.Name)
	}
	log := a.log.With("pod", d.Namespace+"/"+d.Name, "uid", uid, "sandbox", d.SandboxID)
	if uid == "" {
		if d.Replayed {
			_ = a.removeRulesByPath(log, d.Netns, nil, "")
		}
		return nil
	}
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return a.removeUnheldSandbox(ctx, log, uid, d)
	}
	if !a.delNames(e, d) {
		log.Debug("DEL of another sandbox of an enrolled pod; enrollment kept", "enrolled_sandbox", e.SandboxID, "enrolled_netns", e.Netns)
		return nil
	}
	switch {
	case e.ns == nil:
		// Restored without its netns: a replayed DEL's namespace that
		// still exists loses our rules (checked against the record's
		// identity when there is one); the namespace is torn down either
		// way.
		want, known := a.recordedNetns(uid)
		if d.Replayed {
			if known {
				_ = a.removeRulesByPath(log, d.Netns, &want, uid)
			} else {
				_ = a.removeRulesByPath(log, d.Netns, nil, uid)
			}
		}
		if id, ok := a.netnsIdentity(d.Netns); ok {
			a.markTorn(id, uid)
		}
	case d.Replayed:
		if id, ok := a.netnsIdentity(d.Netns); ok && id == e.ns.Identity() {
			// The runtime left the namespace in place: do not leave our
			// rules in it.
			if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
				a.ruleError("remove")
				log.Warn("remove rules of a replayed DEL's sandbox", "err", err)
			}
		}
		a.markTorn(e.ns.Identity(), uid)
	default:
		a.markTorn(e.ns.Identity(), uid)
	}
	a.forget(ctx, log, e)
	a.noteReleased(uid)
	return nil
}

// removeUnheldSandbox handles a DEL for a pod the agent does not hold: a
// pod it only has a record of (a restart did not restore it) loses what
// the record says the agent left; a replayed DEL also loses our rules in a
// namespace that still exists. Called with the pod's lock held.
func (a *Agent) removeUnheldSandbox(ctx context.Context, log *slog.Logger, uid types.UID, d SandboxDel) error {
	rec, ok := a.records.get(uid)
	if !ok {
		if d.Replayed {
			_ = a.removeRulesByPath(log, d.Netns, nil, uid)
		}
		return nil
	}
	if rec.SandboxID != "" && rec.SandboxID != d.SandboxID {
		return nil // another sandbox than the recorded one
	}
	recID := netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}
	if id, ok := a.netnsIdentity(d.Netns); ok && rec.SandboxID == "" && id != recID {
		return nil // the DEL's namespace is not the recorded one
	}
	mode := releaseDel
	if d.Replayed {
		mode = releaseReplayedDel
	}
	a.releaseRecord(rec, mode)
	a.noteReleased(uid)
	return nil
}

// releaseMode says why a recorded pod the agent does not hold is released.
type releaseMode int

const (
	// releaseUnenroll: the controller no longer wants the pod captured.
	releaseUnenroll releaseMode = iota
	// releaseDel: a CNI DEL; the namespace is about to go, and so (or a
	// new sandbox's ADD follows) does the annotation.
	releaseDel
	// releaseReplayedDel: a DEL from the spool; the runtime has moved on,
	// so a namespace still there gets our rules removed.
	releaseReplayedDel
)

// releaseRecord undoes what a record says the agent may have left on a pod
// it does not hold: our rules in the recorded namespace (when it still
// exists, is the recorded one and no enrolled pod holds it), the
// probe-set IPs, then (unenroll) the annotation of a pod that lives on,
// then the record. Called with the pod's lock held.
func (a *Agent) releaseRecord(rec Record, mode releaseMode) {
	log := a.log.With("pod", rec.Namespace+"/"+rec.Name, "uid", rec.UID)
	if mode != releaseDel {
		_ = a.removeRulesByPath(log, rec.Netns, &netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}, rec.UID)
	}
	a.dropProbeIPs(log, rec.IPs, nil)
	switch {
	case mode == releaseUnenroll && !a.podDeleting(rec.Namespace, rec.Name, rec.UID):
		a.clearThenForget(rec.Namespace, rec.Name, rec.UID)
	default:
		if mode == releaseUnenroll {
			a.annotations.forget(rec.UID) // nothing left to un-annotate
		}
		// A DEL leaves a write an unenroll queued (its removal of the
		// annotation) to finish.
		if err := a.records.remove(rec.UID); err != nil {
			log.Warn("remove capture record", "err", err)
		}
	}
	log.Info("released a recorded pod the agent did not hold", "why", [...]string{"unenroll", "del", "replayed del"}[mode])
}

// forget takes the pod out: out of the state first (so no ztunnel that
// connects from now on gets an Add for it), then ztunnel is told (without
// waiting for its ack), the netns handle is closed, the probe-set IPs, the
// capture record and any annotation write still wanted go. Called with
// the pod's lock held.
func (a *Agent) forget(ctx context.Context, log *slog.Logger, e *entry) {
	_ = ctx
	a.drop(e)
	if a.cfg.Ztunnel != nil {
		if err := a.cfg.Ztunnel.DelNoWait(string(e.UID)); err != nil {
			// A ztunnel that missed the Del drops the pod at its next snapshot.
			log.Warn("ztunnel del", "err", err)
		}
	}
	_ = e.ns.Close()
	a.dropProbeIPs(log, e.IPs, nil)
	a.annotations.forget(e.UID)
	if err := a.records.remove(e.UID); err != nil {
		log.Warn("remove capture record", "err", err)
	}
	if e.Unresolved {
		a.unresolvedGone()
	}
	log.Info("pod removed")
}

// drop removes the entry from the state (the ZDS snapshot source).
func (a *Agent) drop(e *entry) {
	a.mu.Lock()
	if a.pods[e.UID] == e {
		delete(a.pods, e.UID)
	}
	a.mu.Unlock()
}

// delNames reports whether a DEL names the sandbox e is enrolled in.
func (a *Agent) delNames(e *entry, d SandboxDel) bool {
	if e.SandboxID != "" {
		return e.SandboxID == d.SandboxID
	}
	held, known := netns.Identity{}, e.ns != nil
	if known {
		held = e.ns.Identity()
	} else {
		// Restored without its netns: the record names the namespace.
		held, known = a.recordedNetns(e.UID)
	}
	if id, ok := a.netnsIdentity(d.Netns); ok && known {
		return id == held
	}
	return a.podGoing(e.Namespace, e.Name, e.UID)
}

// podDeleting reports whether the pod cache knows the pod is gone (no pod
// with this uid under the name) or being deleted: its annotation is not
// worth an API request. Without a cache nothing is known.
func (a *Agent) podDeleting(namespace, name string, uid types.UID) bool {
	if a.cfg.Pods == nil {
		return false
	}
	p, err := a.cfg.Pods.Pod(namespace, name)
	if apierrors.IsNotFound(err) {
		return true
	}
	return err == nil && (p.UID != uid || p.DeletionTimestamp != nil)
}

// podGoing reports whether the pod is going away for good: gone,
// terminating or finished.
func (a *Agent) podGoing(namespace, name string, uid types.UID) bool {
	if a.cfg.Pods == nil {
		return false
	}
	p, err := a.cfg.Pods.Pod(namespace, name)
	if apierrors.IsNotFound(err) {
		return true
	}
	if err != nil {
		return false
	}
	return p.UID != uid || p.DeletionTimestamp != nil || enablement.IsTerminal(p)
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

// removeRulesByPath removes our rules from the namespace at path, for a
// pod the agent does not hold a handle of: only a namespace that still
// exists, is the one expected (want, when known), and that no enrolled pod
// holds and no other pod's record names. A /proc/<pid>/ns/net path (the
// pid may have been reused) is only trusted with a known identity. It
// returns only the removal's own failure: a namespace that is gone or
// another one now has none of the pod's rules left to remove.
func (a *Agent) removeRulesByPath(log *slog.Logger, path string, want *netns.Identity, uid types.UID) error {
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

// removeRecordedRules removes our rules from the namespace uid's capture
// record names, for a pod restored without its netns (see
// removeRulesByPath). Without a record naming one there is nothing it can
// reach.
func (a *Agent) removeRecordedRules(log *slog.Logger, uid types.UID) error {
	rec, ok := a.records.get(uid)
	want, known := a.recordedNetns(uid)
	if !ok || !known {
		return nil
	}
	return a.removeRulesByPath(log, rec.Netns, &want, uid)
}

// heldElsewhere reports whether an enrolled pod holds namespace id, or a
// record of a pod other than uid names it.
func (a *Agent) heldElsewhere(id netns.Identity, uid types.UID) bool {
	a.mu.Lock()
	for _, e := range a.pods {
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

func (a *Agent) uidOfSandbox(sandboxID string) types.UID {
	a.mu.Lock()
	for uid, e := range a.pods {
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

// tornTTL is how long a namespace whose sandbox a CNI DEL tore down is
// refused to the controller.
const tornTTL = time.Minute

// tornMark is a namespace whose sandbox a CNI DEL tore down: which pod's,
// and when.
type tornMark struct {
	uid types.UID
	at  time.Time
}

// markTorn notes that the runtime is tearing down pod uid's sandbox, whose
// namespace is id.
func (a *Agent) markTorn(id netns.Identity, uid types.UID) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pruneTornLocked(now)
	a.torn[id] = tornMark{uid: uid, at: now}
}

// pruneTornLocked drops the marks older than tornTTL: a DEL that came after
// its pod's object was gone (PodGone ran first) leaves a mark only time
// removes. a.mu is held.
func (a *Agent) pruneTornLocked(now time.Time) {
	for id, m := range a.torn {
		if now.Sub(m.at) > tornTTL {
			delete(a.torn, id)
		}
	}
}

// tornDown reports whether a CNI DEL lately tore down pod uid's sandbox
// whose namespace is ns. The pod counts, not only the identity: once a
// namespace is freed the kernel reuses its inode number, so another pod's
// new namespace can carry a torn one's identity within the minute (seen
// in make bench: 500 new pods after hundreds of DELs, some refused for a
// minute).
func (a *Agent) tornDown(ns *netns.Handle, uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	m, ok := a.torn[ns.Identity()]
	return ok && m.uid == uid && time.Since(m.at) <= tornTTL
}

// ClearStale removes the redirection annotation of a pod the agent neither
// holds nor has a record of and does not want captured (a previous agent
// annotated it, e.g. before its namespace was unlabelled), through the
// annotation writer like every other write.
func (a *Agent) ClearStale(pod *corev1.Pod) {
	a.annotations.set(pod.Namespace, pod.Name, pod.UID, "", nil)
}
