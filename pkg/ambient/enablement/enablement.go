// Package enablement is the ambient enablement policy as pure functions
// over Pod and Namespace objects. It lives apart from package ambient so
// the CNI plugin, which needs only the wire contract, does not link the
// Kubernetes API types.
package enablement

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
)

// Labels that identify pods which must never be captured because they are
// part of the data plane itself.
const (
	// ZtunnelAppLabelValue is the "app" label value of ztunnel pods.
	ZtunnelAppLabelValue = "ztunnel"
	// AgentNameLabel and AgentNameLabelValue identify this project's own pods.
	AgentNameLabel = "app.kubernetes.io/name"
	// AgentNameLabelValue is the value of AgentNameLabel on the node agent's pods.
	AgentNameLabelValue = "ambient-cni"
)

// Policy is the enablement policy. The zero value excludes no namespace;
// use DefaultPolicy for the compatibility defaults.
type Policy struct {
	// ExcludedNamespaces are never enrolled.
	ExcludedNamespaces []string
	// DataPlaneNamespaces are where the data-plane labels (IsDataPlanePod)
	// exempt a pod: the agent's and ztunnel's own namespaces. Elsewhere
	// the labels mean nothing, or any tenant could take a pod out of the
	// mesh by labelling it app=ztunnel (Istio exempts app=ztunnel only in
	// its system namespace). Empty: the labels exempt no pod.
	DataPlaneNamespaces []string
	// Selectors decide, past the exclusions, which pods are enabled
	// (istio-cni's enablement selectors). Nil: Istio's default list.
	Selectors *Selectors
	// Self is the node agent's own pod, never enrolled whatever its
	// labels and namespace; empty names no pod.
	Self types.NamespacedName
}

// DefaultDataPlaneNamespace is Istio's system namespace, where its chart
// runs ztunnel and istio-cni.
const DefaultDataPlaneNamespace = "istio-system"

// DefaultPolicy returns the policy with the compatibility defaults.
func DefaultPolicy() Policy {
	return Policy{ExcludedNamespaces: []string{ambient.DefaultExcludedNamespace}, DataPlaneNamespaces: []string{DefaultDataPlaneNamespace}}
}

// ErrUnanswered marks a decision that needed the API server (the pod was
// not in the agent's cache) and got no answer from it: down, unreachable,
// refusing the credential or too slow. The pod's labels are then unknown.
// An answer that the pod does not exist is not this error.
var ErrUnanswered = errors.New("the API server cannot be asked")

// Reason explains an enablement decision; it is stable text for logs,
// events and metrics labels.
type Reason string

// Reasons a pod is or is not enrolled.
const (
	ReasonPodLabel       Reason = "pod labelled ambient"
	ReasonNamespaceLabel Reason = "namespace labelled ambient"
	ReasonNotEnabled     Reason = "neither pod nor namespace labelled ambient"
	ReasonPodOptOut      Reason = "pod labelled none"
	// With a list other than Istio's default the reasons name selectors,
	// not labels; Decision.Selector says which entry matched.
	ReasonPodSelector       Reason = "pod labels match an enablement selector"
	ReasonNamespaceSelector Reason = "namespace matches an enablement selector"
	ReasonPodNotSelected    Reason = "namespace matches an enablement selector, the pod's labels do not"
	ReasonNotSelected       Reason = "no enablement selector matches"
	ReasonHostNetwork       Reason = "hostNetwork pod"
	ReasonSidecar           Reason = "sidecar-injected pod"
	ReasonExcludedNamespace Reason = "namespace excluded"
	ReasonDataPlanePod      Reason = "ztunnel or node-agent pod"
	ReasonTerminal          Reason = "pod phase is terminal"
	ReasonNoPod             Reason = "no pod"
)

// Decision is the outcome of the enablement policy for one pod.
type Decision struct {
	Enroll bool
	Reason Reason
	// Selector is the 1-based index of the enablement selector entry that
	// enabled the pod; 0 when none did.
	Selector int
}

// IsExcludedNamespace reports whether ns is in the excluded list.
func (p Policy) IsExcludedNamespace(ns string) bool {
	return slices.Contains(p.ExcludedNamespaces, ns)
}

// Decide applies the enablement rule to a pod and its namespace (ns may be
// nil when the namespace is unknown, which counts as not labelled). It is
// the one answer to "must this pod be captured, and why": the CNI path,
// the pod controller, the verifier, the explain view and the plugin's
// snapshot ask it through the agent's pod cache, and the plugin's fallback
// binary asks it with the policy the agent hands over in the plugin's
// credential. A pod
// being deleted (deletionTimestamp set) is decided like any other: it stays
// in the mesh through its grace period, so its preStop hooks and draining
// connections keep going through ztunnel, until its object is gone or its
// phase is terminal, as in Istio.
func (p Policy) Decide(pod *corev1.Pod, ns *corev1.Namespace) Decision {
	switch {
	case pod == nil:
		return Decision{Reason: ReasonNoPod}
	case p.Self.Name != "" && pod.Namespace == p.Self.Namespace && pod.Name == p.Self.Name:
		return Decision{Reason: ReasonDataPlanePod}
	case pod.Spec.HostNetwork:
		return Decision{Reason: ReasonHostNetwork}
	case IsTerminal(pod):
		return Decision{Reason: ReasonTerminal}
	case hasKey(pod.Annotations, ambient.SidecarStatusAnnotation):
		return Decision{Reason: ReasonSidecar}
	case p.IsExcludedNamespace(pod.Namespace):
		return Decision{Reason: ReasonExcludedNamespace}
	case IsDataPlanePod(pod) && slices.Contains(p.DataPlaneNamespaces, pod.Namespace):
		return Decision{Reason: ReasonDataPlanePod}
	}
	var nsLabels map[string]string
	if ns != nil {
		nsLabels = ns.Labels
	}
	return p.Selectors.decide(pod.Labels, nsLabels)
}

// decide applies the selector list past the exclusions. With Istio's
// default list the reasons name its labels, as they always did.
func (s *Selectors) decide(podLabels, nsLabels map[string]string) Decision {
	s = s.orDefault()
	if i := s.match(podLabels, nsLabels); i > 0 {
		e := s.entries[i-1]
		podLevel := e.anyNamespace && e.needsPodLabels
		switch {
		case podLevel && s.builtin:
			return Decision{Enroll: true, Reason: ReasonPodLabel, Selector: i}
		case s.builtin:
			return Decision{Enroll: true, Reason: ReasonNamespaceLabel, Selector: i}
		case podLevel:
			return Decision{Enroll: true, Reason: ReasonPodSelector, Selector: i}
		}
		return Decision{Enroll: true, Reason: ReasonNamespaceSelector, Selector: i}
	}
	if s.builtin {
		if podLabels[ambient.DataplaneModeLabel] == ambient.DataplaneModeNone {
			return Decision{Reason: ReasonPodOptOut}
		}
		return Decision{Reason: ReasonNotEnabled}
	}
	for _, e := range s.entries {
		if !e.anyNamespace && e.ns.Matches(labels.Set(nsLabels)) {
			return Decision{Reason: ReasonPodNotSelected}
		}
	}
	return Decision{Reason: ReasonNotSelected}
}

// IsTerminal reports whether the pod has finished (Succeeded or Failed).
func IsTerminal(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

// IsDataPlanePod reports whether pod is a ztunnel or node-agent pod.
func IsDataPlanePod(pod *corev1.Pod) bool {
	return pod.Labels["app"] == ZtunnelAppLabelValue ||
		pod.Labels[AgentNameLabel] == ZtunnelAppLabelValue ||
		pod.Labels[AgentNameLabel] == AgentNameLabelValue
}

// IgnoresDataPlaneLabel reports whether pod carries a data-plane label
// that does not exempt it, being outside DataPlaneNamespaces.
func (p Policy) IgnoresDataPlaneLabel(pod *corev1.Pod) bool {
	return pod != nil && IsDataPlanePod(pod) && !slices.Contains(p.DataPlaneNamespaces, pod.Namespace)
}

// MayEnableNamespace reports whether a pod of ns, not excluded, may be
// enabled whatever its own labels (see Selectors.MayEnableNamespace): what
// the plugin's snapshot lists as an enabled namespace.
func (p Policy) MayEnableNamespace(ns *corev1.Namespace) bool {
	return ns != nil && !p.IsExcludedNamespace(ns.Name) && p.Selectors.MayEnableNamespace(ns.Labels)
}

// boolAnnotation reads a boolean annotation as Istio does
// (strconv.ParseBool: 1, t, T, TRUE, true, True, 0, f, ...); a missing or
// unparsable value is reported as absent.
func boolAnnotation(pod *corev1.Pod, key string) (value, ok bool) {
	if pod == nil {
		return false, false
	}
	v, present := pod.Annotations[key]
	if !present {
		return false, false
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, false
	}
	return b, true
}

// DNSCapture resolves the per-pod DNS capture override against a default.
func DNSCapture(pod *corev1.Pod, def bool) bool {
	if v, ok := boolAnnotation(pod, ambient.DNSCaptureAnnotation); ok {
		return v
	}
	return def
}

// boolAnnotations are the boolean pod annotations the agent reads.
var boolAnnotations = []string{ambient.DNSCaptureAnnotation, ambient.BypassInboundCaptureAnnotation}

// InvalidAnnotations describes each boolean annotation of the pod whose
// value does not parse, and so is treated as absent, for the pod's events,
// the agent's log and the explain view.
func InvalidAnnotations(pod *corev1.Pod) []string {
	if pod == nil {
		return nil
	}
	var out []string
	for _, k := range boolAnnotations {
		v, present := pod.Annotations[k]
		if !present {
			continue
		}
		if _, err := strconv.ParseBool(v); err != nil {
			out = append(out, fmt.Sprintf("annotation %s=%q is not a boolean (true or false); it is ignored as if absent", k, v))
		}
	}
	return out
}

// ExpectsIstioCNI reports whether the pod was injected to rely on istio-cni
// for its sidecar's traffic redirection: it has Istio's istio-validation
// init container, which sets up nothing and only checks the redirection
// istio-cni's sidecar mode puts in place. ambient-cni has no sidecar mode,
// so on a node it serves such a pod stays in that init container.
func ExpectsIstioCNI(pod *corev1.Pod) bool {
	if pod == nil {
		return false
	}
	return slices.ContainsFunc(pod.Spec.InitContainers, func(c corev1.Container) bool {
		return c.Name == ambient.IstioValidationInitContainer
	})
}

// IstioCNIExpected is what the agent says about a pod ExpectsIstioCNI
// reports (its Event, its log and the explain view); "" for any other pod.
func IstioCNIExpected(pod *corev1.Pod) string {
	if !ExpectsIstioCNI(pod) {
		return ""
	}
	return fmt.Sprintf("the pod was injected for istio-cni's sidecar mode (init container %s, Istio's pilot.cni.enabled), "+
		"which ambient-cni does not provide: it replaces istio-cni for ambient pods only, so nothing sets up this sidecar's "+
		"traffic redirection and %s keeps the pod from starting; run sidecar pods that rely on istio-cni on nodes "+
		"where istio-cni is installed, or inject them with istio-init instead (pilot.cni.enabled=false)",
		ambient.IstioValidationInitContainer, ambient.IstioValidationInitContainer)
}

// BypassInbound reports whether the pod asked for no inbound redirection.
func BypassInbound(pod *corev1.Pod) bool {
	v, _ := boolAnnotation(pod, ambient.BypassInboundCaptureAnnotation)
	return v
}

// VirtualInterfaces lists the interfaces named by the pod's
// reroute-virtual-interfaces annotation, split on commas and trimmed, in
// order, empty entries dropped (as Istio reads it). Names are not checked
// here: the rule set's validation rejects a bad one with a clear error.
func VirtualInterfaces(pod *corev1.Pod) []string {
	if pod == nil {
		return nil
	}
	var out []string
	for s := range strings.SplitSeq(pod.Annotations[ambient.RerouteVirtualInterfacesAnnotation], ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func hasKey(m map[string]string, k string) bool {
	_, ok := m[k]
	return ok
}

// PodIPs lists the pod's IPs from its status (status.podIPs, or the legacy
// status.podIP), IPv4-mapped addresses unmapped.
func PodIPs(pod *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && pod.Status.PodIP != "" {
		if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}
