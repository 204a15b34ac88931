package kubeadapter

import (
	"context"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/test/kubeenv"
)

// TestUpgradeChecker runs against a real API server: the plugin stays
// installed only while the agent's DaemonSet exists and is not being
// deleted; losing the RBAC (helm uninstall removes it before the pods
// stop) counts as an uninstall.
func TestUpgradeChecker(t *testing.T) {
	env := kubeenv.Start(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	check := func(c kubernetes.Interface) bool {
		t.Helper()
		up, err := DaemonSetUpgradeChecker{Client: c, Namespace: ns, Name: "ambient-cni"}.IsUpgrade(ctx)
		if err != nil {
			t.Fatalf("IsUpgrade: %v", err)
		}
		return up
	}
	if check(env.Client) {
		t.Error("no DaemonSet: reported an upgrade")
	}
	labels := map[string]string{"app": "x"}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "ambient-cni", Namespace: ns, Finalizers: []string{"test.ambient-cni/hold"}},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}},
			},
		},
	}
	if _, err := env.Client.AppsV1().DaemonSets(ns).Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if !check(env.Client) {
		t.Error("DaemonSet present: not reported as an upgrade")
	}
	_, noRights := env.ServiceAccountClient(t, ns, "no-rights", []byte{})
	if check(noRights) {
		t.Error("forbidden (RBAC gone): reported an upgrade")
	}
	if err := env.Client.AppsV1().DaemonSets(ns).Delete(ctx, "ambient-cni", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if check(env.Client) {
		t.Error("DaemonSet being deleted: reported an upgrade")
	}
	// Let the DaemonSet go.
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	if _, err := env.Client.AppsV1().DaemonSets(ns).Patch(ctx, "ambient-cni", "application/merge-patch+json", patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}
