package nodeagent

import (
	"context"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// ReleaseAll takes every enrolled pod out of the mesh, for an uninstall:
// the node goes back to plain networking and no pod stays redirected to a
// ztunnel that may be going away (with the host probe SNAT removed too,
// kubelet probes would otherwise land in ztunnel's inbound port). Each pod
// loses its annotation, then its rules, then its ztunnel entry and probe
// set address, as in Unenroll; but unlike Unenroll a failed annotation
// update (the agent may have lost its RBAC already) does not keep the
// rules: they go regardless. It returns every error it met.
func (a *Agent) ReleaseAll(ctx context.Context) error {
	a.mu.Lock()
	uids := make([]types.UID, 0, len(a.pods))
	for uid := range a.pods {
		uids = append(uids, uid)
	}
	a.mu.Unlock()
	var errs []error
	for _, uid := range uids {
		if err := a.release(ctx, uid); err != nil {
			errs = append(errs, err)
		}
	}
	if len(uids) > 0 {
		a.log.Info("released every pod for the uninstall", "pods", len(uids), "errors", len(errs))
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
	if err := a.annotate(ctx, log, e, ""); err != nil && !apierrors.IsNotFound(err) {
		errs = append(errs, err)
	}
	if e.ns == nil {
		// Restored without its netns (Unresolved): its rules cannot be
		// reached. Said, not hidden: the pod needs a restart to leave the
		// mesh.
		errs = append(errs, fmt.Errorf("remove rules of %s/%s: its network namespace was never found since the agent restarted; restart the pod", e.Namespace, e.Name))
	} else if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
		a.ruleError("remove")
		errs = append(errs, fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
	}
	a.forget(ctx, log, e)
	return errors.Join(errs...)
}
