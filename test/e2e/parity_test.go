package e2e

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
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
