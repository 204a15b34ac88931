// Package kubeclienttest adapts client-go's full clientset (a fake, or a
// test's own real one) to kubeclient.Interface, so tests that build
// objects with the clientset hand the agent the same cluster. Test code
// only: the agent's binary never links the clientset.
package kubeclienttest

import (
	"context"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/watchlist"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
)

// Clientset is kubeclient.Interface over a clientset.
type Clientset struct {
	kubernetes.Interface
}

var _ kubeclient.Interface = Clientset{}

// FromClientset adapts cs.
func FromClientset(cs kubernetes.Interface) Clientset { return Clientset{Interface: cs} }

// IsWatchListSemanticsUnSupported passes on the clientset's answer (a
// fake cannot stream the initial list), which the informers ask.
func (c Clientset) IsWatchListSemanticsUnSupported() bool {
	return watchlist.DoesClientNotSupportWatchListSemantics(c.Interface)
}

// Readyz implements kubeclient.Readiness.
// A fake clientset has no REST client: it always answers.
func (c Clientset) Readyz(ctx context.Context) error {
	rc, ok := c.Discovery().RESTClient().(*rest.RESTClient)
	if !ok || rc == nil {
		return nil
	}
	return rc.Get().AbsPath("/readyz").Do(ctx).Error()
}

// GetPod implements kubeclient.PodReader.
func (c Clientset) GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return c.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
}

// ListPods implements kubeclient.PodReader.
func (c Clientset) ListPods(ctx context.Context, namespace string, opts metav1.ListOptions) (*corev1.PodList, error) {
	return c.CoreV1().Pods(namespace).List(ctx, opts)
}

// WatchPods implements kubeclient.PodReader.
func (c Clientset) WatchPods(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error) {
	return c.CoreV1().Pods(namespace).Watch(ctx, opts)
}

// PatchPodStatus implements kubeclient.PodStatusPatcher.
func (c Clientset) PatchPodStatus(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) (*corev1.Pod, error) {
	return c.CoreV1().Pods(namespace).Patch(ctx, name, pt, data, metav1.PatchOptions{}, "status")
}

// GetNamespace implements kubeclient.NamespaceReader.
func (c Clientset) GetNamespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	return c.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
}

// ListNamespaces implements kubeclient.NamespaceReader.
func (c Clientset) ListNamespaces(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error) {
	return c.CoreV1().Namespaces().List(ctx, opts)
}

// WatchNamespaces implements kubeclient.NamespaceReader.
func (c Clientset) WatchNamespaces(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	return c.CoreV1().Namespaces().Watch(ctx, opts)
}

// GetNode implements kubeclient.Nodes.
func (c Clientset) GetNode(ctx context.Context, name string) (*corev1.Node, error) {
	return c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
}

// PatchNode implements kubeclient.Nodes.
func (c Clientset) PatchNode(ctx context.Context, name string, pt types.PatchType, data []byte) (*corev1.Node, error) {
	return c.CoreV1().Nodes().Patch(ctx, name, pt, data, metav1.PatchOptions{})
}

// GetDaemonSet implements kubeclient.DaemonSetReader.
func (c Clientset) GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error) {
	return c.AppsV1().DaemonSets(namespace).Get(ctx, name, metav1.GetOptions{})
}

// ListDaemonSets implements kubeclient.DaemonSetReader.
func (c Clientset) ListDaemonSets(ctx context.Context, namespace string, opts metav1.ListOptions) (*appsv1.DaemonSetList, error) {
	return c.AppsV1().DaemonSets(namespace).List(ctx, opts)
}

// ListServicesMetadata implements kubeclient.ServiceMetadataReader,
// cutting the full objects down to their metadata as the API server would.
func (c Clientset) ListServicesMetadata(ctx context.Context, namespace string, opts metav1.ListOptions) (*metav1.PartialObjectMetadataList, error) {
	l, err := c.CoreV1().Services(namespace).List(ctx, opts)
	if err != nil {
		return nil, err
	}
	out := &metav1.PartialObjectMetadataList{ListMeta: l.ListMeta}
	for i := range l.Items {
		out.Items = append(out.Items, *meta.AsPartialObjectMetadata(&l.Items[i]))
	}
	return out, nil
}

// WatchServicesMetadata implements kubeclient.ServiceMetadataReader,
// cutting the full objects down to their metadata as the API server would.
func (c Clientset) WatchServicesMetadata(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error) {
	w, err := c.CoreV1().Services(namespace).Watch(ctx, opts)
	if err != nil {
		return nil, err
	}
	return watch.Filter(w, func(e watch.Event) (watch.Event, bool) {
		if o, ok := e.Object.(metav1.Object); ok && e.Type != watch.Error {
			e.Object = meta.AsPartialObjectMetadata(o)
		}
		return e, true
	}), nil
}

// DeleteService implements kubeclient.ServiceDeleter.
func (c Clientset) DeleteService(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error {
	return c.CoreV1().Services(namespace).Delete(ctx, name, opts)
}

// DeleteDaemonSet implements kubeclient.DaemonSetDeleter.
func (c Clientset) DeleteDaemonSet(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error {
	return c.AppsV1().DaemonSets(namespace).Delete(ctx, name, opts)
}

// CreateEvent implements kubeclient.Events.
func (c Clientset) CreateEvent(ctx context.Context, e *corev1.Event) (*corev1.Event, error) {
	return c.CoreV1().Events(e.Namespace).Create(ctx, e, metav1.CreateOptions{})
}

// UpdateEvent implements kubeclient.Events.
func (c Clientset) UpdateEvent(ctx context.Context, e *corev1.Event) (*corev1.Event, error) {
	return c.CoreV1().Events(e.Namespace).Update(ctx, e, metav1.UpdateOptions{})
}

// PatchEvent implements kubeclient.Events.
func (c Clientset) PatchEvent(ctx context.Context, e *corev1.Event, data []byte) (*corev1.Event, error) {
	return c.CoreV1().Events(e.Namespace).Patch(ctx, e.Name, types.StrategicMergePatchType, data, metav1.PatchOptions{})
}

// CreateToken implements kubeclient.ServiceAccountTokens.
func (c Clientset) CreateToken(ctx context.Context, namespace, name string, tr *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	return c.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, tr, metav1.CreateOptions{})
}
