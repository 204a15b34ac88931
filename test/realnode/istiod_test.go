//go:build realnode

package realnode

import (
	"context"
	"errors"
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestRealNodeIstiod puts Istio's own control plane in the loop: istiod,
// run as its ambient chart runs it, reads what the agent writes. It has a
// node of its own (Up waits for TestRealNode's to be gone), on which
// istiod's untaint controller, not the agent, removes the startup taint.
func TestRealNodeIstiod(t *testing.T) {
	ctx, out, tools := startNodeTest(t)
	if _, err := IstiodDir(tools.Repo); err != nil {
		testnet.Missing(t, err.Error())
	}
	// Registered with the startup taint, as a node pool set up for
	// istiod's taint.enabled is.
	n, err := Up(ctx, Options{Out: out, Images: testImages, StartupTaint: true})
	if err != nil {
		t.Fatalf("node up: %v", err)
	}
	downDone := false
	t.Cleanup(func() {
		if !downDone {
			if err := n.Down(); err != nil {
				t.Errorf("down: %v", err)
			}
		}
	})
	ist, err := n.StartIstiod(ctx, IstiodOptions{Untaint: true})
	if err != nil {
		t.Fatalf("istiod: %v", err)
	}
	t.Cleanup(func() { _ = ist.Stop() }) // before Down (cleanups run last first)
	logTail := func() {
		if t.Failed() {
			t.Logf("istiod log tail:\n%s", ist.LogTail(40))
		}
	}
	t.Cleanup(func() {
		if !downDone {
			logTail()
		}
	})
	e := &e2e{n: n, out: out}

	t.Run("istiod's untaint controller removes the startup taint once our agent's pod is ready", func(t *testing.T) {
		taints := func() []corev1.Taint {
			node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return node.Spec.Taints
		}
		// istiod is ready and the node has no agent pod yet: the taint is
		// still there (a check at one moment, not a wait).
		if all := taints(); !nodetaint.Has(all) {
			t.Fatalf("the node's taints %+v lack %s before any agent runs", all, nodetaint.Key)
		}
		others := len(taints()) - 1
		// The agent's own startup-taint handling off, as the chart's
		// default is beside istiod's controller: only istiod removes it.
		if err := n.InstallAgent(ctx, "install", ImageTag, "--set", "startupTaint.enabled=false"); err != nil {
			t.Fatalf("helm install: %v", err)
		}
		err := n.Poll(ctx, "istiod removes "+nodetaint.Key, func(context.Context) (bool, error) {
			if all := taints(); nodetaint.Has(all) {
				return false, fmt.Errorf("taints %+v", all)
			}
			return true, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("taint %s gone; the node keeps %+v", nodetaint.Key, taints())
		if all := taints(); len(all) != others {
			t.Errorf("taints %+v: want the %d others kept", all, others)
		}
	})
	if t.Failed() {
		return
	}
	if err := n.StartStandIn(ctx); err != nil {
		t.Fatalf("ztunnel stand-in: %v", err)
	}
	e.standIn = true

	t.Run("istiod sees a pod we capture as HBONE and one we release or never capture as not", func(t *testing.T) {
		e.namespace(t, "mesh", true)
		e.namespace(t, "plain", false)
		captured := e.start(t, "mesh", "captured", AppOptions{})
		never := e.start(t, "plain", "never", AppOptions{})
		e.mustCaptured(t, captured)
		waitIstiod(t, n, ist, captured, true)
		waitIstiod(t, n, ist, never, false)

		// Opted out while running: the agent releases it and removes the
		// annotation; istiod follows.
		labelPod(t, n, captured, ambient.DataplaneModeNone)
		if err := n.Poll(ctx, "captured released", func(ctx context.Context) (bool, error) { return n.released(ctx, captured) }); err != nil {
			t.Fatal(err)
		}
		waitIstiod(t, n, ist, captured, false)

		// And back in: captured again, HBONE again.
		labelPod(t, n, captured, "")
		e.mustCaptured(t, captured)
		waitIstiod(t, n, ist, captured, true)
		// The pod never captured stayed out all along.
		waitIstiod(t, n, ist, never, false)
	})

	t.Run("nothing was sent off the machine", testNoEgress(n))

	logTail() // Down removes the node directory with the log
	if err := ist.Stop(); err != nil {
		t.Errorf("istiod did not stop cleanly: %v", err)
	}
	downDone = true
	if err := n.Down(); err != nil {
		t.Fatalf("down: %v", err)
	}
}

// waitIstiod waits until istiod lists the pod as a workload, reached
// through HBONE exactly when hbone is set.
func waitIstiod(t *testing.T, n *Node, ist *Istiod, p *corev1.Pod, hbone bool) {
	t.Helper()
	want := "no tunnel"
	if hbone {
		want = "HBONE"
	}
	err := n.Poll(context.Background(), fmt.Sprintf("istiod's view of %s/%s", p.Namespace, p.Name), func(ctx context.Context) (bool, error) {
		w, err := ist.Workload(ctx, p.Namespace, p.Name)
		if err != nil {
			return false, err
		}
		if w == nil {
			return false, errors.New("istiod lists no workload of it")
		}
		if w.HBONE() != hbone {
			return false, fmt.Errorf("istiod: tunnel protocol %q (status %q), want %s", w.TunnelProtocol, w.Status, want)
		}
		t.Logf("istiod: %s/%s %s (workload %s, status %s)", p.Namespace, p.Name, w.View(), w.UID, w.Status)
		return true, nil
	})
	if err != nil {
		t.Fatalf("%s/%s: %v", p.Namespace, p.Name, err)
	}
}

// labelPod sets the pod's dataplane-mode label (empty: removes it).
func labelPod(t *testing.T, n *Node, p *corev1.Pod, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.DataplaneModeLabel, value)
	if value == "" {
		patch = fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, ambient.DataplaneModeLabel)
	}
	if _, err := n.Client.CoreV1().Pods(p.Namespace).Patch(context.Background(), p.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}
