package integration

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// clearPodIPs makes the API show the pod without IPs, as after a kubelet
// restart (status.podIPs empty until kubelet reports the sandbox again):
// the agent cannot confirm the pod's netns without them.
func (n *node) clearPodIPs(p *kubesim.Pod) {
	n.t.Helper()
	patch := []byte(`{"status":{"podIP":null,"podIPs":null}}`)
	if _, err := n.env.Client.CoreV1().Pods(p.Obj.Namespace).Patch(context.Background(), p.Obj.Name,
		types.MergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		n.t.Fatalf("clear the IPs of %s: %v", p.Obj.Name, err)
	}
}

// dropRecord removes the pod's capture record, as if an older agent
// (one that kept none) had captured it: only its annotation says so.
func (n *node) dropRecord(p *kubesim.Pod) {
	n.t.Helper()
	if err := os.Remove(filepath.Join(n.recordDir(), string(p.Obj.UID)+".json")); err != nil {
		n.t.Fatalf("remove the capture record of %s: %v", p.Obj.Name, err)
	}
}

// snapshotOf returns the messages of the stand-in's connection conn.
func (n *node) snapshotOf(conn int) []ztunnel.Message {
	var out []ztunnel.Message
	for _, m := range n.zt.Messages() {
		if m.Conn == conn {
			out = append(out, m)
		}
	}
	return out
}

// TestRestartKeepsPodWhoseNetnsIsNotFound is issue 12 item 1: a captured
// pod whose netns the restarted agent cannot find (its status lost its IPs
// in a kubelet restart, and no capture record names them: an older agent
// captured it) is in the new ZDS snapshot as Keep, so ztunnel goes on
// serving it and traffic to it keeps flowing; its IP stays in the host
// probe set; once its status shows its IP again it is captured with its
// netns (Add) and stays enabled. A pod whose status lost its IPs but whose
// capture record has them is found through the record and restored at
// once (Add).
func TestRestartKeepsPodWhoseNetnsIsNotFound(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	b := n.runPod(podSpec(shop, "b", nil, nil))
	c := n.runPod(podSpec(shop, "c", nil, nil))
	n.waitEnrolled(waitLong, a, b, c)
	mustGet(t, b, a)
	served, _ := n.zt.Workload(string(a.Obj.UID))
	servedC, _ := n.zt.Workload(string(c.Obj.UID))

	n.stopDaemon()
	n.clearPodIPs(a)
	n.dropRecord(a)
	n.clearPodIPs(c)
	conns := n.zt.Connections()
	n.startDaemon()
	n.waitStandIn(func() bool { return n.zt.Connections() > conns && n.zt.Ready() }, "the stand-in's snapshot from the new agent")

	snap := n.snapshotOf(conns + 1)
	if !slices.ContainsFunc(snap, func(m ztunnel.Message) bool {
		return m.Kind == ztunnel.KindKeep && m.UID == string(a.Obj.UID) && m.FDs == 0 && m.AckError == ""
	}) {
		t.Errorf("the snapshot has no Keep for the pod whose netns was not found: %+v", snap)
	}
	if !slices.ContainsFunc(snap, func(m ztunnel.Message) bool {
		return m.Kind == ztunnel.KindAdd && m.UID == string(b.Obj.UID) && m.FDs == 1
	}) {
		t.Errorf("the snapshot has no Add for the pod found: %+v", snap)
	}
	if !slices.ContainsFunc(snap, func(m ztunnel.Message) bool {
		return m.Kind == ztunnel.KindAdd && m.UID == string(c.Obj.UID) && m.FDs == 1 && m.Netns == servedC.Netns
	}) {
		t.Errorf("the snapshot has no Add for the pod found through its capture record's IPs: %+v", snap)
	}
	if w, ok := n.zt.Workload(string(a.Obj.UID)); !ok || w.Netns != served.Netns {
		t.Fatalf("the stand-in dropped the pod whose netns was not found (served %v %+v); its redirected traffic is blackholed", ok, w)
	}
	if !n.inProbeSet(a) {
		t.Error("the host probe sync pruned the IP of a pod whose state is unknown: its kubelet probes fail")
	}
	if got := n.annotation(a); got != ambient.RedirectionEnabled {
		t.Errorf("annotation %q", got)
	}
	mustGet(t, b, a)
	n.requireTunneled(b, a)

	// Kubelet reports the pod again: the agent finds its netns and hands
	// it to ztunnel with an Add.
	msgs := len(n.zt.Messages())
	if err := n.kube.SetStatus(context.Background(), a, "Running"); err != nil {
		t.Fatal(err)
	}
	n.waitStandIn(func() bool {
		return slices.ContainsFunc(n.zt.Messages()[msgs:], func(m ztunnel.Message) bool {
			return m.Kind == ztunnel.KindAdd && m.UID == string(a.Obj.UID) && m.FDs == 1 && m.Netns == served.Netns
		})
	}, "an Add with the pod's netns once it is found")
	poll.Within(t, waitLong, "the pod resolved in the agent's state", func() bool {
		for _, p := range n.d.Agent().Pods() {
			if p.UID == a.Obj.UID {
				return p.Netns != ""
			}
		}
		return false
	})
	n.waitEnrolled(waitLong, a, b)
	mustGet(t, b, a)
}

// TestRestartReleasesUnresolvedPodsSafely: a pod whose netns is not found
// at restart (no IPs in its status, no capture record: an older agent
// captured it) and whose namespace was unlabelled while the agent was down
// stays captured (Keep) until its netns is found; then its rules go
// before ztunnel drops it. A pod deleted while unresolved is dropped by
// ztunnel and leaves the probe set.
func TestRestartReleasesUnresolvedPodsSafely(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	blog := n.namespace("blog", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	gone := n.runPod(podSpec(blog, "gone", nil, nil))
	n.waitEnrolled(waitLong, a, gone)

	n.stopDaemon()
	n.clearPodIPs(a)
	n.clearPodIPs(gone)
	n.dropRecord(a)
	n.dropRecord(gone)
	n.setNamespaceMode(shop, "")
	conns := n.zt.Connections()
	n.startDaemon()
	n.waitStandIn(func() bool { return n.zt.Connections() > conns && n.zt.Ready() }, "the stand-in's snapshot from the new agent")
	for _, p := range []*kubesim.Pod{a, gone} {
		if _, ok := n.zt.Workload(string(p.Obj.UID)); !ok {
			t.Fatalf("the stand-in dropped %s, whose netns was not found", p.Obj.Name)
		}
		if !n.hasRules(p) || !n.inProbeSet(p) {
			t.Fatalf("%s: rules %v, in probe set %v", p.Obj.Name, n.hasRules(p), n.inProbeSet(p))
		}
	}

	// Deleted while unresolved: ztunnel drops it. Its IP is unknown (the
	// API never showed it again), so it stays in the probe set while
	// another pod's IPs are unknown too: that entry may be the other's.
	if err := n.kube.Delete(context.Background(), gone); err != nil {
		t.Fatal(err)
	}
	n.waitStandIn(func() bool { _, ok := n.zt.Workload(string(gone.Obj.UID)); return !ok }, "the stand-in to drop the deleted pod")
	if !n.inProbeSet(a) {
		t.Fatal("the probe set was pruned while a pod's IPs are unknown")
	}

	// The unlabelled one: released once found, rules first.
	if _, ok := n.zt.Workload(string(a.Obj.UID)); !ok || !n.hasRules(a) {
		t.Fatal("the unlabelled pod was released without its netns")
	}
	if err := n.kube.SetStatus(context.Background(), a, "Running"); err != nil {
		t.Fatal(err)
	}
	n.waitUnenrolled(a)
	// Nothing unknown is left: the deferred prune took the deleted pod's IP.
	if n.inProbeSet(gone) {
		t.Error("the deleted pod's IP is still in the probe set")
	}
}
