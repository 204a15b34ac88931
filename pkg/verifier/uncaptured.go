package verifier

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

// The search for pods that should be captured and are not.

// missingPod is a pod found uncaptured: since when, and whether it was
// reported (once per time it goes missing), when and how.
type missingPod struct {
	since   time.Time
	told    bool
	toldAt  time.Time
	finding Finding
}

// findUncaptured hands the controller every pod that should be captured,
// has its network up (IPs), and was not held by the agent for Settle.
func (v *Verifier) findUncaptured(ctx context.Context) {
	all, err := v.cfg.Pods.Pods()
	if err != nil {
		v.log.Warn("list pods", "err", err)
		return
	}
	now := v.cfg.now()
	seen := map[types.UID]bool{}
	for _, p := range all {
		if ctx.Err() != nil {
			return
		}
		if !v.uncaptured(p) {
			continue
		}
		seen[p.UID] = true
		v.mu.Lock()
		m, known := v.missing[p.UID]
		if !known {
			m = &missingPod{since: now}
			v.missing[p.UID] = m
		}
		ripe := known && now.Sub(m.since) >= v.cfg.Settle
		tell := ripe && !m.told
		if tell {
			m.told = true
		}
		v.mu.Unlock()
		if !ripe {
			continue
		}
		if tell {
			d := v.cfg.Pods.DecideCached(p)
			f := Finding{Kind: KindUncaptured, Detail: fmt.Sprintf("the pod should be captured (%s) but the agent does not hold it; capturing it", d.Reason)}
			// Kept for the pod's first proof once captured.
			v.mu.Lock()
			m.toldAt, m.finding = now, f
			v.mu.Unlock()
			v.found(p, []Finding{f})
		}
		// Every round while it stays uncaptured: the controller's own
		// retries may have given up on it.
		if v.cfg.Requeue != nil {
			v.cfg.Requeue(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	}
	v.mu.Lock()
	for uid, m := range v.missing {
		if !seen[uid] {
			// Captured since (or gone: forget drops it then).
			if m.told {
				v.caught[uid] = *m
			}
			delete(v.missing, uid)
		}
	}
	v.report()
	v.mu.Unlock()
}

// uncaptured reports whether p should be captured (the pod cache's
// decision, which alone says what must be captured), has its network, is
// not going, and the agent does not hold it.
func (v *Verifier) uncaptured(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || len(enablement.PodIPs(p)) == 0 {
		return false
	}
	if uid, ok := v.cfg.Agent.EnrolledUID(p.Namespace, p.Name); ok && uid == p.UID {
		return false
	}
	if v.awaitingSandbox(p) {
		return false
	}
	return v.cfg.Pods.DecideCached(p).Enroll
}

// awaitingSandbox reports whether the runtime removed p's captured sandbox
// (CNI DEL) less than a period ago and p still shows that sandbox's IPs:
// its next sandbox's ADD brings it back, and meanwhile there is nothing to
// capture. A pod showing other IPs runs a sandbox no ADD brought to the
// agent (one started while our plugin was not in the runtime's config),
// and one still showing the old IPs a period on may run a new sandbox
// that got them again: both are captured as any other.
func (v *Verifier) awaitingSandbox(p *corev1.Pod) bool {
	at, ips, ok := v.cfg.Agent.ReleasedSandbox(p.UID)
	if !ok || v.cfg.now().Sub(at) >= v.cfg.Period {
		return false
	}
	for _, a := range enablement.PodIPs(p) {
		if len(ips) > 0 && !slices.Contains(ips, a) {
			return false
		}
	}
	return true
}
