// Package explain answers, for any pod on the node, why it is or is not
// captured: the enablement policy's decision and reason, whether the agent
// holds it and in which state (ztunnel acknowledged or pending), whether
// its network namespace was found, whether its rules verify clean right now
// (and the drift when not), and its redirection annotation, rolled up into
// one verdict and a list of problems. The agent serves it on its debug
// socket (docs/troubleshooting.md). It reads and verifies; it changes
// nothing.
package explain

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
)

// Pods is the pod cache as the explainer reads it (pkg/podcache.Cache).
type Pods interface {
	Pod(namespace, name string) (*corev1.Pod, error)
	Pods() ([]*corev1.Pod, error)
	Namespace(name string) (*corev1.Namespace, error)
	DecideCached(p *corev1.Pod) enablement.Decision
}

// Agent is the node agent as the explainer reads it (*nodeagent.Agent).
type Agent interface {
	EnrolledUID(namespace, name string) (types.UID, bool)
	Inspect(uid types.UID) (nodeagent.Inspection, bool)
	SandboxReleased(uid types.UID) bool
	Pods() []nodeagent.EnrolledPod
}

// Finder locates running pods' network namespaces
// (netns.Scanner); the explainer closes what it returns.
type Finder interface {
	Find(pods map[types.UID][]netip.Addr) (map[types.UID]*netns.Handle, error)
}

// Explainer builds reports. Pods, Agent and Finder are required.
type Explainer struct {
	Pods   Pods
	Agent  Agent
	Finder Finder
	// Backend names the rules backend ("nftables", "iptables-nft", ...).
	Backend string
	// Ztunnels counts connected ztunnels; ReleaseSignal says what the
	// agent last saw of its release's signal (deleted: an uninstall).
	// Either may be nil.
	Ztunnels      func() int
	ReleaseSignal func() string
	// Verified, when set, is the verifier's last proof of a pod.
	Verified func(uid types.UID) (explainwire.Verification, bool)
	// Policy is the enablement policy the agent decides with, for the
	// notes on a decision (why a data-plane label did not exempt a pod).
	Policy enablement.Policy
}

// Explain reports on one pod: in the pod cache, or only in the agent's
// state (its object is gone). A pod neither knows is health.ErrNoSuchPod.
func (e *Explainer) Explain(_ context.Context, namespace, name string) (*explainwire.Report, error) {
	p, _ := e.Pods.Pod(namespace, name)
	var entry *nodeagent.EnrolledPod
	if uid, ok := e.Agent.EnrolledUID(namespace, name); ok && (p == nil || p.UID != uid) {
		for _, ep := range e.Agent.Pods() {
			if ep.UID == uid {
				entry = &ep
			}
		}
	}
	if p == nil && entry == nil {
		return nil, health.ErrNoSuchPod
	}
	found := e.find([]*corev1.Pod{p})
	defer found.close()
	if p == nil {
		return e.orphan(*entry), nil
	}
	r := e.report(p, found)
	if entry != nil {
		// The agent still holds an older pod of that name.
		r.Problems = append(r.Problems, fmt.Sprintf("the agent still holds an earlier pod of this name (uid %s); the controller releases it", entry.UID))
		r.OK = false
	}
	return r, nil
}

// ExplainAll reports on every pod in the cache and every pod the agent
// holds, with one /proc scan for the pods that should be captured and are
// not.
func (e *Explainer) ExplainAll(_ context.Context) *explainwire.NodeReport {
	pods, _ := e.Pods.Pods()
	slices.SortFunc(pods, func(a, b *corev1.Pod) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
	found := e.find(pods)
	defer found.close()
	out := &explainwire.NodeReport{RulesBackend: e.Backend, Reports: []*explainwire.Report{}}
	if e.Ztunnels != nil {
		n := e.Ztunnels()
		out.ZtunnelConnections = &n
	}
	if e.ReleaseSignal != nil {
		out.ReleaseSignal = e.ReleaseSignal()
	}
	seen := map[types.UID]bool{}
	for _, p := range pods {
		seen[p.UID] = true
		out.Reports = append(out.Reports, e.report(p, found))
	}
	for _, ep := range e.Agent.Pods() {
		if !seen[ep.UID] {
			out.Reports = append(out.Reports, e.orphan(ep))
		}
	}
	for _, r := range out.Reports {
		out.Pods++
		if r.Captured != nil {
			out.Captured++
		}
		if !r.OK {
			out.WithProblems++
		}
	}
	return out
}

// scan is the netns handles one /proc scan found, and its error.
type scan struct {
	m   map[types.UID]*netns.Handle
	err error
}

func (s *scan) close() {
	for _, ns := range s.m {
		_ = ns.Close()
	}
}

// find scans /proc once for the pods that should be captured, have IPs
// and are not held by the agent: whether their namespace can be found is
// what decides whether the controller can capture them.
func (e *Explainer) find(pods []*corev1.Pod) *scan {
	want := map[types.UID][]netip.Addr{}
	for _, p := range pods {
		if p == nil || len(enablement.PodIPs(p)) == 0 || !e.Pods.DecideCached(p).Enroll ||
			(p.DeletionTimestamp != nil && e.Agent.SandboxReleased(p.UID)) {
			continue
		}
		if uid, ok := e.Agent.EnrolledUID(p.Namespace, p.Name); ok && uid == p.UID {
			continue
		}
		want[p.UID] = enablement.PodIPs(p)
	}
	s := &scan{}
	if len(want) > 0 {
		s.m, s.err = e.Finder.Find(want)
	}
	return s
}

func (e *Explainer) report(p *corev1.Pod, found *scan) *explainwire.Report {
	d := e.Pods.DecideCached(p)
	r := &explainwire.Report{
		Pod: p.Namespace + "/" + p.Name, UID: string(p.UID), Phase: string(p.Status.Phase),
		Terminating: p.DeletionTimestamp != nil,
		Policy:      explainwire.Policy{Capture: d.Enroll, Reason: string(d.Reason), PodLabel: p.Labels[ambient.DataplaneModeLabel], Selector: d.Selector},
		Annotation:  p.Annotations[ambient.RedirectionAnnotation],
	}
	if ns, err := e.Pods.Namespace(p.Namespace); err == nil {
		r.Policy.NamespaceLabel = ns.Labels[ambient.DataplaneModeLabel]
	}
	if e.Policy.IgnoresDataPlaneLabel(p) {
		r.Policy.Note = fmt.Sprintf("labelled as a data-plane pod (ztunnel or node agent), which exempts pods only in the data-plane namespaces %v: decided like any other pod", e.Policy.DataPlaneNamespaces)
	}
	ips := enablement.PodIPs(p)
	for _, a := range ips {
		r.IPs = append(r.IPs, a.String())
	}
	var in nodeagent.Inspection
	held := false
	if uid, ok := e.Agent.EnrolledUID(p.Namespace, p.Name); ok && uid == p.UID {
		in, held = e.Agent.Inspect(uid)
	}
	if held {
		r.Captured = e.capture(in)
		if e.Verified != nil {
			if v, ok := e.Verified(in.UID); ok {
				r.Captured.Verification = &v
			}
		}
		r.Netns = heldNetns(in.EnrolledPod)
	} else {
		r.Netns = e.netnsOf(p, d, ips, found)
	}
	e.judge(r, p, d, ips)
	return r
}

// heldNetns is the netns of a pod the agent holds: its handle, or none for
// a pod restored without it after a restart.
func heldNetns(ep nodeagent.EnrolledPod) explainwire.Netns {
	if ep.Unresolved {
		return explainwire.Netns{How: "not found since the agent restarted: the agent keeps the pod in ztunnel (ZDS Keep) and its rules in place until it finds it (its capture record names the path shown)", Path: ep.Netns}
	}
	return explainwire.Netns{Found: true, How: "held by the agent since it captured the pod", Path: ep.Netns, Inode: ep.NetnsID}
}

func (e *Explainer) capture(in nodeagent.Inspection) *explainwire.Capture {
	c := &explainwire.Capture{
		State: string(in.State), ZtunnelAcked: in.State == nodeagent.StateEnabled,
		Via: "controller", SandboxID: in.SandboxID, Since: in.Since,
		Rules: explainwire.Rules{
			Backend: e.Backend, Clean: in.VerifyError == "" && len(in.Drift) == 0,
			Drift: in.Drift, Error: in.VerifyError,
			DNSCapture: in.Rules.DNSCapture, InboundCapture: !in.Rules.BypassInbound,
			VirtualInterfaces: in.Rules.VirtualInterfaces,
		},
	}
	if in.SandboxID != "" {
		c.Via = "cni"
	}
	return c
}

func (e *Explainer) netnsOf(p *corev1.Pod, d enablement.Decision, ips []netip.Addr, found *scan) explainwire.Netns {
	switch {
	case !d.Enroll:
		return explainwire.Netns{How: "not looked for: the pod is not to be captured"}
	case len(ips) == 0:
		return explainwire.Netns{How: "not looked for: the pod has no IP yet (its sandbox is being set up; its CNI ADD captures it)"}
	}
	if ns, ok := found.m[p.UID]; ok {
		return explainwire.Netns{Found: true, How: "found by a /proc scan just now (a process of the pod in a namespace holding its IP)", Path: ns.Source(), Inode: ns.ID()}
	}
	how := "not found by a /proc scan just now: no process of the pod (by its kubelet cgroup) in a network namespace holding its IPs"
	if found.err != nil {
		how += fmt.Sprintf(" (the scan reported: %v)", found.err)
	}
	return explainwire.Netns{How: how}
}

// judge sets the verdict, OK and the problems.
func (e *Explainer) judge(r *explainwire.Report, p *corev1.Pod, d enablement.Decision, ips []netip.Addr) {
	problems := enablement.InvalidAnnotations(p)
	if msg := enablement.IstioCNIExpected(p); msg != "" {
		problems = append(problems, msg)
	}
	c := r.Captured
	switch {
	case d.Enroll && c != nil:
		r.Verdict = "captured (" + string(d.Reason) + ")"
		if r.Terminating {
			r.Verdict += "; terminating: stays captured until its sandbox is torn down or its object is gone"
		}
		if !c.ZtunnelAcked {
			problems = append(problems, "ztunnel has not acknowledged the pod (state pending): its traffic is redirected but no ztunnel serves it; the agent retries (is ztunnel running on this node?)")
		}
		if c.Rules.Error != "" {
			problems = append(problems, "the pod's rules could not be verified: "+c.Rules.Error)
		} else if !c.Rules.Clean {
			problems = append(problems, "the pod's rules drifted from what the agent applied: "+strings.Join(c.Rules.Drift, "; "))
		}
		if r.Annotation != c.State {
			problems = append(problems, fmt.Sprintf("annotation %s is %q, want %q: istiod's view of the pod is stale", ambient.RedirectionAnnotation, r.Annotation, c.State))
		}
		if v := c.Verification; v != nil && !v.Proven {
			problems = append(problems, "the verifier's last proof ("+v.At.UTC().Format(time.RFC3339)+") failed: "+v.Problem)
		}
	case d.Enroll:
		switch {
		case r.Terminating && e.Agent.SandboxReleased(p.UID):
			r.Verdict = "not captured: terminating, and its sandbox was torn down (CNI DEL); nothing left to capture"
		case len(ips) == 0:
			r.Verdict = "not captured yet: to be captured (" + string(d.Reason) + "), but the pod has no IP yet; its CNI ADD captures it"
		case r.Netns.Found:
			r.Verdict = "NOT CAPTURED, but should be (" + string(d.Reason) + ")"
			problems = append(problems, "its network namespace is found, but the agent does not hold the pod: the pod controller retries (see the pod's events, reason AmbientEnrollFailed, and the agent's log)")
		default:
			r.Verdict = "NOT CAPTURED, but should be (" + string(d.Reason) + ")"
			problems = append(problems, "its network namespace cannot be found, so the controller cannot capture it while it runs (see docs/netns-discovery.md); a restarted pod is captured at its CNI ADD")
		}
		if r.Annotation != "" && !(r.Terminating && e.Agent.SandboxReleased(p.UID)) {
			problems = append(problems, fmt.Sprintf("annotation %s is %q although the agent does not hold the pod: istiod believes it is captured", ambient.RedirectionAnnotation, r.Annotation))
		}
	case c != nil:
		r.Verdict = "captured, but should not be (" + string(d.Reason) + "): the controller releases it"
		problems = append(problems, "held by the agent although the policy says not to capture it; if this persists, see the agent's log")
	default:
		r.Verdict = "not captured: " + string(d.Reason)
		if r.Annotation != "" {
			problems = append(problems, fmt.Sprintf("stale annotation %s=%q on a pod that is not captured; the controller clears it", ambient.RedirectionAnnotation, r.Annotation))
		}
	}
	r.Problems, r.OK = problems, len(problems) == 0
}

// orphan reports on a pod the agent holds whose object is no longer in the
// cache.
func (e *Explainer) orphan(ep nodeagent.EnrolledPod) *explainwire.Report {
	r := &explainwire.Report{
		Pod: ep.Namespace + "/" + ep.Name, UID: string(ep.UID),
		Policy: explainwire.Policy{Reason: string(enablement.ReasonNoPod)},
		Netns:  heldNetns(ep),
	}
	for _, a := range ep.IPs {
		r.IPs = append(r.IPs, a.String())
	}
	if in, ok := e.Agent.Inspect(ep.UID); ok {
		r.Captured = e.capture(in)
	}
	r.Verdict = "captured, but its pod object is gone: released at its CNI DEL or by the controller"
	r.Problems = []string{"held by the agent although the pod object is gone; if this persists, see the agent's log"}
	return r
}
