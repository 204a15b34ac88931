package kubeadapter

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// dsName is the DaemonSet the shipped Role names.
const dsName = "ambient-cni"

// agentNode is one agent's view: its namespace, its ServiceAccount client
// under the shipped RBAC, and its checker with the watch running.
type agentNode struct {
	t       *testing.T
	env     *kubeenv.Env
	ns      string
	client  kubernetes.Interface
	checker *DaemonSetUpgradeChecker
}

func newAgentNode(t *testing.T, env *kubeenv.Env, withDaemonSet bool) *agentNode {
	t.Helper()
	a := &agentNode{t: t, env: env, ns: env.CreateNamespace(t, "", nil).Name}
	_, a.client = env.ServiceAccountClient(t, a.ns, "ambient-cni", kubeenv.ShippedRBAC(t))
	if withDaemonSet {
		a.createDaemonSet()
	}
	a.checker = NewDaemonSetUpgradeChecker(a.client, a.ns, dsName, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.checker.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("watch: %v", err)
		}
	})
	return a
}

func (a *agentNode) createDaemonSet() {
	a.t.Helper()
	labels := map[string]string{"app": "x"}
	ds := &appsv1.DaemonSet{
		// The finalizer holds a deleted DaemonSet in "being deleted", as
		// foreground deletion does while its pods stop.
		ObjectMeta: metav1.ObjectMeta{Name: dsName, Namespace: a.ns, Finalizers: []string{"test.ambient-cni/hold"}},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}},
			},
		},
	}
	if _, err := a.env.Client.AppsV1().DaemonSets(a.ns).Create(context.Background(), ds, metav1.CreateOptions{}); err != nil {
		a.t.Fatal(err)
	}
	a.t.Cleanup(func() { a.release() })
}

// deleteDaemonSet deletes it (admin); held by the finalizer until release.
func (a *agentNode) deleteDaemonSet() {
	a.t.Helper()
	if err := a.env.Client.AppsV1().DaemonSets(a.ns).Delete(context.Background(), dsName, metav1.DeleteOptions{}); err != nil {
		a.t.Fatal(err)
	}
}

// release drops the finalizer so a deleted DaemonSet goes.
func (a *agentNode) release() {
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	_, _ = a.env.Client.AppsV1().DaemonSets(a.ns).Patch(context.Background(), dsName, "application/merge-patch+json", patch, metav1.PatchOptions{})
}

// revokeRBAC deletes the agent's RoleBindings, as helm uninstall does, and
// waits until the agent's read of its DaemonSet is refused.
func (a *agentNode) revokeRBAC() {
	a.t.Helper()
	ctx := context.Background()
	rbs, err := a.env.Client.RbacV1().RoleBindings(a.ns).List(ctx, metav1.ListOptions{})
	if err != nil || len(rbs.Items) == 0 {
		a.t.Fatalf("role bindings: %v, %d", err, len(rbs.Items))
	}
	for _, rb := range rbs.Items {
		if err := a.env.Client.RbacV1().RoleBindings(a.ns).Delete(ctx, rb.Name, metav1.DeleteOptions{}); err != nil {
			a.t.Fatal(err)
		}
	}
	poll.Until(a.t, "the agent's DaemonSet read refused", func() bool {
		_, err := a.client.AppsV1().DaemonSets(a.ns).Get(ctx, dsName, metav1.GetOptions{})
		return apierrors.IsForbidden(err)
	})
}

func (a *agentNode) waitSeen(state string) {
	a.t.Helper()
	poll.Until(a.t, "watch sees the DaemonSet "+state, func() bool { return a.checker.Seen() == state })
}

// isUpgrade is the shutdown decision as install-cni makes it.
func (a *agentNode) isUpgrade() bool {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return installer.IsUpgrade(ctx, a.checker, nil)
}

// TestUpgradeChecker runs against a real API server with the shipped
// RBAC: the plugin is removed only on proof of an uninstall (the
// DaemonSet gone or being deleted, read at shutdown or seen by the watch),
// never because the agent lost its rights.
func TestUpgradeChecker(t *testing.T) {
	env := kubeenv.Start(t)
	ctx := context.Background()

	t.Run("no daemonset", func(t *testing.T) {
		a := newAgentNode(t, env, false)
		if up, err := a.checker.IsUpgrade(ctx); up || err != nil {
			t.Errorf("NotFound: IsUpgrade = %v, %v; want an uninstall", up, err)
		}
	})

	t.Run("rolling upgrade", func(t *testing.T) {
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		if !a.isUpgrade() {
			t.Error("DaemonSet present: not an upgrade")
		}
	})

	t.Run("rbac lost while the daemonset lives", func(t *testing.T) {
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.revokeRBAC()
		up, err := a.checker.IsUpgrade(ctx)
		if err == nil || !strings.Contains(err.Error(), "not proof of an uninstall") || !strings.Contains(err.Error(), "last seen present") {
			t.Errorf("forbidden: IsUpgrade = %v, %v; want an error saying why the plugin stays", up, err)
		}
		if !a.isUpgrade() {
			t.Error("forbidden (RBAC gone, DaemonSet alive): the plugin would be uninstalled")
		}
	})

	t.Run("rbac lost before the watch saw anything", func(t *testing.T) {
		a := newAgentNode(t, env, true)
		a.revokeRBAC()
		if !a.isUpgrade() {
			t.Error("forbidden, nothing seen: the plugin would be uninstalled")
		}
	})

	t.Run("daemonset being deleted", func(t *testing.T) {
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.deleteDaemonSet()
		a.waitSeen("being deleted")
		if a.isUpgrade() {
			t.Error("DaemonSet being deleted (read with RBAC intact): reported an upgrade")
		}
		// The RBAC goes too before the pod stops: the watch saw it.
		a.revokeRBAC()
		if a.isUpgrade() {
			t.Error("DaemonSet seen being deleted, then RBAC gone: reported an upgrade")
		}
	})

	t.Run("helm uninstall order", func(t *testing.T) {
		// helm deletes the DaemonSet (background: it goes at once), then
		// the RBAC and ServiceAccount; the pods get SIGTERM after that.
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.deleteDaemonSet()
		a.release()
		a.waitSeen("deleted")
		a.revokeRBAC()
		if a.isUpgrade() {
			t.Error("DaemonSet deleted, then RBAC gone: reported an upgrade, the plugin would stay")
		}
	})
}
