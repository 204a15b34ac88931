// Package decisiontable is one table of enablement cases (a pod, its
// namespace, the agent's policy) with the answer to "must this pod be
// captured, and why". Every place that asks the question feeds it to its
// own entry point (the policy itself, the agent's pod cache on the CNI
// path and for the snapshot, the pod controller, the verifier, the
// fallback binary's decision, the plugin's snapshot tier) and must get the
// same answers: the agent and the fallback binary decide by one function
// (enablement.Policy.Decide), and this table is what proves they still do.
package decisiontable

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// AgentNamespace and AgentPod name the agent's own pod in every case's
// policy (Policy.Self).
const (
	AgentNamespace = "ambient-cni"
	AgentPod       = "ambient-cni-x1"
)

// Case is one pod, its namespace and the policy, with the answer.
type Case struct {
	Name string
	// Excluded, DataPlane and Selectors (the enablement-selector setting
	// as an operator writes it; "" for Istio's default list) are the
	// agent's policy, which Policy and Wire render for the agent and for
	// the fallback binary's credential.
	Excluded, DataPlane []string
	Selectors           string
	Pod                 *corev1.Pod
	Namespace           *corev1.Namespace
	// Enroll and Reason are the answer.
	Enroll bool
	Reason enablement.Reason
	// Going: the pod is being deleted. It stays captured, but the verifier
	// neither proves it nor looks for it uncaptured: it is going.
	Going bool
}

// Policy is the case's policy as the agent holds it.
func (c Case) Policy() (enablement.Policy, error) {
	p := enablement.Policy{ExcludedNamespaces: c.Excluded, DataPlaneNamespaces: c.DataPlane,
		Self: types.NamespacedName{Namespace: AgentNamespace, Name: AgentPod}}
	if c.Selectors != "" {
		s, err := enablement.ParseSelectors([]byte(c.Selectors))
		if err != nil {
			return p, fmt.Errorf("case %s: %w", c.Name, err)
		}
		p.Selectors = s
	}
	return p, nil
}

// Wire is the case's policy as the plugin's credential carries it to the
// fallback binary.
func (c Case) Wire() plugincred.Policy {
	return plugincred.Policy{ExcludedNamespaces: c.Excluded, DataPlaneNamespaces: c.DataPlane, EnablementSelectors: c.Selectors,
		Self: &plugincred.ObjectRef{Namespace: AgentNamespace, Name: AgentPod}}
}

var (
	ambientLabel = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	noneLabel    = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone}
)

// pod is a running pod with an IP (its sandbox is up, so every entry
// point, the verifier's search included, has something to decide).
func pod(ns, name string, labels map[string]string, opts ...func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + name), Labels: labels,
			Annotations: map[string]string{}},
		Spec:   corev1.PodSpec{NodeName: "node-a"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.9.0.7", PodIPs: []corev1.PodIP{{IP: "10.9.0.7"}}},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func namespace(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Namespace"}, ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

func hostNetwork(p *corev1.Pod) { p.Spec.HostNetwork = true }
func succeeded(p *corev1.Pod)   { p.Status.Phase = corev1.PodSucceeded }
func sidecar(p *corev1.Pod) {
	p.Annotations[ambient.SidecarStatusAnnotation] = `{"containers":["istio-proxy"]}`
}
func beingDeleted(p *corev1.Pod) {
	now := metav1.Now()
	p.DeletionTimestamp = &now
	p.Finalizers = []string{"test/hold"}
}

// Cases returns the table, fresh objects each call. Each case is decided
// alone, with its own policy: two cases may name the same namespace with
// other labels.
func Cases() []Case {
	excl, dp := []string{"kube-system"}, []string{"istio-system"}
	def := func(c Case) Case { c.Excluded, c.DataPlane = excl, dp; return c }
	return []Case{
		def(Case{Name: "pod labelled ambient", Pod: pod("plain", "labelled", ambientLabel), Namespace: namespace("plain", nil),
			Enroll: true, Reason: enablement.ReasonPodLabel}),
		def(Case{Name: "namespace labelled ambient", Pod: pod("shop", "web", nil), Namespace: namespace("shop", ambientLabel),
			Enroll: true, Reason: enablement.ReasonNamespaceLabel}),
		def(Case{Name: "pod labelled none in an ambient namespace", Pod: pod("shop2", "opted-out", noneLabel), Namespace: namespace("shop2", ambientLabel),
			Reason: enablement.ReasonPodOptOut}),
		def(Case{Name: "neither labelled", Pod: pod("plain2", "app", nil), Namespace: namespace("plain2", nil),
			Reason: enablement.ReasonNotEnabled}),
		def(Case{Name: "hostNetwork pod in an ambient namespace", Pod: pod("shop3", "hostnet", nil, hostNetwork), Namespace: namespace("shop3", ambientLabel),
			Reason: enablement.ReasonHostNetwork}),
		def(Case{Name: "finished pod in an ambient namespace", Pod: pod("shop4", "done", nil, succeeded), Namespace: namespace("shop4", ambientLabel),
			Reason: enablement.ReasonTerminal}),
		def(Case{Name: "sidecar-injected pod in an ambient namespace", Pod: pod("shop5", "sidecar", nil, sidecar), Namespace: namespace("shop5", ambientLabel),
			Reason: enablement.ReasonSidecar}),
		def(Case{Name: "pod labelled ambient in an excluded namespace", Pod: pod("kube-system", "sys", ambientLabel), Namespace: namespace("kube-system", ambientLabel),
			Reason: enablement.ReasonExcludedNamespace}),
		def(Case{Name: "ztunnel in a data-plane namespace labelled ambient", Pod: pod("istio-system", "ztunnel-a", map[string]string{"app": "ztunnel"}),
			Namespace: namespace("istio-system", ambientLabel), Reason: enablement.ReasonDataPlanePod}),
		def(Case{Name: "tenant pod labelled ztunnel outside the data-plane namespaces", Pod: pod("shop6", "fake-ztunnel", map[string]string{"app": "ztunnel"}),
			Namespace: namespace("shop6", ambientLabel), Enroll: true, Reason: enablement.ReasonNamespaceLabel}),
		def(Case{Name: "terminating pod in an ambient namespace", Pod: pod("shop7", "going", nil, beingDeleted), Namespace: namespace("shop7", ambientLabel),
			Enroll: true, Reason: enablement.ReasonNamespaceLabel, Going: true}),
		// The agent's own pod is never captured, even where nothing else
		// exempts it (its namespace labelled ambient and not a data-plane
		// namespace, the pod not on the host network).
		def(Case{Name: "the agent's own pod in an ambient namespace", Pod: pod(AgentNamespace, AgentPod, nil), Namespace: namespace(AgentNamespace, ambientLabel),
			Reason: enablement.ReasonDataPlanePod}),
		{Name: "no namespace excluded", Pod: pod("kube-system", "sys-labelled", ambientLabel), Namespace: namespace("kube-system", nil),
			Enroll: true, Reason: enablement.ReasonPodLabel},
		def(Case{Name: "custom selector: pod label", Selectors: `[{podSelector: {matchLabels: {mesh: "on"}}}]`,
			Pod: pod("plain3", "mesh-on", map[string]string{"mesh": "on"}), Namespace: namespace("plain3", nil),
			Enroll: true, Reason: enablement.ReasonPodSelector}),
		def(Case{Name: "custom selector: ambient labels mean nothing", Selectors: `[{podSelector: {matchLabels: {mesh: "on"}}}]`,
			Pod: pod("shop8", "ambient-labelled", ambientLabel), Namespace: namespace("shop8", ambientLabel),
			Reason: enablement.ReasonNotSelected}),
		def(Case{Name: "custom selector: namespace", Selectors: `[{namespaceSelector: {matchLabels: {team: a}}}]`,
			Pod: pod("team-a", "member", nil), Namespace: namespace("team-a", map[string]string{"team": "a"}),
			Enroll: true, Reason: enablement.ReasonNamespaceSelector}),
		def(Case{Name: "custom selector: namespace and pod, pod not selected",
			Selectors: `[{namespaceSelector: {matchLabels: {team: b}}, podSelector: {matchExpressions: [{key: mesh, operator: Exists}]}}]`,
			Pod:       pod("team-b", "bystander", nil), Namespace: namespace("team-b", map[string]string{"team": "b"}),
			Reason: enablement.ReasonPodNotSelected}),
		def(Case{Name: "empty selector list", Selectors: `[]`, Pod: pod("shop9", "nobody", ambientLabel), Namespace: namespace("shop9", ambientLabel),
			Reason: enablement.ReasonNotSelected}),
	}
}
