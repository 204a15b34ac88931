package podcache

import (
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

// PodAnnotations are the only pod annotations the cache keeps: those the
// enablement policy, the capture rules, the restore and the explain view
// read. Any other annotation (kubectl's last-applied configuration, a
// tool's large JSON) never enters the agent's memory.
var PodAnnotations = []string{
	ambient.RedirectionAnnotation,
	ambient.SidecarStatusAnnotation,
	ambient.DNSCaptureAnnotation,
	ambient.BypassInboundCaptureAnnotation,
	ambient.RerouteVirtualInterfacesAnnotation,
}

// TrimPod is the pod informer's transform: what enters the cache is what
// the agent reads of a pod (identity, labels, the annotations in
// PodAnnotations, deletion, node, host network, service account, phase and
// IPs), so the cache's size does not grow with what users put in their
// pods. The sidecar status annotation is kept as a key only: its presence
// is what counts, its value is a large JSON blob. Of the init containers
// only Istio's istio-validation is kept, by name alone: it tells a sidecar
// pod that expects istio-cni (enablement.ExpectsIstioCNI).
func TrimPod(o any) (any, error) {
	p, ok := o.(*corev1.Pod)
	if !ok {
		return o, nil
	}
	out := &corev1.Pod{
		ObjectMeta: trimMeta(p.ObjectMeta),
		Spec: corev1.PodSpec{
			NodeName:           p.Spec.NodeName,
			HostNetwork:        p.Spec.HostNetwork,
			ServiceAccountName: p.Spec.ServiceAccountName,
		},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs},
	}
	for _, c := range p.Spec.InitContainers {
		if c.Name == ambient.IstioValidationInitContainer {
			out.Spec.InitContainers = []corev1.Container{{Name: c.Name}}
			break
		}
	}
	for _, k := range PodAnnotations {
		v, ok := p.Annotations[k]
		if !ok {
			continue
		}
		if out.Annotations == nil {
			out.Annotations = map[string]string{}
		}
		if k == ambient.SidecarStatusAnnotation {
			v = ""
		}
		out.Annotations[k] = v
	}
	return out, nil
}

// NamespaceLabelKeys are the namespace label keys the cache keeps for
// policy: those its enablement selectors read (the decisions, the plugin's
// snapshot and the test of whether a namespace change matters read no
// other) and the dataplane-mode label, which the explain view shows.
func NamespaceLabelKeys(policy enablement.Policy) []string {
	keys := policy.Selectors.NamespaceLabelKeys()
	if !slices.Contains(keys, ambient.DataplaneModeLabel) {
		keys = append(keys, ambient.DataplaneModeLabel)
		slices.Sort(keys)
	}
	return keys
}

// NamespaceTransform is the namespace informer's transform: every
// namespace of the cluster is cached, and anyone allowed to create
// namespaces decides how large they are, so what enters the cache is the
// namespace's name, resourceVersion (the informer tells a relist's
// changed objects from unchanged ones by it), deletion time and its
// labels of the given keys (NamespaceLabelKeys), never its annotations,
// other labels, spec or status. It looks keys up rather than walking the
// labels, so a namespace with thousands of labels costs no more time than
// one with two.
func NamespaceTransform(keys []string) func(any) (any, error) {
	keys = slices.Clone(keys)
	return func(o any) (any, error) {
		n, ok := o.(*corev1.Namespace)
		if !ok {
			return o, nil
		}
		// Nothing reads a namespace's UID: a namespace deleted and made
		// again under its name comes as a delete and an add.
		m := metav1.ObjectMeta{Name: n.Name, ResourceVersion: n.ResourceVersion, DeletionTimestamp: n.DeletionTimestamp}
		for _, k := range keys {
			v, ok := n.Labels[k]
			if !ok {
				continue
			}
			if m.Labels == nil {
				m.Labels = make(map[string]string, len(keys))
			}
			m.Labels[k] = v
		}
		return &corev1.Namespace{ObjectMeta: m}, nil
	}
}

// trimMeta keeps identity, labels and deletion state; annotations are the
// caller's choice.
func trimMeta(m metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name: m.Name, Namespace: m.Namespace, UID: m.UID, ResourceVersion: m.ResourceVersion,
		Labels: m.Labels, DeletionTimestamp: m.DeletionTimestamp, DeletionGracePeriodSeconds: m.DeletionGracePeriodSeconds,
	}
}
