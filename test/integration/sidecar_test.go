package integration

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// istioCNISidecar is a pod as Istio's injector shapes it with
// pilot.cni.enabled: the sidecar status annotation and the
// istio-validation init container in place of istio-init.
func istioCNISidecar(namespace, name, init string) *corev1.Pod {
	p := podSpec(namespace, name, nil, map[string]string{
		ambient.SidecarStatusAnnotation: `{"initContainers":["` + init + `"],"containers":["istio-proxy"]}`,
	})
	p.Spec.InitContainers = []corev1.Container{{Name: init, Image: "docker.io/local/proxyv2:1", ImagePullPolicy: corev1.PullNever,
		Args: []string{"istio-iptables", "--run-validation", "--skip-rule-apply"}}}
	return p
}

// warnings lists the Events with reason on the pod of that uid.
func (n *node) warnings(namespace string, uid types.UID, reason string) []corev1.Event {
	n.t.Helper()
	list, err := n.env.Client.CoreV1().Events(namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.AndSelectors(fields.OneTermEqualSelector("involvedObject.uid", string(uid)),
			fields.OneTermEqualSelector("reason", reason)).String(),
	})
	if err != nil {
		n.t.Fatal(err)
	}
	return list.Items
}

// TestSidecarPodExpectingIstioCNI: a sidecar pod injected for istio-cni's
// sidecar mode (which ambient-cni does not provide) on the agent's node,
// in an ambient namespace, passes through its CNI ADD uncaptured, gets one
// Warning Event saying so however often it changes, and explain names the
// problem; a sidecar pod injected with istio-init does not.
func TestSidecarPodExpectingIstioCNI(t *testing.T) {
	n := newNode(t, nodeOptions{})
	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(istioCNISidecar(shop, "validating", ambient.IstioValidationInitContainer))
	withInit := n.runPod(istioCNISidecar(shop, "with-init", "istio-init"))

	var evs []corev1.Event
	poll.Within(t, waitLong, "a Warning Event on the sidecar pod that expects istio-cni", func() bool {
		evs = n.warnings(shop, p.Obj.UID, controller.ReasonIstioCNIExpected)
		return len(evs) > 0
	})
	ev := evs[0]
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, ambient.IstioValidationInitContainer) ||
		!strings.Contains(ev.Message, "ambient pods only") || ev.Source.Host != n.Name {
		t.Errorf("event %s %s from %+v: %q", ev.Type, ev.Reason, ev.Source, ev.Message)
	}
	t.Logf("event: %s %s: %s", ev.Type, ev.Reason, ev.Message)

	// Changes of the pod are not told again. A pod that arrives after them
	// is a marker: once its Event is there, the changes were handled.
	for _, v := range []string{"a", "b"} {
		patch := []byte(`{"metadata":{"labels":{"rev":"` + v + `"}}}`)
		if _, err := n.env.Client.CoreV1().Pods(shop).Patch(context.Background(), p.Obj.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	marker := n.runPod(istioCNISidecar(shop, "marker", ambient.IstioValidationInitContainer))
	poll.Within(t, waitLong, "the marker pod's Event", func() bool {
		return len(n.warnings(shop, marker.Obj.UID, controller.ReasonIstioCNIExpected)) > 0
	})
	if evs := n.warnings(shop, p.Obj.UID, controller.ReasonIstioCNIExpected); len(evs) != 1 || evs[0].Count > 1 {
		t.Errorf("the pod was told %d times (count %d), want once", len(evs), evs[0].Count)
	}
	if evs := n.warnings(shop, withInit.Obj.UID, controller.ReasonIstioCNIExpected); len(evs) != 0 {
		t.Errorf("a sidecar pod injected with istio-init was told it expects istio-cni: %+v", evs)
	}
	for _, q := range []*kubesim.Pod{p, withInit} {
		n.requireNotEnrolled(q)
	}

	r := n.explain(shop, "validating")
	if r.OK || r.Policy.Capture || r.Policy.Reason != string(enablement.ReasonSidecar) ||
		!strings.Contains(strings.Join(r.Problems, "\n"), "injected for istio-cni's sidecar mode") {
		t.Errorf("explain of the pod that expects istio-cni: %+v", r)
	}
	if r := n.explain(shop, "with-init"); !r.OK || r.Policy.Reason != string(enablement.ReasonSidecar) {
		t.Errorf("explain of the pod injected with istio-init: %+v", r)
	}
}
