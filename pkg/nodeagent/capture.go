package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Capture is the one way a pod gets captured, for the CNI path and the pod
// controller alike: in-pod rules, host probe set, ztunnel handoff (waits
// for the ack), status annotation. ns is the pod's network namespace, held
// open: Capture owns it, keeps it in the state on success and closes it
// otherwise. sb is the sandbox at CNI ADD; nil (the controller) takes the
// IPs from the pod's status. Idempotent; a failure that may pass is
// Retryable, and a pod whose ztunnel handoff failed stays captured and
// Pending.
func (a *Agent) Capture(ctx context.Context, pod *corev1.Pod, ns *Netns, sb *Sandbox) error {
	if pod == nil || pod.UID == "" {
		_ = ns.Close()
		return errors.New("capture: pod without uid")
	}
	sandboxID, ips := "", enablement.PodIPs(pod)
	if sb != nil {
		sandboxID, ips = sb.ID, sb.IPs
	}
	unlock := a.lock(pod.UID)
	defer unlock()
	log := a.log.With("pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID)

	cfg := a.ruleConfig(pod)
	if err := a.cfg.Rules.Apply(ns.Path(), cfg); err != nil {
		a.ruleError("apply")
		_ = ns.Close()
		return Retryable(fmt.Errorf("apply in-pod rules in netns %s: %w", ns.Source(), err))
	}
	e := &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		SandboxID: sandboxID, Netns: ns.Source(), NetnsID: ns.ID(), IPs: slices.Clone(ips),
		State: StatePending, Rules: cfg, Since: time.Now(),
	}}
	a.mu.Lock()
	old := a.pods[pod.UID]
	if old != nil && old.ns.SameAs(ns) && sandboxID == "" {
		// The controller re-enrolling a pod the CNI path enrolled.
		e.SandboxID = old.SandboxID
	}
	a.pods[pod.UID] = e
	delete(a.released, pod.UID)
	a.mu.Unlock()
	if old != nil {
		// Same netns: a repeated ADD. Another netns: the sandbox was
		// recreated; ztunnel replaces the old netns on Add.
		_ = old.ns.Close()
		a.dropProbeIPs(log, old.IPs, ips)
	}
	a.addProbeIPs(log, ips)
	if old != nil && old.Unresolved {
		a.unresolvedGone()
	}

	if a.cfg.Ztunnel != nil {
		zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
		err := a.cfg.Ztunnel.Add(zctx, a.workload(e))
		cancel()
		if err != nil {
			a.annotate(ctx, log, e, string(StatePending))
			return Retryable(fmt.Errorf("hand pod %s/%s to ztunnel: %w", pod.Namespace, pod.Name, err))
		}
	}
	a.mu.Lock()
	e.State = StateEnabled
	a.mu.Unlock()
	if err := a.annotate(ctx, log, e, string(StateEnabled)); err != nil {
		return Retryable(err)
	}
	return nil
}

// ruleConfig is the rule set options for one pod.
func (a *Agent) ruleConfig(pod *corev1.Pod) ruleset.PodConfig {
	return ruleset.PodConfig{
		ProbeSNATv4:       a.cfg.ProbeSNATv4,
		ProbeSNATv6:       a.cfg.ProbeSNATv6,
		DNSCapture:        enablement.DNSCapture(pod, a.cfg.DNSCapture),
		BypassInbound:     enablement.BypassInbound(pod),
		VirtualInterfaces: enablement.VirtualInterfaces(pod),
	}
}

// ErrDrift is wrapped by Check's error when the in-pod rules differ from
// what the agent applied.
var ErrDrift = errors.New("in-pod rules drifted")

// Check is the CNI CHECK once decided (d): a pod that should be captured
// must be enrolled in this very namespace with its rules intact. p.UID
// names the pod. It takes ownership of ns.
func (a *Agent) Check(ctx context.Context, p PodInfo, d enablement.Decision, ns *Netns) error {
	defer ns.Close()
	uid := p.UID
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		if d.Enroll {
			return mismatch(fmt.Errorf("pod %s/%s should be captured (%s) but is not enrolled", p.Namespace, p.Name, d.Reason))
		}
		return nil
	}
	if !e.ns.SameAs(ns) {
		return mismatch(fmt.Errorf("pod %s/%s is enrolled in netns %s (inode %d), not %s", p.Namespace, p.Name, e.Netns, e.NetnsID, ns.Source()))
	}
	drift, err := a.cfg.Rules.Verify(e.ns.Path(), e.Rules)
	if err != nil {
		a.ruleError("verify")
		return Retryable(fmt.Errorf("verify rules of %s/%s: %w", p.Namespace, p.Name, err))
	}
	if !drift.Empty() {
		return mismatch(fmt.Errorf("%w in pod %s/%s: %s", ErrDrift, p.Namespace, p.Name, drift.String()))
	}
	return nil
}
