package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

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
	// releaseUninstall: ReleaseAll, once the agent stopped (its
	// annotation writer too: the annotation was cleared already).
	releaseUninstall
)

// releaseRecord undoes what a record says the agent may have left on a pod
// it does not hold: our rules in the recorded namespace (when it still
// exists, is the recorded one and no enrolled pod holds it), the
// probe-set IPs, then (unenroll) the annotation of a pod that lives on,
// then the record. Called with the pod's lock held.
func (a *Agent) releaseRecord(rec Record, mode releaseMode) {
	log := a.log.With("pod", rec.Namespace+"/"+rec.Name, "uid", rec.UID)
	if mode != releaseDel {
		_ = a.removeRulesAt(log, rec.Netns, &netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}, rec.UID)
	}
	a.dropProbeIPs(log, rec.IPs, nil)
	switch {
	case mode == releaseUnenroll && !a.podDeleting(rec.Namespace, rec.Name, rec.UID):
		a.clearThenForget(rec.Namespace, rec.Name, rec.UID)
	default:
		if mode == releaseUnenroll || mode == releaseUninstall {
			a.annotations.forget(rec.UID) // nothing left to un-annotate
		}
		// A DEL leaves a write an unenroll queued (its removal of the
		// annotation) to finish.
		if err := a.records.remove(rec.UID); err != nil {
			log.Warn("remove capture record", "err", err)
		}
	}
	log.Info("released a recorded pod the agent did not hold", "why", [...]string{"unenroll", "del", "replayed del", "uninstall"}[mode])
}

// errNetnsUnknown: a pod restored without its netns whose capture record
// names none (an older agent's pod): its rules cannot be reached.
var errNetnsUnknown = errors.New("the pod's network namespace is not known")

// removeRules removes our rules from a held pod's namespace: through its
// handle, or, for a pod restored without its netns, from the namespace its
// capture record names if that still exists (see removeRulesAt; if it
// does not, neither do the rules). Called with the pod's lock held.
func (a *Agent) removeRules(log *slog.Logger, e *entry) error {
	if e.ns != nil {
		if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
			a.ruleError("remove")
			return err
		}
		return nil
	}
	rec, _ := a.records.get(e.UID)
	want, known := a.recordedNetns(e.UID)
	if !known {
		return errNetnsUnknown
	}
	return a.removeRulesAt(log, rec.Netns, &want, e.UID)
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

// forget takes the pod out through ev (a CNI DEL, an uninstall's
// release): out of the state first (so no ztunnel that connects from now
// on gets an Add for it), then ztunnel is told (without waiting for its
// ack), the netns handle is closed, the probe-set IPs, the capture record
// and any annotation write still wanted go. Called with the pod's lock
// held.
func (a *Agent) forget(log *slog.Logger, e *entry, ev lifeEvent) {
	a.drop(e, ev)
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
// the pod is gone), its record: the last two steps of every removal.
// Called with the pod's lock held.
func (a *Agent) clearThenForget(namespace, name string, uid types.UID) {
	gen := a.records.generation(uid)
	a.annotations.set(namespace, name, uid, "", func() {
		if err := a.records.removeIf(uid, gen); err != nil {
			a.log.Warn("remove capture record", "uid", uid, "err", err)
		}
	})
}

// clearAnnotationNow removes the pod's redirection annotation with one
// API request (none for a pod the cache knows is going away).
func (a *Agent) clearAnnotationNow(ctx context.Context, namespace, name string, uid types.UID) error {
	if a.cfg.Annotator == nil || a.podDeleting(namespace, name, uid) {
		return nil
	}
	err := a.cfg.Annotator.SetRedirection(ctx, namespace, name, uid, "")
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("clear the annotation of %s/%s: %w", namespace, name, err)
	}
	return nil
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

// recordedNetns is the identity of the namespace uid's capture record
// names, if it names one.
func (a *Agent) recordedNetns(uid types.UID) (netns.Identity, bool) {
	rec, ok := a.records.get(uid)
	if !ok || (rec.NetnsDev == 0 && rec.NetnsIno == 0) {
		return netns.Identity{}, false
	}
	return netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}, true
}

// noteReleased records that the runtime removed uid's captured sandbox,
// unless the pod cache already knows the pod's object gone. PodGone, which
// drops the mark, then has run or runs next (the cache holds the deletion
// before it tells, and PodGone waits for a.mu), and a mark made after it
// would stay for releasedTTL: a DEL often comes after the object is gone.
func (a *Agent) noteReleased(namespace, name string, uid types.UID, ips []netip.Addr) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, l := range a.lives {
		if l.sandboxGone != nil && now.Sub(l.sandboxGone.at) > releasedTTL {
			l.sandboxGone = nil
			a.tidyLocked(l)
		}
	}
	if a.podObjectGone(namespace, name, uid) {
		return
	}
	a.lifeLocked(uid).sandboxGone = &releasedSandbox{at: now, ips: slices.Clone(ips)}
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

// markTorn notes that the runtime is tearing down pod uid's sandbox, whose
// namespace is id and whose IPs were ips.
func (a *Agent) markTorn(id netns.Identity, uid types.UID, ips []netip.Addr) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pruneTornLocked(now)
	l := a.lifeLocked(uid)
	if l.torn == nil {
		l.torn = map[netns.Identity]tornMark{}
	}
	l.torn[id] = tornMark{at: now, ips: slices.Clone(ips)}
}

// pruneTornLocked drops the marks older than tornTTL: a DEL that came after
// its pod's object was gone (PodGone ran first) leaves a mark only time
// removes. a.mu is held.
func (a *Agent) pruneTornLocked(now time.Time) {
	for _, l := range a.lives {
		for id, m := range l.torn {
			if now.Sub(m.at) > tornTTL {
				delete(l.torn, id)
			}
		}
		a.tidyLocked(l)
	}
}

// tornDown reports whether a CNI DEL lately tore down pod uid's sandbox
// whose namespace is ns. The pod counts, not only the identity: once a
// namespace is freed the kernel reuses its inode number, so another pod's
// new namespace can carry a torn one's identity within the minute (seen
// in make bench: 500 new pods after hundreds of DELs, some refused for a
// minute). So can the same pod's next sandbox, started right after the
// DEL (one no ADD brought to the agent, while our plugin was not chained:
// seen on the real node, the pod left uncaptured for the minute): a
// namespace holding an address the torn sandbox did not have is that new
// one, not the torn one, whose interfaces the primary's DEL removes.
func (a *Agent) tornDown(ns *netns.Handle, uid types.UID) bool {
	a.mu.Lock()
	var m tornMark
	ok := false
	if l := a.lives[uid]; l != nil {
		m, ok = l.torn[ns.Identity()]
	}
	a.mu.Unlock()
	if !ok || time.Since(m.at) > tornTTL {
		return false
	}
	if len(m.ips) == 0 {
		return true
	}
	have, err := netns.Addrs(ns.File())
	if err != nil {
		return true
	}
	return !slices.ContainsFunc(have, func(h netip.Addr) bool {
		return h.IsGlobalUnicast() && !slices.Contains(m.ips, h)
	})
}
