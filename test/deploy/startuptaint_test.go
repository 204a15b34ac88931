package deploy

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient/kubeclienttest"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// otherTaint is a taint someone else owns; the agent must never lose it.
var otherTaint = corev1.Taint{Key: "example.com/dedicated", Value: "mesh", Effect: corev1.TaintEffectNoSchedule}

// With startupTaint.enabled, the chart applied for real lets its
// ServiceAccount, holding a token bound to a pod on node A (as kubelet's
// projected token is), remove and add the startup taint on node A, keeping
// every other taint, and refuses every other change to a Node: another
// taint, a label, an annotation, a spec field, another node, and any change
// at all with a token that names no node.
func TestStartupTaintPolicy(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	name := testnet.RandName("agent-", 6)
	manifest := render(t, name, ns, "--set", "nameOverride="+name, "--set", "startupTaint.enabled=true")
	if o := decode(t, manifest); o.policy == nil || o.binding == nil {
		t.Fatal("startupTaint.enabled renders no ValidatingAdmissionPolicy and binding")
	}
	if _, err := env.Apply(ctx, manifest, kubeenv.ApplyOptions{Namespace: ns}); err != nil {
		t.Fatal(err)
	}

	nodeA, nodeB := testnet.RandName("node-a-", 6), testnet.RandName("node-b-", 6)
	for _, n := range []string{nodeA, nodeB} {
		_, err := env.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: n, Labels: map[string]string{"example.com/pool": "mesh"}},
			Spec:       corev1.NodeSpec{Taints: []corev1.Taint{nodetaint.Taint, otherTaint}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = env.Client.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{}) })
	}
	// The agent's pod on node A; its token carries node A's name.
	pod, err := env.Client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-x1"},
		Spec: corev1.PodSpec{
			NodeName: nodeA, ServiceAccountName: name,
			Containers: []corev1.Container{{Name: "install-cni", Image: "registry.invalid/ambient-cni"}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bound := saClient(t, env, ns, name, &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID})
	unbound := saClient(t, env, ns, name, nil)

	// Bindings and policies take effect through watches: wait until a
	// label change (dry run: nothing is changed if the policy is not
	// there yet) is refused by the policy.
	refusedByPolicy := func(err error) bool {
		// Refused by one of its rules, not by an expression that failed.
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "ValidatingAdmissionPolicy") &&
			strings.Contains(err.Error(), "the CNI agent may") && !strings.Contains(err.Error(), "resulted in error")
	}
	var answer error
	if poll.Wait(ctx, 60*time.Second, func() bool {
		_, answer = bound.CoreV1().Nodes().Patch(ctx, nodeA, types.MergePatchType, []byte(`{"metadata":{"labels":{"example.com/pool":"other"}}}`),
			metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}})
		return refusedByPolicy(answer)
	}) != nil {
		t.Fatalf("label change on its own node not refused by the policy within 60s: last answer %v", answer)
	}

	jsonPatch := func(ops ...map[string]any) []byte {
		b, err := json.Marshal(ops)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	refused := map[string]struct {
		client kubernetes.Interface
		node   string
		kind   types.PatchType
		patch  []byte
	}{
		"another taint": {bound, nodeA, types.JSONPatchType, jsonPatch(map[string]any{"op": "remove", "path": "/spec/taints/1"})},
		"add a taint": {bound, nodeA, types.JSONPatchType, jsonPatch(map[string]any{"op": "add", "path": "/spec/taints/-",
			"value": corev1.Taint{Key: "example.com/x", Effect: corev1.TaintEffectNoExecute}})},
		"a label":         {bound, nodeA, types.MergePatchType, []byte(`{"metadata":{"labels":{"example.com/pool":null}}}`)},
		"an annotation":   {bound, nodeA, types.MergePatchType, []byte(`{"metadata":{"annotations":{"example.com/a":"b"}}}`)},
		"unschedulable":   {bound, nodeA, types.MergePatchType, []byte(`{"spec":{"unschedulable":true}}`)},
		"providerID":      {bound, nodeA, types.MergePatchType, []byte(`{"spec":{"providerID":"example://x"}}`)},
		"another node":    {bound, nodeB, types.JSONPatchType, jsonPatch(map[string]any{"op": "remove", "path": "/spec/taints/0"})},
		"no bound node":   {unbound, nodeA, types.JSONPatchType, jsonPatch(map[string]any{"op": "remove", "path": "/spec/taints/0"})},
		"status by patch": {bound, nodeA, types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}},"status":{"capacity":{"pods":"1"}}}`)},
	}
	const (
		ownNode = "may change only the node its pod runs on"
		taint   = "may change only the taint"
		meta    = "may not change a Node's labels or annotations"
		spec    = "may not change a Node's spec"
	)
	refusedFor := map[string]string{
		"another taint": taint, "add a taint": taint, "a label": meta, "an annotation": meta,
		"unschedulable": spec, "providerID": spec, "another node": ownNode, "no bound node": ownNode,
		"status by patch": meta,
	}
	for what, r := range refused {
		_, err := r.client.CoreV1().Nodes().Patch(ctx, r.node, r.kind, r.patch, metav1.PatchOptions{})
		if !refusedByPolicy(err) {
			t.Errorf("%s: want refused by the policy, got %v", what, err)
		}
		if err != nil && !strings.Contains(err.Error(), refusedFor[what]) {
			t.Errorf("%s: refused for another reason than %q: %v", what, refusedFor[what], err)
		}
	}
	if _, err := nodetaint.Remove(ctx, kubeclienttest.FromClientset(bound), nodeB); !refusedByPolicy(err) {
		t.Errorf("Remove on another node: want refused by the policy, got %v", err)
	}
	if _, err := nodetaint.Remove(ctx, kubeclienttest.FromClientset(unbound), nodeA); !refusedByPolicy(err) {
		t.Errorf("Remove with a token bound to no node: want refused by the policy, got %v", err)
	}
	wantTaints(t, env, nodeA, nodetaint.Taint, otherTaint)
	wantTaints(t, env, nodeB, nodetaint.Taint, otherTaint)

	// A change to another taint between the agent's read and its patch
	// fails the patch's test (it is not lost), and Remove, which reads
	// again, keeps it.
	n, err := env.Client.CoreV1().Nodes().Get(ctx, nodeA, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	stale, err := nodetaint.RemovePatch(n.Spec.Taints)
	if err != nil {
		t.Fatal(err)
	}
	late := corev1.Taint{Key: "example.com/late", Effect: corev1.TaintEffectPreferNoSchedule}
	n.Spec.Taints = append(n.Spec.Taints, late)
	if _, err := env.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := bound.CoreV1().Nodes().Patch(ctx, nodeA, types.JSONPatchType, stale, metav1.PatchOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("stale removal: want 422 Invalid from the failed test, got %v", err)
	}
	wantTaints(t, env, nodeA, nodetaint.Taint, otherTaint, late)

	// The agent's own changes: remove, add back, remove.
	if removed, err := nodetaint.Remove(ctx, kubeclienttest.FromClientset(bound), nodeA); err != nil || !removed {
		t.Fatalf("Remove on its own node = %v, %v; want true, nil", removed, err)
	}
	wantTaints(t, env, nodeA, otherTaint, late)
	if removed, err := nodetaint.Remove(ctx, kubeclienttest.FromClientset(bound), nodeA); err != nil || removed {
		t.Errorf("second Remove = %v, %v; want false, nil", removed, err)
	}
	if added, err := nodetaint.Add(ctx, kubeclienttest.FromClientset(bound), nodeA); err != nil || !added {
		t.Fatalf("Add on its own node = %v, %v; want true, nil", added, err)
	}
	wantTaints(t, env, nodeA, otherTaint, late, nodetaint.Taint)
	if added, err := nodetaint.Add(ctx, kubeclienttest.FromClientset(bound), nodeA); err != nil || added {
		t.Errorf("second Add = %v, %v; want false, nil", added, err)
	}
	if _, err := nodetaint.Remove(ctx, kubeclienttest.FromClientset(bound), nodeA); err != nil {
		t.Fatal(err)
	}
	wantTaints(t, env, nodeA, otherTaint, late)
	wantTaints(t, env, nodeB, nodetaint.Taint, otherTaint)

	// Anyone else is not the policy's business.
	if _, err := env.Client.CoreV1().Nodes().Patch(ctx, nodeA, types.MergePatchType, []byte(`{"metadata":{"labels":{"example.com/pool":"other"}}}`), metav1.PatchOptions{}); err != nil {
		t.Errorf("admin label change: %v", err)
	}
}

// Without startupTaint.enabled the agent may read Nodes (its own, at
// shutdown) but not change any.
func TestStartupTaintOffGrantsNoNodeWrites(t *testing.T) {
	o := decode(t, render(t, "x", "ns-x"))
	if o.policy != nil || o.binding != nil {
		t.Error("default values render the startup taint's policy")
	}
	for _, r := range o.cr.Rules {
		if slices.Contains(r.Resources, "nodes") && !slices.Equal(r.Verbs, []string{"get"}) {
			t.Errorf("default values grant %+v", r)
		}
	}
}

// saClient returns a client of ServiceAccount ns/name whose token is bound
// to ref (nil: a plain TokenRequest token, naming no node).
func saClient(t *testing.T, env *kubeenv.Env, ns, name string, ref *authenticationv1.BoundObjectReference) kubernetes.Interface {
	t.Helper()
	tr, err := env.Client.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: new(int64(600)), BoundObjectRef: ref},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kubernetes.NewForConfig(&rest.Config{Host: env.Config.Host, TLSClientConfig: rest.TLSClientConfig{CAData: env.Config.CAData}, BearerToken: tr.Status.Token})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// wantTaints checks a node's taints but those of node conditions
// (node.kubernetes.io/*, which the API server's admission adds to a new
// node).
func wantTaints(t *testing.T, env *kubeenv.Env, node string, want ...corev1.Taint) {
	t.Helper()
	n, err := env.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var got []corev1.Taint
	for _, tt := range n.Spec.Taints {
		if strings.HasPrefix(tt.Key, "node.kubernetes.io/") {
			continue
		}
		tt.TimeAdded = nil
		got = append(got, tt)
	}
	if !slices.EqualFunc(got, want, func(a, b corev1.Taint) bool { return a.MatchTaint(&b) && a.Value == b.Value }) {
		t.Errorf("node %s taints %+v, want %+v", node, got, want)
	}
}
