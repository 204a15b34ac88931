package integration

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// enrollWithin bounds the wait for running pods to be enrolled after
// their namespace or pod label flips: a generous bound for a busy 2-core
// CI machine, not a timing figure (the benchmark measures that).
const enrollWithin = waitLong

// TestNamespaceEnablement: running pods in a namespace that is not
// enabled carry nothing; labelling the namespace enrolls them (rules,
// stand-in listeners, annotation) and pod-to-pod traffic goes through the
// stand-in, except for a pod that opted out; removing the label undoes it
// all and traffic flows directly again. Afterwards the host is as before.
func TestNamespaceEnablement(t *testing.T) {
	var n *node
	var all []*kubesim.Pod
	requireHostClean(t, &n, &all)
	n = newNode(t, nodeOptions{})
	shop := n.namespace("shop", nil)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	b := n.runPod(podSpec(shop, "b", nil, nil))
	c := n.runPod(podSpec(shop, "c", nil, nil))
	optOut := n.runPod(podSpec(shop, "opt-out", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone}, nil))
	all = []*kubesim.Pod{a, b, c, optOut}

	for _, p := range all {
		n.requireNotEnrolled(p)
	}
	mustGet(t, a, b)
	if r := n.zt.Records(); len(r) != 0 {
		t.Fatalf("stand-in proxied traffic of pods that are not enrolled: %+v", r)
	}

	scans := counter(t, n.metrics.NetnsScans)
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	start := time.Now()
	n.waitEnrolled(enrollWithin, a, b, c)
	t.Logf("three running pods enrolled %v after the namespace label", time.Since(start).Round(time.Millisecond))
	// One /proc scan serves the whole batch the label flip queued, not one
	// scan per pod (a retry could add one; three would mean per pod).
	if got := counter(t, n.metrics.NetnsScans) - scans; got < 1 || got >= 3 {
		t.Errorf("enrolling three running pods took %v /proc scans, want 1 (at most 2)", got)
	}
	n.requireNotEnrolled(optOut)

	mustGet(t, a, b)
	n.requireTunneled(a, b)
	mustGet(t, c, a)
	n.requireTunneled(c, a)
	// The opted-out pod reaches an enrolled one through its inbound 15006.
	mustGet(t, optOut, b)
	if !n.hasRecord(func(r ztunnel.Record) bool {
		return r.UID == string(b.Obj.UID) && r.Port == ambient.ZtunnelInboundPlaintextPort && r.OrigDst == app(b)
	}) {
		t.Fatalf("opt-out -> b did not go through b's 15006: %+v", n.zt.Records())
	}
	if n.hasRecord(func(r ztunnel.Record) bool { return r.UID == string(optOut.Obj.UID) }) {
		t.Fatalf("the opted-out pod's traffic went through the stand-in: %+v", n.zt.Records())
	}

	n.setNamespaceMode(shop, "")
	n.waitUnenrolled(a, b, c)
	before := len(n.zt.Records())
	mustGet(t, a, b)
	mustGet(t, c, a)
	if r := n.zt.Records(); len(r) != before {
		t.Fatalf("traffic still goes through the stand-in after the label was removed: %+v", r[before:])
	}
}

// TestPodEnablement: a pod labelled ambient in a namespace that is not
// enabled is enrolled while running, and unenrolled when the label goes.
// This node's kubelet uses the systemd cgroup driver's layout, so /proc
// discovery is proven for it too (the other tests use cgroupfs).
func TestPodEnablement(t *testing.T) {
	n := newNode(t, nodeOptions{})
	n.kube.Driver = podproc.Systemd
	plain := n.namespace("plain", nil)
	a := n.runPod(podSpec(plain, "a", nil, nil))
	b := n.runPod(podSpec(plain, "b", nil, nil))
	other := n.runPod(podSpec(plain, "other", nil, nil))
	n.requireNotEnrolled(a)
	n.requireNotEnrolled(b)

	n.setPodMode(a, ambient.DataplaneModeAmbient)
	n.setPodMode(b, ambient.DataplaneModeAmbient)
	n.waitEnrolled(enrollWithin, a, b)
	n.requireNotEnrolled(other)
	mustGet(t, a, b)
	n.requireTunneled(a, b)

	n.setPodMode(a, "")
	n.setPodMode(b, "")
	n.waitUnenrolled(a, b)
	before := len(n.zt.Records())
	mustGet(t, a, b)
	if r := n.zt.Records(); len(r) != before {
		t.Fatalf("traffic still goes through the stand-in after the label was removed: %+v", r[before:])
	}
}

// TestEnablementSelectors: with a selector list of its own (namespaces
// labelled mesh=yes), the agent enrolls a running pod when its namespace
// gets that label, captures a new pod there at its CNI ADD, and leaves
// alone a pod in a namespace labelled the default way, which this list
// does not select.
func TestEnablementSelectors(t *testing.T) {
	n := newNode(t, nodeOptions{EnablementSelector: "- namespaceSelector:\n    matchLabels: {mesh: \"yes\"}\n"})
	defaultWay := n.namespace("default-way", ambientLabel)
	plain := n.runPod(podSpec(defaultWay, "plain", nil, nil))
	labelled := n.runPod(podSpec(defaultWay, "labelled", ambientLabel, nil))
	mesh := n.namespace("mesh", nil)
	running := n.runPod(podSpec(mesh, "running", nil, nil))
	n.requireNotEnrolled(running)

	patch := []byte(`{"metadata":{"labels":{"mesh":"yes"}}}`)
	if _, err := n.env.Client.CoreV1().Namespaces().Patch(context.Background(), mesh, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("label namespace %s: %v", mesh, err)
	}
	n.waitEnrolled(enrollWithin, running)
	started := n.runPod(podSpec(mesh, "started", nil, nil))
	n.waitEnrolled(enrollWithin, started)
	mustGet(t, running, started)
	n.requireTunneled(running, started)

	// The agent has seen every pod by now (the later ones are enrolled):
	// the default way's pods stay out.
	n.requireNotEnrolled(plain)
	n.requireNotEnrolled(labelled)
	if r := n.explain(mesh, running.Obj.Name); !r.Policy.Capture || r.Policy.Selector != 1 {
		t.Errorf("explain of a selected pod: %+v", r.Policy)
	}
	if r := n.explain(defaultWay, labelled.Obj.Name); r.Policy.Capture {
		t.Errorf("explain of a pod the list does not select: %+v", r.Policy)
	}
}
