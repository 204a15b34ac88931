package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
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
// restores it first). An unknown uid is fine. See planRemoval.
func (a *Agent) Unenroll(ctx context.Context, uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	rec, hasRec := a.records.get(uid)
	p := &leaving{uid: uid, e: e, rec: rec, hasRec: hasRec, namespace: rec.Namespace, name: rec.Name, ips: rec.IPs}
	if e != nil {
		p.namespace, p.name, p.ns, p.ips = e.Namespace, e.Name, e.ns, e.IPs
	}
	f := lifeFacts{held: e != nil, handle: e != nil && e.ns != nil, record: hasRec}
	f.deleting = (f.held || f.record) && a.podDeleting(p.namespace, p.name, uid)
	return a.runRemoval(ctx, rmUnenroll, p, planRemoval(rmUnenroll, f))
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
// must not wedge the runtime. The DEL queue replays spooled DELs through
// the same removal (removeSandbox).
func (a *Agent) RemoveSandbox(ctx context.Context, d SandboxDel) error {
	return a.removeSandbox(ctx, d, rmDel)
}

// removeSandbox is a DEL, live (rmDel) or spooled (rmSpooledDel): the
// facts under the pod's lock, the plan, its execution.
func (a *Agent) removeSandbox(ctx context.Context, d SandboxDel, ev removal) error {
	if d.SandboxID == "" {
		return invalid(errors.New("remove sandbox: empty sandbox id"))
	}
	uid := a.uidOfDel(d)
	if uid == "" {
		f, p := a.delFacts(ev, "", nil, Record{}, false, d)
		_ = a.runRemoval(ctx, ev, p, planRemoval(ev, f))
		return nil
	}
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	rec, hasRec := a.records.get(uid)
	f, p := a.delFacts(ev, uid, e, rec, hasRec, d)
	if e != nil && !f.named {
		a.log.Debug("DEL of another sandbox of an enrolled pod; enrollment kept", "uid", uid, "sandbox", d.SandboxID, "enrolled_sandbox", e.SandboxID, "enrolled_netns", e.Netns)
	}
	// Every step of a DEL is best effort: a failure is logged, never
	// returned, so the runtime (or the queue) is not held up.
	_ = a.runRemoval(ctx, ev, p, planRemoval(ev, f))
	return nil
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
	p := &leaving{uid: pod.UID, namespace: pod.Namespace, name: pod.Name, ns: ns, ips: enablement.PodIPs(pod)}
	p.rec, p.hasRec = a.records.get(pod.UID)
	p.ips = append(p.ips, p.rec.IPs...)
	return a.runRemoval(ctx, rmRelease, p, planRemoval(rmRelease, lifeFacts{record: p.hasRec}))
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
			return a.uninstallOne(ctx, held[i].UID, nil)
		}
		return a.uninstallOne(ctx, recs[i-len(held)].UID, &recs[i-len(held)])
	})
	if n := len(held) + len(recs); n > 0 {
		a.log.Info("released every pod for the uninstall", "pods", n, "errors", len(errs))
	}
	return errors.Join(errs...)
}

// uninstallOne is ReleaseAll's second pass for one pod: held (rec nil),
// it loses its rules and is forgotten; known by its record rec alone, it
// is released through the record. A pod that moved on since it was
// listed (not expected once the agent stopped) is left alone.
func (a *Agent) uninstallOne(ctx context.Context, uid types.UID, rec *Record) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if (e == nil) == (rec == nil) {
		return nil
	}
	p := &leaving{uid: uid, e: e}
	if e != nil {
		p.namespace, p.name, p.ns, p.ips = e.Namespace, e.Name, e.ns, e.IPs
		p.rec, p.hasRec = a.records.get(uid)
	} else {
		p.namespace, p.name, p.ips, p.rec, p.hasRec = rec.Namespace, rec.Name, rec.IPs, *rec, true
	}
	f := lifeFacts{held: e != nil, handle: e != nil && e.ns != nil, record: p.hasRec}
	return a.runRemoval(ctx, rmUninstall, p, planRemoval(rmUninstall, f))
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

// ClearStale removes the redirection annotation of a pod the agent neither
// holds nor has a record of and does not want captured (a previous agent
// annotated it, e.g. before its namespace was unlabelled), through the
// annotation writer like every other write.
func (a *Agent) ClearStale(pod *corev1.Pod) {
	a.annotations.set(pod.Namespace, pod.Name, pod.UID, "", nil)
}

// PodGone is told (podcache OnPodDeleted) that uid's object is gone: what
// the agent remembered of it outside its state (the annotation last
// written, a released sandbox, torn namespaces) is dropped from its life,
// so the lives hold only pods that exist, however many come and go (finished
// Job pods, pods unenrolled then deleted). A pod the agent still holds is
// released by the controller as before.
func (a *Agent) PodGone(uid types.UID) {
	a.annotations.forgetWritten(uid)
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
