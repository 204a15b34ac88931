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
	Verified func(uid types.UID) (Verification, bool)
	// Policy is the enablement policy the agent decides with, for the
	// notes on a decision (why a data-plane label did not exempt a pod).
	Policy enablement.Policy
}

// Report explains one pod.
type Report struct {
	// Pod is namespace/name.
	Pod   string    `json:"pod"`
	UID   types.UID `json:"uid,omitempty"`
	Phase string    `json:"phase,omitempty"`
	// Terminating: the pod has a deletionTimestamp (it stays captured
	// until it is gone).
	Terminating bool     `json:"terminating,omitempty"`
	IPs         []string `json:"ips,omitempty"`
	// Verdict is the one-line answer; OK is false when something needs
	// attention, and Problems says what.
	Verdict  string   `json:"verdict"`
	OK       bool     `json:"ok"`
	Problems []string `json:"problems,omitempty"`
	Policy   Policy   `json:"policy"`
	// Captured is the agent's state for the pod; absent when the agent
	// does not hold it.
	Captured *Capture `json:"captured,omitempty"`
	Netns    Netns    `json:"netns"`
	// Annotation is the pod's ambient.istio.io/redirection as the agent's
	// cache sees it ("" when absent): what istiod reads.
	Annotation string `json:"annotation"`
}

// Policy is the enablement decision.
type Policy struct {
	Capture bool   `json:"capture"`
	Reason  string `json:"reason"`
	// PodLabel and NamespaceLabel are the istio.io/dataplane-mode labels.
	PodLabel       string `json:"podLabel,omitempty"`
	NamespaceLabel string `json:"namespaceLabel,omitempty"`
	// Selector is the 1-based index of the enablement selector entry that
	// enabled the pod (0, omitted, when none did).
	Selector int `json:"selector,omitempty"`
	// Note says what the decision did not follow, when that matters: a
	// data-plane label outside the data-plane namespaces.
	Note string `json:"note,omitempty"`
}

// Capture is the agent's state for a captured pod.
type Capture struct {
	// State is the redirection state: pending (rules in place, ztunnel
	// has not acknowledged) or enabled.
	State        string `json:"state"`
	ZtunnelAcked bool   `json:"ztunnelAcked"`
	// Via is "cni" (captured at its CNI ADD, SandboxID set) or
	// "controller" (captured while running).
	Via       string    `json:"via"`
	SandboxID string    `json:"sandboxID,omitempty"`
	Since     time.Time `json:"since"`
	Rules     Rules     `json:"rules"`
	// Verification is the verifier's last proof of the pod; absent
	// before the first (or with the verifier off).
	Verification *Verification `json:"verification,omitempty"`
}

// Verification is the outcome of the verifier's last proof of a pod.
type Verification struct {
	At time.Time `json:"at"`
	// Proven: the pod was proven captured (after any repair).
	Proven bool `json:"proven"`
	// Found is the drift the proof found (and repaired, when Repaired).
	Found    []string `json:"found,omitempty"`
	Repaired bool     `json:"repaired,omitempty"`
	// Problem says why the pod is not proven.
	Problem string `json:"problem,omitempty"`
	// LastDriftAt and LastDrift are the latest proof that found drift.
	LastDriftAt *time.Time `json:"lastDriftAt,omitempty"`
	LastDrift   []string   `json:"lastDrift,omitempty"`
}

// Rules is the result of verifying the pod's rules just now.
type Rules struct {
	Backend string `json:"backend,omitempty"`
	// Clean: the rules in the pod are exactly what the agent applied.
	Clean bool `json:"clean"`
	// Drift names each difference; Error says why they could not be read.
	Drift             []string `json:"drift,omitempty"`
	Error             string   `json:"error,omitempty"`
	DNSCapture        bool     `json:"dnsCapture"`
	InboundCapture    bool     `json:"inboundCapture"`
	VirtualInterfaces []string `json:"virtualInterfaces,omitempty"`
}

// Netns says whether the pod's network namespace was found.
type Netns struct {
	Found bool   `json:"found"`
	How   string `json:"how"`
	Path  string `json:"path,omitempty"`
	Inode uint64 `json:"inode,omitempty"`
}

// NodeReport explains every pod of the node.
type NodeReport struct {
	RulesBackend       string    `json:"rulesBackend,omitempty"`
	ZtunnelConnections *int      `json:"ztunnelConnections,omitempty"`
	ReleaseSignal      string    `json:"releaseSignal,omitempty"`
	Pods               int       `json:"pods"`
	Captured           int       `json:"captured"`
	WithProblems       int       `json:"withProblems"`
	Reports            []*Report `json:"reports"`
}

// Explain reports on one pod: in the pod cache, or only in the agent's
// state (its object is gone). A pod neither knows is health.ErrNoSuchPod.
func (e *Explainer) Explain(_ context.Context, namespace, name string) (*Report, error) {
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
func (e *Explainer) ExplainAll(_ context.Context) *NodeReport {
	pods, _ := e.Pods.Pods()
	slices.SortFunc(pods, func(a, b *corev1.Pod) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
	found := e.find(pods)
	defer found.close()
	out := &NodeReport{RulesBackend: e.Backend, Reports: []*Report{}}
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

func (e *Explainer) report(p *corev1.Pod, found *scan) *Report {
	d := e.Pods.DecideCached(p)
	r := &Report{
		Pod: p.Namespace + "/" + p.Name, UID: p.UID, Phase: string(p.Status.Phase),
		Terminating: p.DeletionTimestamp != nil,
		Policy:      Policy{Capture: d.Enroll, Reason: string(d.Reason), PodLabel: p.Labels[ambient.DataplaneModeLabel], Selector: d.Selector},
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
func heldNetns(ep nodeagent.EnrolledPod) Netns {
	if ep.Unresolved {
		return Netns{How: "not found since the agent restarted: the agent keeps the pod in ztunnel (ZDS Keep) and its rules in place until it finds it (its capture record names the path shown)", Path: ep.Netns}
	}
	return Netns{Found: true, How: "held by the agent since it captured the pod", Path: ep.Netns, Inode: ep.NetnsID}
}

func (e *Explainer) capture(in nodeagent.Inspection) *Capture {
	c := &Capture{
		State: string(in.State), ZtunnelAcked: in.State == nodeagent.StateEnabled,
		Via: "controller", SandboxID: in.SandboxID, Since: in.Since,
		Rules: Rules{
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

func (e *Explainer) netnsOf(p *corev1.Pod, d enablement.Decision, ips []netip.Addr, found *scan) Netns {
	switch {
	case !d.Enroll:
		return Netns{How: "not looked for: the pod is not to be captured"}
	case len(ips) == 0:
		return Netns{How: "not looked for: the pod has no IP yet (its sandbox is being set up; its CNI ADD captures it)"}
	}
	if ns, ok := found.m[p.UID]; ok {
		return Netns{Found: true, How: "found by a /proc scan just now (a process of the pod in a namespace holding its IP)", Path: ns.Source(), Inode: ns.ID()}
	}
	how := "not found by a /proc scan just now: no process of the pod (by its kubelet cgroup) in a network namespace holding its IPs"
	if found.err != nil {
		how += fmt.Sprintf(" (the scan reported: %v)", found.err)
	}
	return Netns{How: how}
}

// judge sets the verdict, OK and the problems.
func (e *Explainer) judge(r *Report, p *corev1.Pod, d enablement.Decision, ips []netip.Addr) {
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
func (e *Explainer) orphan(ep nodeagent.EnrolledPod) *Report {
	r := &Report{
		Pod: ep.Namespace + "/" + ep.Name, UID: ep.UID,
		Policy: Policy{Reason: string(enablement.ReasonNoPod)},
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
