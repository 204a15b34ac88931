package integration

import (
	"context"
	"os"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// TestNewPodEnrolledByCNI: a pod started in an enabled namespace is
// enrolled by its CNI ADD: when the ADD returns, the stand-in already
// serves it and its rules are in place; the annotation enabled follows
// (written off the ADD's critical path), with one API request.
func TestNewPodEnrolledByCNI(t *testing.T) {
	n := newNode(t, nodeOptions{})
	shop := n.namespace("shop", ambientLabel)
	p, err := n.kube.Run(context.Background(), podSpec(shop, "web", nil, nil))
	if err != nil {
		t.Fatalf("run pod: %v", err)
	}
	// No waiting: the capture must already hold when the ADD returned.
	if _, ok := n.zt.Workload(string(p.Obj.UID)); !ok {
		t.Fatal("the stand-in does not serve the pod when its ADD returned")
	}
	if !n.hasRules(p) {
		t.Fatal("no redirection rules when the ADD returned")
	}
	poll.Within(t, waitLong, "the annotation enabled", func() bool { return n.annotation(p) == ambient.RedirectionEnabled })
	var sandbox string
	for _, e := range n.d.Agent().Pods() {
		if e.UID == p.Obj.UID {
			sandbox = e.SandboxID
		}
	}
	if sandbox != p.SandboxID {
		t.Fatalf("agent state has sandbox %q for the pod, want the CNI ADD's %q", sandbox, p.SandboxID)
	}
	add := slices.IndexFunc(n.zt.Messages(), func(m ztunnel.Message) bool {
		return m.Kind == ztunnel.KindAdd && m.UID == string(p.Obj.UID)
	})
	if add < 0 {
		t.Fatalf("no ZDS Add for the pod: %+v", n.zt.Messages())
	}
	if m := n.zt.Messages()[add]; m.Info == nil || cmp.Diff(ztunnel.WorkloadInfo{Name: "web", Namespace: shop, ServiceAccount: "default"}, *m.Info) != "" {
		t.Fatalf("ZDS Add carries workload info %+v", m.Info)
	}

	// The app is reachable through the stand-in from a second enrolled pod.
	serveApp(t, p)
	q := n.runPod(podSpec(shop, "client", nil, nil))
	mustGet(t, q, p)
	n.requireTunneled(q, p)
}

// TestDeletedAndFinishedPodsAreRemoved: deleting an enrolled pod, or one
// reaching phase Succeeded, sends Del to ztunnel and drops the agent's
// state, and the agent logs no warning at all, in particular none about a
// namespace that vanished. Covered: a pod enrolled by its CNI ADD and one
// enrolled by the controller, each deleted gracefully (deletionTimestamp,
// then kubelet's teardown, then the object goes); a pod whose sandbox
// vanished before its object was force-deleted (the agent only has its
// own netns handle left); and a pod that finished.
func TestDeletedAndFinishedPodsAreRemoved(t *testing.T) {
	n := newNode(t, nodeOptions{})
	plain := n.namespace("plain", nil)
	running := n.runPod(podSpec(plain, "running", nil, nil))
	vanishing := n.runPod(podSpec(plain, "vanishing", nil, nil))
	finishing := n.runPod(podSpec(plain, "finishing", nil, nil))
	n.setNamespaceMode(plain, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, running, vanishing, finishing)
	viaCNI := n.runPod(podSpec(plain, "via-cni", nil, nil))
	n.waitEnrolled(waitLong, viaCNI)

	ctx := context.Background()
	mark := n.logs.mark()
	for _, tc := range []struct {
		pod    *kubesim.Pod
		remove func(*kubesim.Pod) error
	}{
		{viaCNI, func(p *kubesim.Pod) error { return n.kube.Delete(ctx, p) }},
		{running, func(p *kubesim.Pod) error { return n.kube.Delete(ctx, p) }},
		{vanishing, func(p *kubesim.Pod) error {
			if err := n.kube.Teardown(ctx, p); err != nil {
				return err
			}
			if _, err := os.Stat(p.NS.Path()); err == nil {
				t.Fatalf("netns %s still there after teardown", p.NS.Path())
			}
			zero := int64(0)
			return n.env.Client.CoreV1().Pods(p.Obj.Namespace).Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		}},
		{finishing, func(p *kubesim.Pod) error { return n.kube.Finish(ctx, p) }},
	} {
		uid := string(tc.pod.Obj.UID)
		if err := tc.remove(tc.pod); err != nil {
			t.Fatalf("remove %s: %v", tc.pod.Obj.Name, err)
		}
		n.waitStandIn(func() bool {
			return slices.IndexFunc(n.zt.Messages(), func(m ztunnel.Message) bool { return m.Kind == ztunnel.KindDel && m.UID == uid }) >= 0
		}, "Del of "+tc.pod.Obj.Name)
		if _, ok := n.zt.Workload(uid); ok {
			t.Fatalf("stand-in still serves %s after its Del", tc.pod.Obj.Name)
		}
		poll.Within(t, waitLong, tc.pod.Obj.Name+" gone from the agent state", func() bool {
			_, ok := n.d.Agent().EnrolledUID(tc.pod.Obj.Namespace, tc.pod.Obj.Name)
			return !ok
		})
		// The agent drops its entry first and then takes the IP out of the
		// host probe set (it keeps an IP another enrolled pod holds, so it
		// must look once the entry is gone): the last step comes a moment
		// after the one the test saw.
		poll.Within(t, waitLong, tc.pod.Obj.Name+"'s IP gone from the host probe set", func() bool { return !n.inProbeSet(tc.pod) })
		if tc.pod == finishing {
			poll.Within(t, waitLong, "the finished pod's annotation cleared", func() bool { return n.annotation(tc.pod) == "" })
		}
	}
	if len(n.d.Agent().Pods()) != 0 {
		t.Fatalf("agent state not empty: %+v", n.d.Agent().Pods())
	}
	// Not only no word about the vanished namespaces: no warning at all.
	for _, w := range n.logs.warningsSince(mark) {
		t.Errorf("agent complained while removing pods: %s", w)
	}
}
