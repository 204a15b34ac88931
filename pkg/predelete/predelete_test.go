package predelete

import (
	"context"
	"errors"
	"os"
	"slices"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

var kube kubeenv.Shared

func TestMain(m *testing.M) { os.Exit(kube.Run(m)) }

func daemonSet(ns string) *appsv1.DaemonSet {
	labels := map[string]string{"app": "agent"}
	return &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "ambient-cni", Namespace: ns},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}},
			},
		},
	}
}

// Against a real API server (no garbage collector runs there, so the test
// plays it): the DaemonSet is deleted in the foreground — it stays, marked
// for deletion with the foregroundDeletion finalizer, while its pods go —
// and the hook returns only once it is gone. The release's signal is gone
// by the time the DaemonSet is being deleted: the agents see it first.
func TestDeleteDaemonSetWaitsForForegroundDeletion(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	if _, err := env.Client.AppsV1().DaemonSets(ns).Create(ctx, daemonSet(ns), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	signal := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "ambient-cni-installed", Namespace: ns},
		Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone}}
	if _, err := env.Client.CoreV1().Services(ns).Create(ctx, signal, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- DeleteDaemonSet(ctx, Options{Client: adminClient(t, env), Namespace: ns, Name: "ambient-cni",
			ReleaseSignal: signal.Name, Poll: 20 * time.Millisecond})
	}()
	deadline := time.Now().Add(time.Minute)
	for {
		ds, err := env.Client.AppsV1().DaemonSets(ns).Get(ctx, "ambient-cni", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if ds.DeletionTimestamp != nil {
			if !slices.Contains(ds.Finalizers, metav1.FinalizerDeleteDependents) {
				t.Fatalf("deleted without foreground propagation: finalizers %v", ds.Finalizers)
			}
			if _, err := env.Client.CoreV1().Services(ns).Get(ctx, signal.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				t.Fatalf("DaemonSet being deleted, the release signal not deleted first: %v", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the DaemonSet was never deleted")
		}
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("returned while the DaemonSet (and its pods) still exist: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	// The garbage collector, once the pods are gone, drops the finalizer.
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	if _, err := env.Client.AppsV1().DaemonSets(ns).Patch(ctx, "ambient-cni", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("did not return after the DaemonSet was gone")
	}
}

func TestDeleteDaemonSetAlreadyGone(t *testing.T) {
	env := kube.Env(t)
	ns := env.CreateNamespace(t, "", nil).Name
	if err := DeleteDaemonSet(context.Background(), Options{Client: adminClient(t, env), Namespace: ns, Name: "ambient-cni"}); err != nil {
		t.Fatalf("no DaemonSet: %v", err)
	}
}

// A DaemonSet that never goes (its pods cannot stop) ends in a clear
// error when the deadline passes, so helm reports the failed hook.
func TestDeleteDaemonSetTimesOut(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	if _, err := env.Client.AppsV1().DaemonSets(ns).Create(ctx, daemonSet(ns), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = env.Client.AppsV1().DaemonSets(ns).Patch(ctx, "ambient-cni", types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	})
	tctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	err := DeleteDaemonSet(tctx, Options{Client: adminClient(t, env), Namespace: ns, Name: "ambient-cni", Poll: 20 * time.Millisecond})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want a deadline error, got %v", err)
	}
}

// Without the right to delete the DaemonSet the hook fails at once.
func TestDeleteDaemonSetForbidden(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	if _, err := env.Client.AppsV1().DaemonSets(ns).Create(ctx, daemonSet(ns), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg, err := env.UserConfig("nobody")
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubeclient.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = DeleteDaemonSet(ctx, Options{Client: client, Namespace: ns, Name: "ambient-cni"})
	if !apierrors.IsForbidden(errors.Unwrap(err)) {
		t.Fatalf("want forbidden, got %v", err)
	}
}

// adminClient is the uninstall hook's client with env's admin identity.
func adminClient(t *testing.T, env *kubeenv.Env) *kubeclient.Client {
	t.Helper()
	c, err := kubeclient.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
