package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"os"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// ErrNotHeld is returned for a pod the agent does not hold in a network
// namespace (not enrolled, or restored without its netns).
var ErrNotHeld = errors.New("pod is not held in a network namespace")

// InPod runs fn on the network namespace the agent holds uid in, under
// the pod's lock, so no capture or release of it runs meanwhile: the
// verifier reads the pod's sockets and addresses through it. fn must not
// keep ns. Without a held namespace it returns ErrNotHeld.
func (a *Agent) InPod(uid types.UID, fn func(ns *os.File) error) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil || e.ns == nil {
		return ErrNotHeld
	}
	return fn(e.ns.File())
}

// Recapture captures the enrolled pod again, through Capture, in the
// namespace the agent holds it in: its rules re-applied, its IPs put back
// in the host probe set, ztunnel handed the pod and the annotation
// rewritten. With resetZtunnel, ztunnel is first told to drop the pod
// (one that lost the pod's listeners may take a repeated Add of a pod it
// already has for done), only once the rules are in: a repair that fails
// before leaves ztunnel serving the pod. The capture runs only if the
// pod is still held in that namespace once the pod's lock is taken again:
// a pod released or moved to a new sandbox's namespace meanwhile is left
// as it is, and the error wraps ErrNotHeld.
func (a *Agent) Recapture(ctx context.Context, pod *corev1.Pod, resetZtunnel bool) error {
	unlock := a.lock(pod.UID)
	e := a.get(pod.UID)
	if e == nil || e.ns == nil {
		unlock()
		return fmt.Errorf("recapture %s/%s: %w", pod.Namespace, pod.Name, ErrNotHeld)
	}
	ns, err := e.ns.Dup()
	unlock()
	if err != nil {
		return fmt.Errorf("recapture %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	if a.recaptureGap != nil {
		a.recaptureGap(pod.UID)
	}
	// The verifier read the pod's annotation from the cache and found it
	// changed: the value this agent last wrote no longer says what the
	// object carries.
	a.annotations.forgetWritten(pod.UID)
	if err := a.captureIfHeld(ctx, pod, ns, nil, nil, true, resetZtunnel && a.cfg.Ztunnel != nil); err != nil {
		return fmt.Errorf("recapture: %w", err)
	}
	return nil
}
