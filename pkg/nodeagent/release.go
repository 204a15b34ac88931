package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// Unenroll removes capture from a pod the controller no longer wants
// captured (label removed, pod deleted or finished): annotation first, so
// istiod stops sending HBONE before the rules go, then rules, then ztunnel.
// The held netns handle keeps the namespace enterable even if the pod is
// gone. An unknown uid is fine. A pod restored without its netns
// (Unresolved) has no rules the agent can reach: the controller unenrolls
// it so only once its sandbox is gone (deleted or finished), and otherwise
// finds its netns and restores it first.
func (a *Agent) Unenroll(ctx context.Context, uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid)
	if err := a.annotate(ctx, log, e, ""); err != nil && !apierrors.IsNotFound(err) {
		return Retryable(err)
	}
	if e.ns != nil {
		if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
			a.ruleError("remove")
			return Retryable(fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
		}
	}
	a.forget(ctx, log, e)
	return nil
}

// RemoveSandbox is the CNI DEL: forget the pod enrolled with this sandbox.
// The namespace is about to be destroyed, so every step is best effort and
// an unknown sandbox is fine; DEL must not wedge the runtime. A DEL for an
// older sandbox of a pod leaves the pod's current enrollment alone.
func (a *Agent) RemoveSandbox(ctx context.Context, sandboxID string, uid types.UID) error {
	if sandboxID == "" {
		return invalid(errors.New("remove sandbox: empty sandbox id"))
	}
	if uid == "" {
		uid = a.uidOfSandbox(sandboxID)
		if uid == "" {
			return nil
		}
	}
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil || e.SandboxID != sandboxID {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid, "sandbox", sandboxID)
	_ = a.annotate(ctx, log, e, "")
	if e.ns != nil {
		if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
			a.ruleError("remove")
			log.Warn("remove rules of a departing sandbox", "err", err)
		}
	}
	a.forget(ctx, log, e)
	a.noteReleased(uid)
	return nil
}

// forget tells ztunnel, drops the entry and closes the netns handle.
// Called with the pod's lock held.
func (a *Agent) forget(ctx context.Context, log *slog.Logger, e *entry) {
	if a.cfg.Ztunnel != nil {
		zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
		if err := a.cfg.Ztunnel.Del(zctx, string(e.UID)); err != nil {
			// A ztunnel that missed the Del drops the pod at its next snapshot.
			log.Warn("ztunnel del", "err", err)
		}
		cancel()
	}
	a.mu.Lock()
	if a.pods[e.UID] == e {
		delete(a.pods, e.UID)
	}
	a.mu.Unlock()
	_ = e.ns.Close()
	a.dropProbeIPs(log, e.IPs, nil)
	if e.Unresolved {
		a.unresolvedGone()
	}
	log.Info("pod removed")
}

func (a *Agent) uidOfSandbox(sandboxID string) types.UID {
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid, e := range a.pods {
		if e.SandboxID == sandboxID {
			return uid
		}
	}
	return ""
}
