//go:build realnode

package realnode

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// runtimeNetwork is the NetworkReady condition containerd reports in its
// CRI Status answer, the one kubelet polls. containerd 2.x computes it by
// calling CNI STATUS on every plugin of a conflist of cniVersion 1.1.0 or
// later, so a crictl info is a STATUS call made now.
func (e *e2e) runtimeNetwork(ctx context.Context) (ready bool, message string, err error) {
	info, err := e.runtimeInfo(ctx)
	if err != nil {
		return false, "", err
	}
	for _, c := range info.Status.Conditions {
		if c.Type == "NetworkReady" {
			return c.Status, c.Reason + ": " + c.Message, nil
		}
	}
	return false, "", fmt.Errorf("crictl info has no NetworkReady condition: %+v", info.Status)
}

// nodeReady is the node's Ready condition as kubelet last wrote it.
func (e *e2e) nodeReady(ctx context.Context) (corev1.NodeCondition, error) {
	node, err := e.n.Kube.Client.CoreV1().Nodes().Get(ctx, e.n.Name, metav1.GetOptions{})
	if err != nil {
		return corev1.NodeCondition{}, err
	}
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c, nil
		}
	}
	return corev1.NodeCondition{}, fmt.Errorf("node %s has no Ready condition", e.n.Name)
}

// testStatusThroughTheRuntime: containerd 2.x calls the plugin's CNI STATUS
// (the node's primary conflist is cniVersion 1.1.0) and kubelet's view of
// the node follows it. By default STATUS says only that the plugin can be
// run: an agent outage leaves the runtime's network ready and the node
// Ready (a NotReady node stops every pod on it and, past the eviction
// timeout, evicts them). With cni.statusChecksAgent, the operator's
// choice, STATUS fails while the agent is unreachable: containerd reports
// the network not ready with the plugin's message, kubelet marks the node
// NotReady, and both come back when the agent does.
func (e *e2e) testStatusThroughTheRuntime(t *testing.T) {
	ctx := context.Background()
	if ready, msg, err := e.runtimeNetwork(ctx); err != nil || !ready {
		t.Fatalf("before: runtime network ready %v (%s), %v", ready, msg, err)
	}

	outage := func(t *testing.T, statusChecksAgent bool) func() error {
		t.Helper()
		values := []string{"--set", fmt.Sprintf("cni.statusChecksAgent=%t", statusChecksAgent)}
		if err := e.n.InstallAgent(ctx, "upgrade", ImageTag, values...); err != nil {
			t.Fatal(err)
		}
		err := e.n.Poll(ctx, "the conflist entry carries statusChecksAgent", func(context.Context) (bool, error) {
			pc, err := pluginConf(e.n)
			if err != nil {
				return false, err
			}
			if pc.StatusRequiresAgent != statusChecksAgent {
				return false, fmt.Errorf("conflist statusRequiresAgent %v", pc.StatusRequiresAgent)
			}
			return true, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return e.crashloopAgent(t, values...)
	}

	t.Run("by default an agent outage leaves the network ready", func(t *testing.T) {
		restore := outage(t, false)
		// The STATUS call this makes happens now, with the agent gone.
		ready, msg, err := e.runtimeNetwork(ctx)
		if err != nil || !ready {
			t.Errorf("with the agent down and statusChecksAgent off the runtime's network is not ready (%s), %v", msg, err)
		}
		if c, err := e.nodeReady(ctx); err != nil || c.Status != corev1.ConditionTrue {
			t.Errorf("node Ready %v (%s), %v", c.Status, c.Message, err)
		}
		if err := restore(); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("with statusChecksAgent the node is NotReady while the agent is gone", func(t *testing.T) {
		restore := outage(t, true)
		err := e.n.Poll(ctx, "containerd reports the network not ready with the plugin's message", func(ctx context.Context) (bool, error) {
			ready, msg, err := e.runtimeNetwork(ctx)
			if err != nil {
				return false, err
			}
			if ready || !strings.Contains(msg, "ambient-cni") {
				return false, fmt.Errorf("runtime network ready %v: %s", ready, msg)
			}
			t.Logf("runtime: %s", msg)
			return true, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		err = e.n.Poll(ctx, "kubelet marks the node NotReady", func(ctx context.Context) (bool, error) {
			c, err := e.nodeReady(ctx)
			if err != nil {
				return false, err
			}
			if c.Status == corev1.ConditionTrue {
				return false, fmt.Errorf("node still Ready: %s", c.Message)
			}
			t.Logf("node Ready=%s: %s", c.Status, c.Message)
			return true, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := restore(); err != nil {
			t.Fatal(err)
		}
		err = e.n.Poll(ctx, "the node Ready again once the agent serves", func(ctx context.Context) (bool, error) {
			if ready, msg, err := e.runtimeNetwork(ctx); err != nil || !ready {
				return false, fmt.Errorf("runtime network ready %v: %s %v", ready, msg, err)
			}
			c, err := e.nodeReady(ctx)
			if err != nil || c.Status != corev1.ConditionTrue {
				return false, fmt.Errorf("node Ready %v: %s %v", c.Status, c.Message, err)
			}
			return true, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		// The shipped default again, for the subtests after this one.
		if err := e.n.InstallAgent(ctx, "upgrade", ImageTag); err != nil {
			t.Fatal(err)
		}
	})
}
