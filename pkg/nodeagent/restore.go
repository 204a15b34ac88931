package nodeagent

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

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
	return nil
}
