package apicalls

import (
	"context"
	"errors"
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

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// dsName and signalName are the DaemonSet and the release's signal the
// shipped Role names.
const (
	dsName     = "ambient-cni"
	signalName = "ambient-cni-installed"
)

// agentNode is one agent's view: its namespace (with the release's
// signal), its ServiceAccount client under the shipped RBAC, and its
// checker with the watch running.
type agentNode struct {
	t       *testing.T
	env     *kubeenv.Env
	ns      string
	node    string
	client  kubernetes.Interface
	checker *DaemonSetUpgradeChecker
}

func newAgentNode(t *testing.T, env *kubeenv.Env, withDaemonSet bool) *agentNode {
	return newAgentOn(t, env, withDaemonSet, nil, nil)
}

// newAgentOn is newAgentNode on a Node (created with labels and taints)
// whose DaemonSet's pod template is changed by tmpl.
func newAgentOn(t *testing.T, env *kubeenv.Env, withDaemonSet bool, node *corev1.Node, tmpl func(*corev1.PodSpec)) *agentNode {
	t.Helper()
	a := &agentNode{t: t, env: env, ns: env.CreateNamespace(t, "", nil).Name, node: testnet.RandName("node-", 8)}
	if node == nil {
		node = &corev1.Node{}
	}
	node = node.DeepCopy()
	node.Name = a.node
	ctx := context.Background()
	if _, err := env.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Client.CoreV1().Nodes().Delete(ctx, a.node, metav1.DeleteOptions{}) })
	saCfg, client := env.ServiceAccountClient(t, a.ns, "ambient-cni", kubeenv.ShippedRBAC(t))
	a.client = client
	// The checker reads through the agent's own client, with the shipped RBAC.
	agentClient, err := kubeclient.NewForConfig(saCfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := kubeenv.CreateReleaseSignal(ctx, env.Client, a.ns, signalName); err != nil {
		t.Fatal(err)
	}
	if withDaemonSet {
		a.createDaemonSet(tmpl)
	}
	a.checker = NewDaemonSetUpgradeChecker(agentClient, a.ns, dsName, signalName, a.node, slog.New(slog.NewTextHandler(io.Discard, nil)))
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

func (a *agentNode) createDaemonSet(tmpl func(*corev1.PodSpec)) {
	a.t.Helper()
	a.createNamed(dsName, map[string]string{"app": "x"}, tmpl)
}

// chartLabels are what the chart stamps on its DaemonSet, whatever its
// name: its selector labels.
var chartLabels = map[string]string{"app.kubernetes.io/name": "ambient-cni", "app.kubernetes.io/instance": "mesh"}

// createNamed creates DaemonSet name in the agent's namespace with labels
// (its selector too) and the pod template changed by tmpl; held by a
// finalizer once deleted, until the test ends or release.
func (a *agentNode) createNamed(name string, labels map[string]string, tmpl func(*corev1.PodSpec)) {
	a.t.Helper()
	ds := &appsv1.DaemonSet{
		// The finalizer holds a deleted DaemonSet in "being deleted", as
		// foreground deletion does while its pods stop.
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: a.ns, Labels: labels, Finalizers: []string{"test.ambient-cni/hold"}},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}},
			},
		},
	}
	if tmpl != nil {
		tmpl(&ds.Spec.Template.Spec)
	}
	if _, err := a.env.Client.AppsV1().DaemonSets(a.ns).Create(context.Background(), ds, metav1.CreateOptions{}); err != nil {
		a.t.Fatal(err)
	}
	a.t.Cleanup(func() { a.releaseNamed(name) })
}

// deleteDaemonSet deletes it (admin); held by the finalizer until release.
func (a *agentNode) deleteDaemonSet() {
	a.t.Helper()
	if err := a.env.Client.AppsV1().DaemonSets(a.ns).Delete(context.Background(), dsName, metav1.DeleteOptions{}); err != nil {
		a.t.Fatal(err)
	}
}

// release drops the finalizer so a deleted DaemonSet goes.
func (a *agentNode) release() { a.releaseNamed(dsName) }

func (a *agentNode) releaseNamed(name string) {
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	_, _ = a.env.Client.AppsV1().DaemonSets(a.ns).Patch(context.Background(), name, "application/merge-patch+json", patch, metav1.PatchOptions{})
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
	poll.Until(a.t, "watch sees the release signal "+state, func() bool { return a.checker.Seen() == state })
}

// deleteSignal deletes the release's signal, as helm's uninstall does
// first.
func (a *agentNode) deleteSignal() {
	a.t.Helper()
	if err := kubeenv.DeleteReleaseSignal(context.Background(), a.env.Client, a.ns, signalName); err != nil {
		a.t.Fatal(err)
	}
}

// isUpgrade is the shutdown decision as install-cni makes it.
func (a *agentNode) isUpgrade() bool {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return IsUpgrade(ctx, a.checker, nil)
}

// TestUpgradeChecker runs against a real API server with the shipped
// RBAC: the plugin is removed only on proof of an uninstall (the
// DaemonSet gone or being deleted, read at shutdown; or, when that read
// fails, the release's signal seen deleted), never because the agent lost
// its rights.
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
		if up, err := a.checker.IsUpgrade(ctx); !up || err != nil {
			t.Errorf("DaemonSet present: IsUpgrade = %v, %v; want an upgrade", up, err)
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
		// kubectl delete daemonset --cascade=foreground, the release's
		// signal left in place.
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.deleteDaemonSet()
		if a.isUpgrade() {
			t.Error("DaemonSet being deleted (read with RBAC intact): reported an upgrade")
		}
	})

	t.Run("signal deleted alone", func(t *testing.T) {
		// The DaemonSet lives and schedules here: its read decides.
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.deleteSignal()
		a.waitSeen("deleted")
		if !a.isUpgrade() {
			t.Error("release signal deleted, DaemonSet alive and readable: reported an uninstall")
		}
	})

	t.Run("hook order", func(t *testing.T) {
		// helm uninstall's hook: the signal, then the DaemonSet in the
		// foreground; here the RBAC goes too before the pod stops.
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.deleteSignal()
		a.deleteDaemonSet()
		a.waitSeen("deleted")
		if a.isUpgrade() {
			t.Error("signal deleted, DaemonSet being deleted: reported an upgrade")
		}
		a.revokeRBAC()
		if a.isUpgrade() {
			t.Error("signal seen deleted, DaemonSet being deleted, then RBAC gone: reported an upgrade")
		}
	})

	// A DaemonSet that lives but no longer schedules onto this node sends
	// no agent after this one: an uninstall for this node, for each of the
	// three reasons the DaemonSet controller has.
	meshNode := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"mesh": "on", "zone": "a"}}}
	for _, tc := range []struct {
		name    string
		node    *corev1.Node
		tmpl    func(*corev1.PodSpec)
		upgrade bool
	}{
		{"matching daemonset", meshNode, func(s *corev1.PodSpec) {
			s.NodeSelector = map[string]string{"mesh": "on"}
			s.Affinity = nodeAffinity(corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{
				{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a", "b"}}}})
		}, true},
		{"nodeSelector no longer matches", meshNode, func(s *corev1.PodSpec) {
			s.NodeSelector = map[string]string{"mesh": "off"}
		}, false},
		{"required affinity no longer matches", meshNode, func(s *corev1.PodSpec) {
			s.Affinity = nodeAffinity(corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{
				{Key: "zone", Operator: corev1.NodeSelectorOpNotIn, Values: []string{"a"}}}})
		}, false},
		{"taint not tolerated", &corev1.Node{Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}}}}, nil, false},
		{"taint tolerated", &corev1.Node{Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}}}}, func(s *corev1.PodSpec) {
			s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}}
		}, true},
		{"cordoned node", &corev1.Node{Spec: corev1.NodeSpec{Unschedulable: true, Taints: []corev1.Taint{
			{Key: corev1.TaintNodeUnschedulable, Effect: corev1.TaintEffectNoSchedule}}}}, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAgentOn(t, env, true, tc.node, tc.tmpl)
			a.waitSeen("present")
			if got := a.isUpgrade(); got != tc.upgrade {
				t.Errorf("IsUpgrade = %v, want %v", got, tc.upgrade)
			}
		})
	}

	t.Run("node unreadable", func(t *testing.T) {
		// A live DaemonSet and a Node the agent cannot read (here: gone):
		// not proof that the DaemonSet left it.
		a := newAgentOn(t, env, true, nil, func(s *corev1.PodSpec) { s.NodeSelector = map[string]string{"mesh": "off"} })
		a.waitSeen("present")
		if err := env.Client.CoreV1().Nodes().Delete(ctx, a.node, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		up, err := a.checker.IsUpgrade(ctx)
		if err == nil || !strings.Contains(err.Error(), "not proof of an uninstall") {
			t.Errorf("node unreadable: IsUpgrade = %v, %v; want an error saying why the plugin stays", up, err)
		}
		if !a.isUpgrade() {
			t.Error("node unreadable: the plugin would be uninstalled")
		}
	})

	t.Run("helm uninstall order", func(t *testing.T) {
		// helm deletes Services (the signal), the DaemonSet (background:
		// it goes at once), then the RBAC and ServiceAccount; the pods get
		// SIGTERM after that.
		a := newAgentNode(t, env, true)
		a.waitSeen("present")
		a.deleteSignal()
		a.deleteDaemonSet()
		a.release()
		a.waitSeen("deleted")
		a.revokeRBAC()
		if a.isUpgrade() {
			t.Error("DaemonSet deleted, then RBAC gone: reported an upgrade, the plugin would stay")
		}
	})
}

// TestUpgradeCheckerRenamedDaemonSet: an upgrade that renames the
// DaemonSet (istioCompat.names, nameOverride) creates the new one and then
// deletes the agent's own. No uninstall while another DaemonSet of this
// chart (its selector labels, whatever its name) still schedules onto this
// node: its agent takes the node over, and an uninstall would strip every
// pod's rules under it. Another chart's DaemonSet, or one of this chart
// that does not schedule here or is going too, changes nothing.
func TestUpgradeCheckerRenamedDaemonSet(t *testing.T) {
	env := kubeenv.Start(t)
	ownDeleted := func(a *agentNode) {
		a.t.Helper()
		a.deleteDaemonSet()
		a.release()
	}

	t.Run("renamed", func(t *testing.T) {
		a := newAgentNode(t, env, false)
		a.createNamed(dsName, chartLabels, nil)
		a.waitSeen("present")
		a.createNamed("istio-cni-node", chartLabels, nil)
		ownDeleted(a)
		if !a.isUpgrade() {
			t.Error("own DaemonSet deleted while the renamed one schedules here: an uninstall")
		}
		// The signal is the release's: a rename leaves it.
		if s := a.checker.Seen(); s != "present" {
			t.Errorf("release signal %q after a rename, want present", s)
		}
	})

	t.Run("renamed, rights gone first", func(t *testing.T) {
		// helm's order: the new objects, then the old release's RBAC
		// deleted before its DaemonSet. Nothing is readable at shutdown,
		// and the signal was never seen deleted: no proof.
		a := newAgentNode(t, env, false)
		a.createNamed(dsName, chartLabels, nil)
		a.waitSeen("present")
		a.createNamed("istio-cni-node", chartLabels, nil)
		a.revokeRBAC()
		a.deleteDaemonSet()
		a.release()
		if !a.isUpgrade() {
			t.Error("own DaemonSet deleted, the renamed one created, rights gone: an uninstall")
		}
	})

	for _, tc := range []struct {
		name   string
		labels map[string]string
		tmpl   func(*corev1.PodSpec)
		going  bool
	}{
		{"another chart's daemonset", map[string]string{"app.kubernetes.io/name": "ztunnel", "app.kubernetes.io/instance": "mesh"}, nil, false},
		{"renamed, not on this node", chartLabels, func(s *corev1.PodSpec) { s.NodeSelector = map[string]string{"mesh": "off"} }, false},
		{"renamed, being deleted too", chartLabels, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAgentNode(t, env, false)
			a.createNamed(dsName, chartLabels, nil)
			a.waitSeen("present")
			a.createNamed("other", tc.labels, tc.tmpl)
			if tc.going {
				if err := env.Client.AppsV1().DaemonSets(a.ns).Delete(context.Background(), "other", metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			ownDeleted(a)
			if a.isUpgrade() {
				t.Error("own DaemonSet deleted, no other of this chart scheduling here: reported an upgrade")
			}
		})
	}
}

func nodeAffinity(terms ...corev1.NodeSelectorTerm) *corev1.Affinity {
	return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: terms},
	}}
}

type fakeChecker struct {
	up  bool
	err error
}

func (f fakeChecker) IsUpgrade(context.Context) (bool, error) { return f.up, f.err }

// TestIsUpgradeErrsOnTheSideOfAnUpgrade: only a checker's plain "no" is an
// uninstall; no checker, or one that cannot tell, keeps the plugin.
func TestIsUpgradeErrsOnTheSideOfAnUpgrade(t *testing.T) {
	for name, tc := range map[string]struct {
		c    UpgradeChecker
		want bool
	}{
		"not an upgrade": {fakeChecker{up: false}, false},
		"upgrade":        {fakeChecker{up: true}, true},
		"checker error":  {fakeChecker{err: errors.New("apiserver unreachable")}, true},
		"no checker":     {nil, true},
	} {
		t.Run(name, func(t *testing.T) {
			if got := IsUpgrade(context.Background(), tc.c, nil); got != tc.want {
				t.Errorf("IsUpgrade = %v, want %v", got, tc.want)
			}
		})
	}
}
