package podcache

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
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

// TrimNamespace is the namespace informer's transform: a namespace is
// decided by its labels alone, so its annotations, spec and status (every
// namespace of the cluster is cached, and anyone allowed to create
// namespaces could fill them) are dropped.
func TrimNamespace(o any) (any, error) {
	n, ok := o.(*corev1.Namespace)
	if !ok {
		return o, nil
	}
	return &corev1.Namespace{ObjectMeta: trimMeta(n.ObjectMeta)}, nil
}

// trimMeta keeps identity, labels and deletion state; annotations are the
// caller's choice.
func trimMeta(m metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name: m.Name, Namespace: m.Namespace, UID: m.UID, ResourceVersion: m.ResourceVersion,
		Labels: m.Labels, DeletionTimestamp: m.DeletionTimestamp, DeletionGracePeriodSeconds: m.DeletionGracePeriodSeconds,
	}
}
