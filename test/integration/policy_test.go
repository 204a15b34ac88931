package integration

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// TestNeverEnrolled: hostNetwork pods, sidecar-injected pods, pods in
// kube-system and the agent's own pod stay alone even when labelled
// ambient or in an enabled namespace, on both paths: their CNI ADD passes
// them through, and the controller leaves them alone once they run.
func TestNeverEnrolled(t *testing.T) {
	n := newNode(t, nodeOptions{})
	shop := n.namespace("shop", ambientLabel)
	// kube-system exists (the apiserver makes it); pods need its default
	// ServiceAccount, which no controller manager creates here.
	// The same for the agent's own namespace.
	for _, ns := range []string{metav1.NamespaceSystem, n.agentNS} {
		_, err := n.env.Client.CoreV1().ServiceAccounts(ns).Create(context.Background(),
			&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}

	hostNet := podSpec(shop, "host-network", ambientLabel, nil)
	hostNet.Spec.HostNetwork = true
	sidecar := podSpec(shop, "sidecar", ambientLabel, map[string]string{ambient.SidecarStatusAnnotation: `{"containers":["istio-proxy"]}`})
	system := podSpec(metav1.NamespaceSystem, testnet.RandName("sys-", 6), ambientLabel, nil)
	self := podSpec(n.agentNS, n.agentPod, ambientLabel, nil)
	var pods []*kubesim.Pod
	for _, spec := range []*corev1.Pod{hostNet, sidecar, system, self} {
		// Through the real CNI path: the agent answers not-enrolled.
		pods = append(pods, n.runPod(spec))
	}
	// A pod that must be enrolled, as a witness that the controller has
	// seen every status update by now.
	witness := n.runPod(podSpec(shop, "witness", nil, nil))
	n.waitEnrolled(waitLong, witness)
	// Give the controller a status update of each pod to act on.
	for _, p := range pods {
		if err := n.kube.SetStatus(context.Background(), p, corev1.PodRunning); err != nil {
			t.Fatal(err)
		}
	}
	n.setPodMode(witness, ambient.DataplaneModeNone)
	n.waitUnenrolled(witness)
	for _, p := range pods {
		n.requireNotEnrolled(p)
	}
	for _, m := range n.zt.Messages() {
		if m.Kind == ztunnel.KindAdd && m.UID != string(witness.Obj.UID) {
			t.Errorf("ztunnel got an Add for a pod that must not be enrolled: %+v", m)
		}
	}
}

// TestEventOnEnrollFailure: when ztunnel refuses a running pod, the agent
// records a Warning Event on the pod that says why; once ztunnel accepts
// it, the pod is enrolled.
func TestEventOnEnrollFailure(t *testing.T) {
	const why = "stand-in refuses this workload on purpose"
	n := newNode(t, nodeOptions{})
	plain := n.namespace("plain", nil)
	p := n.runPod(podSpec(plain, "refused", nil, nil))
	uid := string(p.Obj.UID)
	n.zt.SetFaults(ztunnel.Faults{RejectAdd: func(u string) string {
		if u == uid {
			return why
		}
		return ""
	}})
	n.setPodMode(p, ambient.DataplaneModeAmbient)

	var ev *corev1.Event
	poll.Within(t, waitLong, "a Warning Event on the pod", func() bool {
		list, err := n.env.Client.CoreV1().Events(plain).List(context.Background(), metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.uid", uid).String(),
		})
		if err != nil || len(list.Items) == 0 {
			return false
		}
		ev = &list.Items[0]
		return true
	})
	if diff := cmp.Diff([2]string{corev1.EventTypeWarning, "AmbientEnrollFailed"}, [2]string{ev.Type, ev.Reason}); diff != "" || !strings.Contains(ev.Message, why) {
		t.Fatalf("event: type %s reason %s message %q; want a Warning with the refusal in it", ev.Type, ev.Reason, ev.Message)
	}
	if ev.Source.Host != n.Name || ev.InvolvedObject.Name != p.Obj.Name {
		t.Errorf("event source %+v about %+v", ev.Source, ev.InvolvedObject)
	}
	if _, ok := n.zt.Workload(uid); ok {
		t.Fatal("the stand-in serves a pod it refused")
	}
	t.Logf("event: %s %s: %s", ev.Type, ev.Reason, ev.Message)

	// The controller keeps retrying; once ztunnel accepts, the pod is in.
	n.zt.SetFaults(ztunnel.Faults{})
	n.waitEnrolled(waitLong, p)
}
