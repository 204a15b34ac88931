package kubeenv

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// CreateReleaseSignal creates the release's signal Service name in ns as
// the chart renders it (headless, no selector, no ports), unless it
// exists: what the agents watch, whose deletion is an uninstall.
func CreateReleaseSignal(ctx context.Context, c kubernetes.Interface, ns, name string) error {
	s := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels: map[string]string{"service.kubernetes.io/service-proxy-name": "ambient-cni-release-signal"}},
		Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone},
	}
	if _, err := c.CoreV1().Services(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create release signal %s/%s: %w", ns, name, err)
	}
	return nil
}

// DeleteReleaseSignal deletes it, as helm's uninstall and its hook do
// first; one already gone is no error.
func DeleteReleaseSignal(ctx context.Context, c kubernetes.Interface, ns, name string) error {
	if err := c.CoreV1().Services(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete release signal %s/%s: %w", ns, name, err)
	}
	return nil
}
