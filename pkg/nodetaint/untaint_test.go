package nodetaint

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

var kube kubeenv.Shared

func TestMain(m *testing.M) { os.Exit(kube.Run(m)) }

// nodesRBAC is the rule the chart adds to the agent's ClusterRole with
// startupTaint.enabled (test/deploy checks the chart grants it, and that
// its admission policy narrows it).
const nodesRBAC = `apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: %s
rules:
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["get", "patch"]
`

// taintedNode creates a node with the startup taint and another, and a
// client that may only read and patch nodes.
func taintedNode(t *testing.T) (*kubeenv.Env, *kubeclient.Client, string) {
	t.Helper()
	env := kube.Env(t)
	name := testnet.RandName("node-", 8)
	_, err := env.Client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{other, Taint}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Client.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	role := testnet.RandName("nodetaint-", 6)
	cfg, _ := env.ServiceAccountClient(t, testnet.RandName("agent-", 6), "agent", []byte(fmt.Sprintf(nodesRBAC, role)))
	client, err := kubeclient.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return env, client, name
}

func taintsOf(t *testing.T, env *kubeenv.Env, node string) []corev1.Taint {
	t.Helper()
	n, err := env.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n.Spec.Taints
}

func hasOther(taints []corev1.Taint) bool {
	return slices.ContainsFunc(taints, func(t corev1.Taint) bool { return t.MatchTaint(&other) && t.Value == other.Value })
}

// The taint stays while the agent is not ready, however often it asks,
// and goes, with every other taint kept, once it is; Run then returns.
func TestUntainterRemovesOnlyOnceReady(t *testing.T) {
	env, client, node := taintedNode(t)
	var ready atomic.Bool
	var asked atomic.Int32
	u := Untainter{Client: client, Node: node, Interval: 10 * time.Millisecond, Ready: func() []string {
		asked.Add(1)
		if !ready.Load() {
			return []string{"ztunnel: no snapshot acked"}
		}
		return nil
	}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- u.Run(ctx) }()

	poll.Until(t, "the untainter to ask for readiness a few times", func() bool { return asked.Load() >= 5 })
	if taints := taintsOf(t, env, node); !Has(taints) || !hasOther(taints) {
		t.Fatalf("taints %+v while not ready, want ours and the other", taints)
	}
	ready.Store(true)
	poll.Until(t, "Run to return once the taint is gone", func() bool {
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
			return true
		default:
			return false
		}
	})
	if taints := taintsOf(t, env, node); Has(taints) || !hasOther(taints) {
		t.Errorf("taints %+v once ready, want only the other", taints)
	}
}

// Add puts the taint back for the next agent, keeping the others; on a
// node without taints too.
func TestAddKeepsOtherTaints(t *testing.T) {
	env, client, node := taintedNode(t)
	ctx := context.Background()
	if removed, err := Remove(ctx, client, node); err != nil || !removed {
		t.Fatalf("Remove = %v, %v", removed, err)
	}
	if added, err := Add(ctx, client, node); err != nil || !added {
		t.Fatalf("Add = %v, %v", added, err)
	}
	if taints := taintsOf(t, env, node); !Has(taints) || !hasOther(taints) {
		t.Errorf("taints %+v after Add, want ours and the other", taints)
	}

	bare := testnet.RandName("node-", 8)
	if _, err := env.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: bare}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Client.CoreV1().Nodes().Delete(context.Background(), bare, metav1.DeleteOptions{}) })
	if added, err := Add(ctx, client, bare); err != nil || !added {
		t.Fatalf("Add on a node without taints = %v, %v", added, err)
	}
	if !Has(taintsOf(t, env, bare)) {
		t.Errorf("taints %+v, want ours", taintsOf(t, env, bare))
	}
}

// A node that is not there is a clear error.
func TestRemoveMissingNode(t *testing.T) {
	_, client, _ := taintedNode(t)
	if _, err := Remove(context.Background(), client, "no-such-node-"+testnet.RandName("", 6)); err == nil {
		t.Error("Remove on a missing node: want an error")
	}
}
