package nodeagent

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

// Restore adopts a pod enrolled before the agent restarted: it verifies the
// rules (re-applying only on drift) and puts the pod in the state the ZDS
// snapshot is built from, without a ztunnel Add of its own. It owns ns
// like Capture.
func (a *Agent) Restore(ctx context.Context, pod *corev1.Pod, ns *Netns) error {
	unlock := a.lock(pod.UID)
	defer unlock()
	cfg := a.ruleConfig(pod)
	drift, err := a.cfg.Rules.Verify(ns.Path(), cfg)
	if err != nil {
		a.ruleError("verify")
		_ = ns.Close()
		return Retryable(fmt.Errorf("verify rules of %s/%s: %w", pod.Namespace, pod.Name, err))
	}
	if !drift.Empty() {
		a.log.Warn("repairing drifted in-pod rules", "pod", pod.Namespace+"/"+pod.Name, "drift", drift.String())
		if err := a.cfg.Rules.Apply(ns.Path(), cfg); err != nil {
			a.ruleError("apply")
			_ = ns.Close()
			return Retryable(fmt.Errorf("repair rules of %s/%s: %w", pod.Namespace, pod.Name, err))
		}
		if a.cfg.OnDriftRepaired != nil {
			a.cfg.OnDriftRepaired()
		}
	}
	e := &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		Netns: ns.Source(), NetnsID: ns.ID(), IPs: enablement.PodIPs(pod), State: StateEnabled, Rules: cfg, Since: time.Now(),
	}}
	a.mu.Lock()
	old := a.pods[pod.UID]
	if old != nil {
		e.SandboxID = old.SandboxID
	}
	a.pods[pod.UID] = e
	a.mu.Unlock()
	if old != nil {
		_ = old.ns.Close()
	}
	a.addProbeIPs(a.log, e.IPs)
	if old != nil && old.Unresolved {
		a.unresolvedGone()
	}
	return nil
}

// RestoreUnresolved adopts a pod a previous agent captured (it carries the
// redirection annotation) whose netns cannot be found yet: its cgroup path
// did not match, or its status lost its IPs in a kubelet restart. The pod
// enters the state without a netns, so every ZDS snapshot sends Keep for
// it and ztunnel goes on serving the netns it already has instead of
// dropping the pod (whose rules still redirect its traffic to ztunnel),
// and SyncHostProbe keeps whatever probe-set entries it has (none are
// added: its sandbox may be gone). Its rules are left untouched. The
// pod stays unresolved until Capture or Restore hands over its netns, or
// Unenroll removes it once it is gone. A pod already in the state is left
// as it is.
func (a *Agent) RestoreUnresolved(pod *corev1.Pod) {
	unlock := a.lock(pod.UID)
	defer unlock()
	state := StateEnabled
	if pod.Annotations[ambient.RedirectionAnnotation] == ambient.RedirectionPending {
		state = StatePending
	}
	e := &entry{EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		IPs: enablement.PodIPs(pod), State: state, Rules: a.ruleConfig(pod), Since: time.Now(), Unresolved: true,
	}}
	a.mu.Lock()
	if a.pods[pod.UID] != nil {
		a.mu.Unlock()
		return
	}
	a.pods[pod.UID] = e
	a.mu.Unlock()
	a.log.Warn("restored a captured pod without its netns; ztunnel keeps it until the netns is found",
		"pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "ips", e.IPs)
}

// Unresolved reports whether uid was restored without its netns and has
// not been captured again since (see RestoreUnresolved).
func (a *Agent) Unresolved(uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.pods[uid]
	return e != nil && e.Unresolved
}
