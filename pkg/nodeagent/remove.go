package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
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
	if err := a.removeRules(log, e); err != nil && !errors.Is(err, errNetnsUnknown) {
		return Retryable(fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
	}
	a.drop(e, evUnenroll)
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
			_ = a.removeRulesAt(log, d.Netns, nil, "")
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
				_ = a.removeRulesAt(log, d.Netns, &want, uid)
			} else {
				_ = a.removeRulesAt(log, d.Netns, nil, uid)
			}
		}
		if id, ok := a.netnsIdentity(d.Netns); ok {
			a.markTorn(id, uid, e.IPs)
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
		a.markTorn(e.ns.Identity(), uid, e.IPs)
	default:
		a.markTorn(e.ns.Identity(), uid, e.IPs)
	}
	a.forget(log, e, evDel)
	a.noteReleased(e.Namespace, e.Name, uid, e.IPs)
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
			_ = a.removeRulesAt(log, d.Netns, nil, uid)
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
	a.noteReleased(d.Namespace, d.Name, uid, rec.IPs)
	return nil
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

// GC forgets every CNI-enrolled pod attached through network whose sandbox
// is not in valid (pods the controller enrolled carry no sandbox id and are
// left to it), held or known only by its capture record. The runtime lists
// one network's attachments, so pods of other networks (several conflists,
// as with Multus) and of no known network are left alone; network ""
// (an older plugin) considers every pod. It returns how many it removed.
func (a *Agent) GC(ctx context.Context, network string, valid []string) int {
	mine := func(n string) bool { return network == "" || n == network }
	keep := make(map[string]bool, len(valid))
	for _, id := range valid {
		keep[id] = true
	}
	type stale struct {
		sandbox string
		uid     types.UID
	}
	var drop []stale
	seen := map[types.UID]bool{}
	a.mu.Lock()
	for uid, e := range a.entriesLocked() {
		seen[uid] = true
		if e.SandboxID != "" && mine(e.Network) && !keep[e.SandboxID] {
			drop = append(drop, stale{e.SandboxID, uid})
		}
	}
	a.mu.Unlock()
	// Pods known only by their record (not restored) too.
	for _, r := range a.records.all() {
		if !seen[r.UID] && r.SandboxID != "" && mine(r.Network) && !keep[r.SandboxID] {
			drop = append(drop, stale{r.SandboxID, r.UID})
		}
	}
	for _, s := range drop {
		_ = a.RemoveSandbox(ctx, SandboxDel{SandboxID: s.sandbox, UID: s.uid})
	}
	if len(drop) > 0 {
		a.log.Info("gc removed stale sandboxes", "count", len(drop))
	}
	return len(drop)
}

// DrainSpool replays the DELs the plugin spooled while the agent was
// unreachable, removing each entry once handled (unusable entries are
// logged and removed). A replayed DEL also cleans a pod the agent did not
// restore: its record, and our rules in its namespace if that still
// exists (see RemoveSandbox). Call it at startup after restoring state,
// then leave it to RunSpoolDrain.
func (a *Agent) DrainSpool(ctx context.Context) (int, error) {
	entries, err := nodefiles.List(a.cfg.Layout.DelSpool())
	if err != nil {
		return 0, err
	}
	n := drainSpool(a.log, "DEL spool", entries, func(ev *ambient.PodEvent) spoolStep {
		del := SandboxDel{SandboxID: ev.SandboxID, UID: types.UID(ev.PodUID), Namespace: ev.PodNamespace, Name: ev.PodName, Netns: ev.Netns, Replayed: true}
		if err := a.RemoveSandbox(ctx, del); err != nil {
			a.log.Warn("replay spooled DEL", "sandbox", ev.SandboxID, "err", err)
			return spoolKeep
		}
		return spoolCounted
	})
	if n > 0 {
		a.log.Info("replayed spooled DELs", "count", n)
	}
	return n, nil
}

// spoolDrainInterval is how often RunSpoolDrain replays spooled DELs.
const spoolDrainInterval = 30 * time.Second

// RunSpoolDrain replays spooled DELs every spoolDrainInterval until ctx
// ends: the plugin also spools a DEL that timed out while the agent stayed
// up, not only while it was away.
func (a *Agent) RunSpoolDrain(ctx context.Context) error {
	t := time.NewTicker(spoolDrainInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if _, err := a.DrainSpool(ctx); err != nil {
				a.log.Warn("drain DEL spool", "err", err)
			}
		}
	}
}

// Release takes capture off a pod the agent finds captured at startup but
// does not want captured any more (unlabelled while no agent ran, or an
// unenroll a crash interrupted): rules, probe set, then annotation, then
// record, as Unenroll does. The pod is not in the state, so no ztunnel
// snapshot names it. It owns ns.
func (a *Agent) Release(ctx context.Context, pod *corev1.Pod, ns *netns.Handle) error {
	defer ns.Close()
	unlock := a.lock(pod.UID)
	defer unlock()
	if a.get(pod.UID) != nil {
		return fmt.Errorf("release %s/%s: the pod is enrolled; unenroll it", pod.Namespace, pod.Name)
	}
	log := a.log.With("pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID)
	if err := a.cfg.Rules.Remove(ns.Path()); err != nil {
		a.ruleError("remove")
		return Retryable(fmt.Errorf("remove rules of %s/%s: %w", pod.Namespace, pod.Name, err))
	}
	ips := enablement.PodIPs(pod)
	if rec, ok := a.records.get(pod.UID); ok {
		ips = append(ips, rec.IPs...)
	}
	a.dropProbeIPs(log, ips, nil)
	a.clearThenForget(pod.Namespace, pod.Name, pod.UID)
	log.Info("released a pod captured before the restart")
	return nil
}

// releaseWorkers is how many pods ReleaseAll works on at once: an
// uninstall must finish within the pod's grace period, and with the
// iptables backend each removal runs four short processes, which a single
// worker would run one after another for hundreds of pods.
const releaseWorkers = 8

// ReleaseAll takes every pod the agent captured out of the mesh, for an
// uninstall: the node goes back to plain networking and no pod stays
// redirected to a ztunnel that may be going away (with the host probe SNAT
// removed too, kubelet probes would otherwise land in ztunnel's inbound
// port). It runs once the agent has stopped (its annotation writer too),
// so the annotations are cleared here, synchronously.
//
// Two passes, each up to releaseWorkers pods at a time: first every pod's
// annotation is cleared (API requests only, paced by the client's rate
// limit and bounded by ctx), then every pod loses its rules, its ztunnel
// entry, probe-set address and capture record. So each pod still loses its
// annotation before its rules, and the API requests are not queued behind
// rule removals (which take CPU, and are not bounded by ctx: they are what
// keeps a pod from being redirected to a ztunnel that is gone). Unlike
// Unenroll a failed annotation update (the agent may have lost its RBAC
// already, or ctx ran out) does not keep the rules: they go regardless.
// Pods known only by their capture record (a restart did not restore
// them) are released through it. It returns every error it met.
func (a *Agent) ReleaseAll(ctx context.Context) error {
	a.mu.Lock()
	var held []EnrolledPod
	isHeld := map[types.UID]bool{}
	for uid, e := range a.entriesLocked() {
		held = append(held, e.EnrolledPod)
		isHeld[uid] = true
	}
	a.mu.Unlock()
	var recs []Record
	for _, rec := range a.records.all() {
		if !isHeld[rec.UID] {
			recs = append(recs, rec)
		}
	}
	var (
		mu   sync.Mutex
		errs []error
	)
	each := func(n int, f func(i int) error) {
		sem := make(chan struct{}, releaseWorkers)
		var wg sync.WaitGroup
		for i := range n {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				if err := f(i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	each(len(held)+len(recs), func(i int) error {
		if i < len(held) {
			return a.clearAnnotationNow(ctx, held[i].Namespace, held[i].Name, held[i].UID)
		}
		r := recs[i-len(held)]
		return a.clearAnnotationNow(ctx, r.Namespace, r.Name, r.UID)
	})
	each(len(held)+len(recs), func(i int) error {
		if i < len(held) {
			return a.releaseHeld(held[i].UID)
		}
		r := recs[i-len(held)]
		unlock := a.lock(r.UID)
		defer unlock()
		if a.get(r.UID) == nil { // not restored meanwhile (not expected once the agent stopped)
			a.releaseRecord(r, releaseUninstall)
		}
		return nil
	})
	if n := len(held) + len(recs); n > 0 {
		a.log.Info("released every pod for the uninstall", "pods", n, "errors", len(errs))
	}
	return errors.Join(errs...)
}

// releaseHeld removes a held pod's rules and forgets it (ReleaseAll's
// second pass).
func (a *Agent) releaseHeld(uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid)
	err := a.removeRules(log, e)
	switch {
	case errors.Is(err, errNetnsUnknown):
		// Said, not hidden: the pod needs a restart to leave the mesh.
		err = fmt.Errorf("remove rules of %s/%s: its network namespace was never found since the agent restarted; restart the pod", e.Namespace, e.Name)
	case err != nil:
		err = fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err)
	}
	a.forget(log, e, evUnenroll)
	return err
}

// ClearStale removes the redirection annotation of a pod the agent neither
// holds nor has a record of and does not want captured (a previous agent
// annotated it, e.g. before its namespace was unlabelled), through the
// annotation writer like every other write.
func (a *Agent) ClearStale(pod *corev1.Pod) {
	a.annotations.set(pod.Namespace, pod.Name, pod.UID, "", nil)
}

// PodGone is told (podcache OnPodDeleted) that uid's object is gone: what
// the agent remembered of it outside its state (the annotation last
// written, a released sandbox, torn namespaces) is dropped, so those
// tables hold only pods that exist, however many come and go (finished
// Job pods, pods unenrolled then deleted). A pod the agent still holds is
// released by the controller as before.
func (a *Agent) PodGone(uid types.UID) {
	a.annotations.podGone(uid)
	a.mu.Lock()
	defer a.mu.Unlock()
	if l := a.lives[uid]; l != nil {
		l.sandboxGone, l.torn = nil, nil
		a.tidyLocked(l)
	}
}

// SandboxReleased reports whether the runtime removed uid's sandbox (CNI
// DEL) while it was captured and no sandbox of it was captured since. A
// terminating pod in that state has no network left to capture: the
// controller leaves it alone until its object is gone.
func (a *Agent) SandboxReleased(uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	l := a.lives[uid]
	return l != nil && l.sandboxGone != nil
}

// ReleasedSandbox is SandboxReleased with when the runtime removed the
// sandbox and the IPs it had (none when not known): a pod showing other
// IPs has a new sandbox, which no ADD brought to the agent.
func (a *Agent) ReleasedSandbox(uid types.UID) (at time.Time, ips []netip.Addr, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	l := a.lives[uid]
	if l == nil || l.sandboxGone == nil {
		return time.Time{}, nil, false
	}
	return l.sandboxGone.at, slices.Clone(l.sandboxGone.ips), true
}
