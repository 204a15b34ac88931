// Package enablement is the ambient enablement policy as pure functions
// over Pod and Namespace objects. It lives apart from package ambient so
// the CNI plugin, which needs only the wire contract, does not link the
// Kubernetes API types.
package enablement

import (
	"net/netip"
	"slices"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"

	corev1 "k8s.io/api/core/v1"
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
}

// DefaultPolicy returns the policy with the compatibility defaults.
func DefaultPolicy() Policy {
	return Policy{ExcludedNamespaces: []string{ambient.DefaultExcludedNamespace}}
}

// Reason explains an enablement decision; it is stable text for logs,
// events and metrics labels.
type Reason string

// Reasons a pod is or is not enrolled.
const (
	ReasonPodLabel          Reason = "pod labelled ambient"
	ReasonNamespaceLabel    Reason = "namespace labelled ambient"
	ReasonNotEnabled        Reason = "neither pod nor namespace labelled ambient"
	ReasonPodOptOut         Reason = "pod labelled none"
	ReasonHostNetwork       Reason = "hostNetwork pod"
	ReasonSidecar           Reason = "sidecar-injected pod"
	ReasonExcludedNamespace Reason = "namespace excluded"
	ReasonDataPlanePod      Reason = "ztunnel or node-agent pod"
	ReasonTerminal          Reason = "pod phase is terminal"
	ReasonDeleting          Reason = "pod is being deleted"
	ReasonNoPod             Reason = "no pod"
)

// Decision is the outcome of the enablement policy for one pod.
type Decision struct {
	Enroll bool
	Reason Reason
}

// IsExcludedNamespace reports whether ns is in the excluded list.
func (p Policy) IsExcludedNamespace(ns string) bool {
	return slices.Contains(p.ExcludedNamespaces, ns)
}

// Decide applies the enablement rule to a pod and its namespace (ns may be
// nil when the namespace is unknown, which counts as not labelled).
func (p Policy) Decide(pod *corev1.Pod, ns *corev1.Namespace) Decision {
	switch {
	case pod == nil:
		return Decision{false, ReasonNoPod}
	case pod.Spec.HostNetwork:
		return Decision{false, ReasonHostNetwork}
	case IsTerminal(pod):
		return Decision{false, ReasonTerminal}
	case pod.DeletionTimestamp != nil:
		return Decision{false, ReasonDeleting}
	case hasKey(pod.Annotations, ambient.SidecarStatusAnnotation):
		return Decision{false, ReasonSidecar}
	case p.IsExcludedNamespace(pod.Namespace):
		return Decision{false, ReasonExcludedNamespace}
	case IsDataPlanePod(pod):
		return Decision{false, ReasonDataPlanePod}
	}
	switch pod.Labels[ambient.DataplaneModeLabel] {
	case ambient.DataplaneModeAmbient:
		return Decision{true, ReasonPodLabel}
	case ambient.DataplaneModeNone:
		return Decision{false, ReasonPodOptOut}
	}
	if ns != nil && ns.Labels[ambient.DataplaneModeLabel] == ambient.DataplaneModeAmbient {
		return Decision{true, ReasonNamespaceLabel}
	}
	return Decision{false, ReasonNotEnabled}
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

// NamespaceEnabled reports whether a namespace carries the ambient label.
func NamespaceEnabled(ns *corev1.Namespace) bool {
	return ns != nil && ns.Labels[ambient.DataplaneModeLabel] == ambient.DataplaneModeAmbient
}

// DNSCapture resolves the per-pod DNS capture override against a default.
func DNSCapture(pod *corev1.Pod, def bool) bool {
	if pod == nil {
		return def
	}
	switch pod.Annotations[ambient.DNSCaptureAnnotation] {
	case "true":
		return true
	case "false":
		return false
	}
	return def
}

// BypassInbound reports whether the pod asked for no inbound redirection.
func BypassInbound(pod *corev1.Pod) bool {
	return pod != nil && pod.Annotations[ambient.BypassInboundCaptureAnnotation] == "true"
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
