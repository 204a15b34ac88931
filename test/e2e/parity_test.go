package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/cnibin"
	"github.com/ambient-cni/ambient-cni/test/kubesim"
	"github.com/ambient-cni/ambient-cni/test/ztunnel"
)

// The tests in this file pin where the agent behaves as Istio's istio-cni
// does (issue 11; docs/differences-from-istio.md lists where it does not).

// settleController returns once the pod controller has handled every
// change queued before the call: it has one worker that takes changes in
// order, so a pod label flipped on and then off again (each waited for)
// comes after everything queued earlier. sentinel is a running pod in a
// namespace that is not enabled.
func (n *node) settleController(sentinel *kubesim.Pod) {
	n.t.Helper()
	n.setPodMode(sentinel, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, sentinel)
	n.setPodMode(sentinel, "")
	n.waitUnenrolled(sentinel)
}

// TestTerminatingPodStaysCaptured: a pod deleted gracefully stays in the
// mesh for its whole grace period, as in Istio: its rules, its ztunnel
// workload, its probe address and its annotation stay while the object
// carries a deletionTimestamp, and its traffic (a preStop hook's, a
// draining server's) still goes through the stand-in both ways. Only when
// kubelet tears the sandbox down and the object goes is it removed. Both
// ways in are covered: a pod captured by its CNI ADD and one captured by
// the controller while running.
func TestTerminatingPodStaysCaptured(t *testing.T) {
	n := newNode(t, nodeOptions{})
	ctx := context.Background()
	shop := n.namespace("shop", nil)
	plain := n.namespace("plain", nil)
	running := n.runPod(podSpec(shop, "running", nil, nil))
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, running)
	viaCNI := n.runPod(podSpec(shop, "via-cni", nil, nil))
	peer := n.runPod(podSpec(shop, "peer", nil, nil))
	n.waitEnrolled(waitLong, viaCNI, peer)
	sentinel := n.runPod(podSpec(plain, "sentinel", nil, nil))

	for _, p := range []*kubesim.Pod{viaCNI, running} {
		pods := n.env.Client.CoreV1().Pods(p.Obj.Namespace)
		uid := p.Obj.UID
		// The user's delete: kubelet would now run preStop hooks and
		// signal the containers, and keep the sandbox for up to the grace
		// period.
		grace := int64(600)
		if err := pods.Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace, Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil {
			t.Fatalf("graceful delete of %s: %v", p.Obj.Name, err)
		}
		obj, err := pods.Get(ctx, p.Obj.Name, metav1.GetOptions{})
		if err != nil || obj.DeletionTimestamp == nil {
			t.Fatalf("%s after a graceful delete: %v, deletionTimestamp %v", p.Obj.Name, err, obj.DeletionTimestamp)
		}
		n.settleController(sentinel)

		if got, ok := n.d.Agent().EnrolledUID(p.Obj.Namespace, p.Obj.Name); !ok || got != uid {
			t.Fatalf("terminating pod %s left the agent state (%q, %v)", p.Obj.Name, got, ok)
		}
		if _, ok := n.zt.Workload(string(uid)); !ok {
			t.Fatalf("terminating pod %s is no longer served by the stand-in", p.Obj.Name)
		}
		if slices.ContainsFunc(n.zt.Messages(), func(m ztunnel.Message) bool { return m.Kind == ztunnel.KindDel && m.UID == string(uid) }) {
			t.Fatalf("the stand-in got a Del for terminating pod %s", p.Obj.Name)
		}
		if got := n.annotation(p); got != ambient.RedirectionEnabled {
			t.Fatalf("terminating pod %s: annotation %q, want %q", p.Obj.Name, got, ambient.RedirectionEnabled)
		}
		if !n.hasRules(p) {
			t.Fatalf("terminating pod %s lost its rules:\n%s", p.Obj.Name, n.rulesDump(p))
		}
		if !n.inProbeSet(p) {
			t.Fatalf("terminating pod %s: its IP left the host probe set", p.Obj.Name)
		}
		// Its traffic during the grace period is still in the mesh.
		mustGet(t, p, peer)
		n.requireTunneled(p, peer)
		mustGet(t, peer, p)
		n.requireTunneled(peer, p)

		// kubelet is done: sandbox torn down (CNI DEL), status updated,
		// object removed. The agent lets the pod go without a word (in
		// particular without looking for its vanished network).
		mark := n.logs.mark()
		if err := n.kube.Teardown(ctx, p); err != nil {
			t.Fatalf("teardown of %s: %v", p.Obj.Name, err)
		}
		if err := n.kube.SetStatus(ctx, p, corev1.PodRunning); err != nil {
			t.Fatal(err)
		}
		zero := int64(0)
		if err := pods.Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil {
			t.Fatalf("final delete of %s: %v", p.Obj.Name, err)
		}
		n.waitStandIn(func() bool { _, ok := n.zt.Workload(string(uid)); return !ok }, "the stand-in to drop "+p.Obj.Name)
		eventually(t, p.Obj.Name+" gone from the agent state", func() bool {
			_, ok := n.d.Agent().EnrolledUID(p.Obj.Namespace, p.Obj.Name)
			return !ok
		})
		if n.inProbeSet(p) {
			t.Fatalf("%s: its IP is still in the host probe set after the pod went", p.Obj.Name)
		}
		for _, w := range n.logs.warningsSince(mark) {
			t.Errorf("agent complained while %s went: %s", p.Obj.Name, w)
		}
	}
}

// TestPodWithIPsEnrolledBeforeRunning: a running pod is enrolled as soon
// as it has IPs, whatever its phase, as in Istio: here a pod whose init
// containers still run (phase Pending, sandbox up with its IPs) when its
// namespace is labelled. Its init containers' traffic must be captured
// too.
func TestPodWithIPsEnrolledBeforeRunning(t *testing.T) {
	n := newNode(t, nodeOptions{})
	ctx := context.Background()
	shop := n.namespace("shop", nil)
	p := n.runPod(podSpec(shop, "init", nil, nil))
	if err := n.kube.SetStatus(ctx, p, corev1.PodPending); err != nil {
		t.Fatal(err)
	}
	if p.Obj.Status.Phase != corev1.PodPending || len(p.Obj.Status.PodIPs) == 0 {
		t.Fatalf("pod status %+v, want Pending with IPs", p.Obj.Status)
	}
	peer := n.runPod(podSpec(shop, "peer", nil, nil))
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, p, peer)
	mustGet(t, p, peer)
	n.requireTunneled(p, peer)
}

// revokeAgentRBAC deletes the agent's RoleBindings and ClusterRoleBindings
// (as helm uninstall does, or an operator's mistake) and waits until the
// agent's read of its DaemonSet is refused.
func (n *node) revokeAgentRBAC() {
	n.t.Helper()
	ctx := context.Background()
	rbac := n.env.Client.RbacV1()
	rbs, err := rbac.RoleBindings(n.agentNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	for _, rb := range rbs.Items {
		if err := rbac.RoleBindings(n.agentNS).Delete(ctx, rb.Name, metav1.DeleteOptions{}); err != nil {
			n.t.Fatal(err)
		}
	}
	crbs, err := rbac.ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	for _, crb := range crbs.Items {
		if slices.ContainsFunc(crb.Subjects, func(s rbacv1.Subject) bool { return s.Namespace == n.agentNS }) {
			if err := rbac.ClusterRoleBindings().Delete(ctx, crb.Name, metav1.DeleteOptions{}); err != nil {
				n.t.Fatal(err)
			}
		}
	}
	eventually(n.t, "the agent's DaemonSet read refused", func() bool {
		_, err := n.client.AppsV1().DaemonSets(n.agentNS).Get(ctx, n.cfg.DaemonSet, metav1.GetOptions{})
		return apierrors.IsForbidden(err)
	})
}

// pluginInstalled reports whether the plugin binary is on the node and
// the primary conflist names it.
func (n *node) pluginInstalled() (binary, chained bool) {
	n.t.Helper()
	_, err := os.Stat(filepath.Join(n.binDir, cnibin.PluginName))
	conf, cerr := os.ReadFile(filepath.Join(n.confDir, primaryConf))
	if cerr != nil {
		n.t.Fatal(cerr)
	}
	return err == nil, bytes.Contains(conf, []byte(`"`+cnibin.PluginName+`"`))
}

// TestShutdownUninstallsOnlyOnProof: a stopping agent removes the plugin
// only on proof of an uninstall. Losing its RBAC while its DaemonSet lives
// (RBAC briefly wrong) leaves the plugin installed and says why; the order
// helm uninstall deletes things in (DaemonSet, then RBAC, then the pods
// stop) still removes it, because the agent's watch saw the DaemonSet go.
func TestShutdownUninstallsOnlyOnProof(t *testing.T) {
	t.Run("rbac lost", func(t *testing.T) {
		n := newNode(t, nodeOptions{Upgrade: true})
		eventually(t, "the agent's watch sees its DaemonSet", func() bool { return n.d.DaemonSetSeen() == "present" })
		n.revokeAgentRBAC()
		mark := n.logs.mark()
		n.stopDaemon()
		if bin, chained := n.pluginInstalled(); !bin || !chained {
			t.Fatalf("RBAC lost, DaemonSet alive: plugin binary %v, chained %v; want both kept", bin, chained)
		}
		if !slices.ContainsFunc(n.logs.warningsSince(mark), func(w string) bool {
			return strings.Contains(w, "leaving the plugin installed") && strings.Contains(w, "not proof of an uninstall")
		}) {
			t.Errorf("no warning saying why the plugin stays: %q", n.logs.warningsSince(mark))
		}
	})
	t.Run("helm uninstall order", func(t *testing.T) {
		n := newNode(t, nodeOptions{Upgrade: true})
		eventually(t, "the agent's watch sees its DaemonSet", func() bool { return n.d.DaemonSetSeen() == "present" })
		if err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Delete(context.Background(), n.cfg.DaemonSet, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the agent's watch sees its DaemonSet deleted", func() bool { return n.d.DaemonSetSeen() == "deleted" })
		n.revokeAgentRBAC()
		n.stopDaemon()
		if bin, chained := n.pluginInstalled(); bin || chained {
			t.Fatalf("uninstalled: plugin binary %v, chained %v; want both gone", bin, chained)
		}
	})
}
