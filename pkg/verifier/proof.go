package verifier

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
)

// The proof of one captured pod: what is checked, and the repair of what
// drifted.

// prove checks one enrolled pod, repairs what drifted and proves it again.
func (v *Verifier) prove(ctx context.Context, uid types.UID) {
	e, pod, ok := v.subject(uid)
	if !ok {
		if e.Unresolved {
			// Its rules and ztunnel's hold cannot be read without its
			// namespace; the controller keeps looking for it.
			v.record(uid, Proof{At: v.cfg.now(), Problem: "restored without its network namespace after a restart: not found since"})
		}
		return
	}
	// The proof's time is when its checks began: a change made after it
	// is the next proof's to find.
	proof := Proof{At: v.cfg.now()}
	v.mu.Lock()
	if prev, ok := v.proofs[uid]; ok {
		proof.LastDriftAt, proof.LastDrift = prev.LastDriftAt, prev.LastDrift
	} else if m, ok := v.caught[uid]; ok {
		proof.LastDriftAt, proof.LastDrift = m.toldAt, []Finding{m.finding}
	}
	delete(v.caught, uid)
	v.mu.Unlock()
	found, problem := v.check(e, pod, false)
	proof.Found = found
	if len(found) > 0 {
		proof.LastDriftAt, proof.LastDrift = proof.At, found
	}
	switch {
	case len(found) > 0:
		v.found(pod, found)
		if err := v.repair(ctx, pod, found); err != nil {
			proof.Problem = fmt.Sprintf("repair failed: %v", err)
			v.log.Warn("repair drifted pod", "pod", pod.Namespace+"/"+pod.Name, "err", err)
			break
		}
		// Proven again from scratch, in full: a repair that did not hold
		// shows, and keeps the pod unproven.
		again, p2, ok := v.recheck(ctx, uid)
		if !ok {
			return
		}
		proof.Repaired = len(again) == 0 && p2 == ""
		proof.OK = proof.Repaired
		proof.Problem = joinProblems(again, p2)
	case problem != "":
		proof.Problem = problem
	default:
		proof.OK = true
	}
	v.record(uid, proof)
}

// recheck proves uid in full after a repair, again and again until it
// holds or Settle has passed: what the repair restores asynchronously (the
// annotation) is waited for, and nothing is passed on a fresh capture's
// grace (ztunnel acks an Add once the pod's listeners are bound, so
// listeners missing after the ack are missing). Either way the capture the
// repair made is past its grace by the pod's next proof, which is a full
// one too. False when the pod is no longer to be proven.
func (v *Verifier) recheck(ctx context.Context, uid types.UID) (found []Finding, problem string, ok bool) {
	deadline := v.cfg.now().Add(v.cfg.Settle)
	wait := repairPoll
	for {
		e, pod, ok := v.subject(uid)
		if !ok {
			return nil, "", false
		}
		found, problem = v.check(e, pod, true)
		left := deadline.Sub(v.cfg.now())
		if (len(found) == 0 && problem == "") || left <= 0 || !v.cfg.sleep(ctx, min(wait, left)) {
			return found, problem, true
		}
		wait = min(2*wait, time.Second)
	}
}

// record keeps uid's proof, keeping the last drift an earlier one found.
func (v *Verifier) record(uid types.UID, proof Proof) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if prev, ok := v.proofs[uid]; ok && proof.LastDriftAt.IsZero() {
		proof.LastDriftAt, proof.LastDrift = prev.LastDriftAt, prev.LastDrift
	}
	v.proofs[uid] = proof
	delete(v.missing, uid)
	v.report()
}

func joinProblems(found []Finding, problem string) string {
	var s []string
	for _, f := range found {
		s = append(s, f.String())
	}
	if problem != "" {
		s = append(s, problem)
	}
	return strings.Join(s, "; ")
}

// subject is uid's entry and its pod object, or false when it is not to
// be proven: gone, going, or no longer to be captured (the controller
// releases it), or restored without its namespace.
func (v *Verifier) subject(uid types.UID) (nodeagent.EnrolledPod, *corev1.Pod, bool) {
	e, found := v.cfg.Agent.Pod(uid)
	if !found || e.Unresolved {
		return e, nil, false
	}
	pod, err := v.cfg.Pods.Pod(e.Namespace, e.Name)
	if err != nil || pod.UID != uid || pod.DeletionTimestamp != nil {
		return e, nil, false
	}
	if !v.cfg.Pods.DecideCached(pod).Enroll {
		return e, nil, false
	}
	return e, pod, true
}

// repair puts right what check found: a recreated sandbox is captured in
// its new namespace; anything else by capturing the pod again in the one
// the agent holds (ztunnel told to drop it first when its listeners are
// gone).
func (v *Verifier) repair(ctx context.Context, pod *corev1.Pod, found []Finding) error {
	has := func(k Kind) bool { return slices.ContainsFunc(found, func(f Finding) bool { return f.Kind == k }) }
	if !has(KindSandbox) {
		return v.cfg.Agent.Recapture(ctx, pod, has(KindZtunnel))
	}
	if v.cfg.Finder == nil {
		return errors.New("no way to find the pod's new network namespace")
	}
	handles, err := v.cfg.Finder.Find(map[types.UID][]netip.Addr{pod.UID: enablement.PodIPs(pod)})
	ns, ok := handles[pod.UID]
	delete(handles, pod.UID)
	for _, h := range handles {
		_ = h.Close()
	}
	if !ok {
		return fmt.Errorf("the pod's new network namespace was not found (%v)", err)
	}
	return v.cfg.Agent.Capture(ctx, pod, ns, nil)
}

// check proves one pod: what drifted, and problem when something could
// not be proven but is not drift to repair (no ztunnel connected, a read
// that failed). full gives a fresh capture no grace.
func (v *Verifier) check(e nodeagent.EnrolledPod, pod *corev1.Pod, full bool) (found []Finding, problem string) {
	var problems []string
	settled := full || v.cfg.now().Sub(e.Since) >= v.cfg.Settle
	// One look into the pod's namespace serves the sandbox and ztunnel
	// checks: every entry into a namespace costs system time, and a node
	// proves several pods a second.
	seen := v.look(e)
	if f := v.checkSandbox(e, pod, seen); f != nil {
		// Whatever else holds in the old namespace serves nobody.
		return []Finding{*f}, ""
	}
	in, ok := v.cfg.Agent.Inspect(e.UID)
	switch {
	case !ok:
		return nil, "not enrolled any more"
	case in.VerifyError != "":
		problems = append(problems, "rules could not be read: "+in.VerifyError)
	case len(in.Drift) > 0:
		found = append(found, Finding{KindRules, strings.Join(in.Drift, "; ")})
	}

	if v.cfg.Ztunnels != nil {
		if v.cfg.Ztunnels() == 0 {
			problems = append(problems, "no ztunnel is connected")
		} else if f, p := v.checkZtunnel(in.EnrolledPod, settled, seen); f != nil {
			found = append(found, *f)
		} else if p != "" {
			problems = append(problems, p)
		}
	}

	if v.cfg.Probe != nil && len(in.IPs) > 0 {
		lacks, err := v.cfg.Probe.Lacks(in.IPs)
		if err != nil {
			problems = append(problems, "host probe set could not be read: "+err.Error())
		} else if len(lacks) > 0 {
			var lost []string
			for _, ip := range lacks {
				lost = append(lost, ip.String())
			}
			found = append(found, Finding{KindProbeSet, "the host probe set lacks " + strings.Join(lost, ", ")})
		}
	}

	if got := pod.Annotations[ambient.RedirectionAnnotation]; got != string(in.State) && settled {
		found = append(found, Finding{KindAnnotation, fmt.Sprintf("annotation %s is %q, the agent's state is %q", ambient.RedirectionAnnotation, got, in.State)})
	}
	return found, strings.Join(problems, "; ")
}

// podView is what one look into a pod's namespace saw.
type podView struct {
	addrs     []netip.Addr
	listening map[uint16]bool
	err       error
}

// look reads the namespace the agent holds e in: its addresses and
// ztunnel's listeners.
func (v *Verifier) look(e nodeagent.EnrolledPod) podView {
	var pv podView
	pv.err = v.cfg.Agent.InPod(e.UID, func(ns *os.File) error {
		var err error
		pv.addrs, pv.listening, err = v.cfg.Look(ns, ztunnelPorts(e.Rules.DNSCapture))
		return err
	})
	return pv
}

// checkSandbox proves the namespace the agent holds is still the pod's:
// it has one of the IPs the pod's status shows, or one of those the agent
// captured it with. The status lags the runtime: after an ordinary
// sandbox recreation the new sandbox's ADD moves the agent to its
// namespace seconds before kubelet's status update reaches the cache, and
// an API-server outage keeps that update away for as long as it lasts. A
// namespace that still has the addresses it was captured with is the
// sandbox the runtime runs; one recreated without the agent leaves the
// held namespace without them (the primary network's DEL took its
// interface).
func (v *Verifier) checkSandbox(e nodeagent.EnrolledPod, pod *corev1.Pod, seen podView) *Finding {
	want := enablement.PodIPs(pod)
	if len(want) == 0 || seen.err != nil {
		return nil
	}
	holds := func(a netip.Addr) bool { return slices.Contains(seen.addrs, a) }
	if slices.ContainsFunc(want, holds) || slices.ContainsFunc(e.IPs, holds) {
		return nil
	}
	return &Finding{KindSandbox, fmt.Sprintf("the network namespace the agent holds the pod in (%s) has none of its IPs %v: its sandbox was recreated without the agent; capturing the new one", e.Netns, want)}
}

// checkZtunnel proves ztunnel holds the pod: its in-pod listeners are up.
// Without them, a pod ztunnel acknowledged within Settle passes on the
// acknowledgement (ztunnel may still be binding); a pod it never
// acknowledged is handed to it again.
func (v *Verifier) checkZtunnel(e nodeagent.EnrolledPod, settled bool, seen podView) (*Finding, string) {
	ports, err := seen.listening, seen.err
	if errors.Is(err, nodeagent.ErrNotHeld) {
		return nil, ""
	}
	if err != nil {
		return nil, "ztunnel's listeners could not be read: " + err.Error()
	}
	var down []string
	for _, p := range ztunnelPorts(e.Rules.DNSCapture) {
		if !ports[p] {
			down = append(down, fmt.Sprint(p))
		}
	}
	if len(down) == 0 {
		return nil, ""
	}
	if e.State == nodeagent.StatePending {
		return &Finding{KindZtunnel, "ztunnel has not acknowledged the pod; handing it over again"}, ""
	}
	if !settled {
		return nil, ""
	}
	return &Finding{KindZtunnel, "ztunnel is not listening on " + strings.Join(down, ", ") + " in the pod"}, ""
}

// found logs, counts and reports drift on pod.
func (v *Verifier) found(pod *corev1.Pod, found []Finding) {
	msg := joinProblems(found, "")
	v.log.Warn("capture drifted; repairing", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "found", msg)
	for _, f := range found {
		if v.cfg.OnDrift != nil {
			v.cfg.OnDrift(f.Kind)
		}
	}
	if v.cfg.Events != nil {
		v.cfg.Events.Eventf(pod, corev1.EventTypeWarning, ReasonDrift, "verifier found %s; repairing", msg)
	}
}
