package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// releaseWorkers is how many pods ReleaseAll releases at once: an
// uninstall must finish within the pod's grace period, and with the
// iptables backend each removal runs four short processes, which a single
// worker would run one after another for hundreds of pods.
const releaseWorkers = 8

// ReleaseAll takes every pod the agent captured out of the mesh, for an
// uninstall: the node goes back to plain networking and no pod stays
// redirected to a ztunnel that may be going away (with the host probe SNAT
// removed too, kubelet probes would otherwise land in ztunnel's inbound
// port). It runs once the agent has stopped (its annotation writer too),
// so the annotation is cleared here, synchronously. Each pod loses its
// annotation, then its rules, then its ztunnel entry, probe-set address and
// capture record; unlike Unenroll a failed annotation update (the agent
// may have lost its RBAC already) does not keep the rules: they go
// regardless. Pods known only by their capture record (a restart did not
// restore them) are released through it, up to releaseWorkers pods at a
// time. It returns every error it met.
func (a *Agent) ReleaseAll(ctx context.Context) error {
	a.mu.Lock()
	uids := make([]types.UID, 0, len(a.pods))
	held := make(map[types.UID]bool, len(a.pods))
	for uid := range a.pods {
		uids = append(uids, uid)
		held[uid] = true
	}
	a.mu.Unlock()
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	sem := make(chan struct{}, releaseWorkers)
	do := func(f func() error) {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := f(); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	for _, uid := range uids {
		do(func() error { return a.release(ctx, uid) })
	}
	n := len(uids)
	for _, rec := range a.records.all() {
		if held[rec.UID] {
			continue
		}
		n++
		do(func() error { return a.releaseRecordNow(ctx, rec) })
	}
	wg.Wait()
	if n > 0 {
		a.log.Info("released every pod for the uninstall", "pods", n, "errors", len(errs))
	}
	return errors.Join(errs...)
}

func (a *Agent) release(ctx context.Context, uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid)
	var errs []error
	if err := a.clearAnnotationNow(ctx, e.Namespace, e.Name, uid); err != nil {
		errs = append(errs, err)
	}
	if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
		a.ruleError("remove")
		errs = append(errs, fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
	}
	a.forget(ctx, log, e)
	return errors.Join(errs...)
}

// releaseRecordNow releases a pod known only by its record: annotation,
// our rules in the recorded namespace (if it still exists and is the
// recorded one), probe-set addresses, record.
func (a *Agent) releaseRecordNow(ctx context.Context, rec Record) error {
	unlock := a.lock(rec.UID)
	defer unlock()
	if a.get(rec.UID) != nil {
		return nil // restored meanwhile; not expected once the agent stopped
	}
	log := a.log.With("pod", rec.Namespace+"/"+rec.Name, "uid", rec.UID)
	err := a.clearAnnotationNow(ctx, rec.Namespace, rec.Name, rec.UID)
	a.removeRulesByPath(log, rec.Netns, &nsID{rec.NetnsDev, rec.NetnsIno}, rec.UID)
	a.dropProbeIPs(log, rec.IPs, nil)
	a.annotations.forget(rec.UID)
	if rerr := a.records.remove(rec.UID); rerr != nil {
		log.Warn("remove capture record", "err", rerr)
	}
	return err
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
