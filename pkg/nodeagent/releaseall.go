package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

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
	held := make([]EnrolledPod, 0, len(a.pods))
	isHeld := make(map[types.UID]bool, len(a.pods))
	for uid, e := range a.pods {
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
			return a.releaseRules(ctx, held[i].UID)
		}
		a.releaseRecordRules(recs[i-len(held)])
		return nil
	})
	if n := len(held) + len(recs); n > 0 {
		a.log.Info("released every pod for the uninstall", "pods", n, "errors", len(errs))
	}
	return errors.Join(errs...)
}

// releaseRules removes a held pod's rules and forgets it (ReleaseAll's
// second pass).
func (a *Agent) releaseRules(ctx context.Context, uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid)
	var err error
	_, recorded := a.recordedNetns(uid)
	switch {
	case e.ns != nil:
		if rerr := a.cfg.Rules.Remove(e.ns.Path()); rerr != nil {
			a.ruleError("remove")
			err = fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, rerr)
		}
	case recorded:
		// Restored without its netns: its record names the namespace,
		// whose rules go if it still exists (if it does not, neither do
		// they).
		if rerr := a.removeRecordedRules(log, uid); rerr != nil {
			err = fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, rerr)
		}
	default:
		// Restored without its netns and without a record naming one (an
		// older agent's pod): its rules cannot be reached. Said, not
		// hidden: the pod needs a restart to leave the mesh.
		err = fmt.Errorf("remove rules of %s/%s: its network namespace was never found since the agent restarted; restart the pod", e.Namespace, e.Name)
	}
	a.forget(ctx, log, e)
	return err
}

// releaseRecordRules releases a pod known only by its record (ReleaseAll's
// second pass): our rules in the recorded namespace (if it still exists
// and is the recorded one), probe-set addresses, record.
func (a *Agent) releaseRecordRules(rec Record) {
	unlock := a.lock(rec.UID)
	defer unlock()
	if a.get(rec.UID) != nil {
		return // restored meanwhile; not expected once the agent stopped
	}
	log := a.log.With("pod", rec.Namespace+"/"+rec.Name, "uid", rec.UID)
	_ = a.removeRulesByPath(log, rec.Netns, &netns.Identity{Dev: rec.NetnsDev, Ino: rec.NetnsIno}, rec.UID)
	a.dropProbeIPs(log, rec.IPs, nil)
	a.annotations.forget(rec.UID)
	if err := a.records.remove(rec.UID); err != nil {
		log.Warn("remove capture record", "err", err)
	}
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
