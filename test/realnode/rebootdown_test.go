//go:build realnode

package realnode

import (
	"context"
	"errors"
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// The agent does not come back after a reboot: the outage is real (the
// node's run directory is gone, its state directory kept) and the plugin
// decides alone, through the API server with its own credential.

// missingTag is an agent image tag the node's registry does not hold (it
// was never pushed): the agent pod cannot pull it and stays in
// ErrImagePull or ImagePullBackOff.
const missingTag = "not-in-the-registry"

// leaveNode is a nodeSelector this node lacks: the DaemonSet leaves it.
const leaveNode = `nodeSelector={"ambient-cni.test/agent":"elsewhere"}`

// rebootAgentless is one reboot during which whileDown (a helm upgrade)
// keeps the agent from coming back, and the pods created after it.
type rebootAgentless struct {
	plain, mesh, cp *corev1.Pod
}

// rebootWithout reboots the node running whileDown while it is down,
// waits until agentGone says the agent cannot serve, then checks the
// promise without the agent: a pod of a plain namespace and one of
// istio-system start uncaptured, a pod of an ambient namespace waits with
// the plugin's code-11 refusal, on the API server's word, its sandbox
// failure saying each of waitSays.
func (l *life) rebootWithout(t *testing.T, prefix string, whileDown func() error, agentGone func([]corev1.Pod) error, waitSays ...string) rebootAgentless {
	t.Helper()
	ctx := context.Background()
	if l.traffic != nil {
		l.traffic.Stop()
		l.traffic = nil
	}
	suffix := randHex(4)
	plainNS, meshNS := prefix+"-plain-"+suffix, prefix+"-mesh-"+suffix
	l.namespace(t, plainNS, false)
	l.namespace(t, meshNS, true)
	l.rebootAgentAway(t, whileDown, agentGone)

	var r rebootAgentless
	r.mesh = l.createHello(t, meshNS, "waits-"+suffix)
	r.plain = l.createHello(t, plainNS, "plain-"+suffix)
	r.cp = l.createHello(t, ReleaseNamespace, prefix+"-cp-"+suffix)
	t.Cleanup(func() {
		_ = l.n.Client.CoreV1().Pods(ReleaseNamespace).Delete(context.Background(), r.cp.Name, metav1.DeleteOptions{})
	})
	r.plain = l.startsUncaptured(t, r.plain)
	r.cp = l.startsUncaptured(t, r.cp)
	// Code 11 (try again later): kubelet retries the sandbox until the
	// agent answers, and never starts the pod uncaptured.
	l.waitSandboxError(t, r.mesh, "must be captured", waitSays...)
	cur, err := l.n.Client.CoreV1().Pods(meshNS).Get(ctx, r.mesh.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !containerCreating(cur) {
		t.Errorf("%s/%s while the agent is gone: %s, want ContainerCreating", meshNS, r.mesh.Name, podSummary(cur))
	}
	return r
}

// rebootAgentAway reboots the node running whileDown while it is down,
// then waits until the agent pod from before the reboot is deleted,
// agentGone says the agent cannot serve, and the stand-in (host network:
// no CNI) is back.
func (l *life) rebootAgentAway(t *testing.T, whileDown func() error, agentGone func([]corev1.Pod) error) {
	t.Helper()
	ctx := context.Background()
	standIn, err := l.n.Client.CoreV1().Pods(ReleaseNamespace).Get(ctx, StandInName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	oldStandIn := standIn.Status.ContainerStatuses[0].ContainerID
	old := l.oneAgent(t)

	var downErr error
	down := func() {
		if downErr = whileDown(); downErr != nil {
			return
		}
		// The DaemonSet controller deletes the old agent pod before
		// kubelet is back, so kubelet never runs it again: a real outage,
		// not an agent that comes back for a moment (and, told its
		// DaemonSet left, unchains the plugin).
		downErr = l.n.Poll(ctx, "the old agent pod deleted", func(ctx context.Context) (bool, error) {
			p, err := l.n.Client.CoreV1().Pods(old.Namespace).Get(ctx, old.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return true, nil
			}
			if err != nil {
				return false, err
			}
			if p.DeletionTimestamp == nil {
				return false, fmt.Errorf("agent pod %s not deleted yet", old.Name)
			}
			return true, nil
		})
	}
	if err := l.n.Reboot(ctx, down); err != nil {
		t.Fatal(err)
	}
	if downErr != nil {
		t.Fatal(downErr)
	}
	err = l.n.Poll(ctx, "the agent cannot serve after the reboot", func(ctx context.Context) (bool, error) {
		pods, err := l.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if p.Name == old.Name {
				return false, fmt.Errorf("the agent from before the reboot %s is still there: %s", p.Name, podSummary(&p))
			}
		}
		if err := agentGone(pods); err != nil {
			return false, err
		}
		// The plugin stays chained: no agent ran its uninstall.
		return true, pluginInstalled(l.n)
	})
	if err != nil {
		t.Fatal(err)
	}
	// The stand-in runs in the host network: no CNI, it returns at once.
	if err := l.waitRestarted(ctx, ReleaseNamespace, StandInName, oldStandIn); err != nil {
		t.Fatal(err)
	}

}

// startsUncaptured waits until a pod created while the agent is gone is
// Ready, and checks that it is not captured and that its hello at start
// went straight to the sink.
func (l *life) startsUncaptured(t *testing.T, p *corev1.Pod) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	ready, err := l.n.WaitPodReady(ctx, p.Namespace, p.Name)
	if err != nil {
		l.logEvents(t, p)
		t.Fatal(err)
	}
	if ok, err := l.n.released(ctx, ready); !ok {
		t.Errorf("%s/%s, started while the agent is gone: %v", ready.Namespace, ready.Name, err)
	}
	if err := l.n.Poll(ctx, ready.Name+"'s hello", func(ctx context.Context) (bool, error) {
		c, err := l.hellos(ctx, "/hello-"+ready.Name)
		return c > 0, err
	}); err != nil {
		t.Error(err)
	} else if recs := l.records(t, ready.UID, ambient.ZtunnelOutboundPort, l.sink); len(recs) > 0 {
		t.Errorf("%s/%s: the stand-in proxied %d of its connections, want none", ready.Namespace, ready.Name, len(recs))
	}
	return ready
}

// logEvents logs a pod's events: why a pod that should have started did
// not.
func (l *life) logEvents(t *testing.T, p *corev1.Pod) {
	t.Helper()
	evs, err := l.n.PodEvents(context.Background(), p.Namespace, p.Name)
	if err != nil {
		t.Log(err)
		return
	}
	for _, ev := range evs {
		t.Logf("%s/%s event %s (x%d): %s", p.Namespace, p.Name, ev.Reason, ev.Count, ev.Message)
	}
}

// createHello creates an app pod that says hello to the sink at start,
// without waiting for it.
func (l *life) createHello(t *testing.T, ns, name string) *corev1.Pod {
	t.Helper()
	p, err := l.n.Client.CoreV1().Pods(ns).Create(context.Background(),
		l.n.AppPod(ns, name, AppOptions{Hello: l.sinkURL("/hello-" + name)}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// agentReturns restores the chart and checks that the waiting pod starts
// captured: its first packet, its hello at start, went through the
// stand-in.
func (l *life) agentReturns(t *testing.T, restore func() error, r rebootAgentless) {
	t.Helper()
	ctx := context.Background()
	if err := restore(); err != nil {
		t.Fatal(err)
	}
	ready, err := l.n.WaitPodReady(ctx, r.mesh.Namespace, r.mesh.Name)
	if err != nil {
		t.Fatal(err)
	}
	l.mustCaptured(t, ready)
	if err := l.n.Poll(ctx, ready.Name+"'s hello", func(ctx context.Context) (bool, error) {
		c, err := l.hellos(ctx, "/hello-"+ready.Name)
		return c > 0, err
	}); err != nil {
		t.Error(err)
	} else if !l.startedCaptured(t, ready) {
		t.Errorf("%s/%s started uncaptured once the agent returned: its hello at start bypassed the stand-in", ready.Namespace, ready.Name)
	}
	// The pods that started without the agent stay uncaptured: their
	// namespaces are still plain.
	for _, p := range []*corev1.Pod{r.plain, r.cp} {
		if ok, err := l.n.released(ctx, p); !ok {
			t.Errorf("%s/%s after the agent returned: %v", p.Namespace, p.Name, err)
		}
	}
}

// agentCannotPull is nil when the one agent pod cannot pull its image.
func agentCannotPull(pods []corev1.Pod) error {
	if len(pods) != 1 {
		return fmt.Errorf("%d agent pods, want the one that cannot pull", len(pods))
	}
	for _, cs := range pods[0].Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil && (w.Reason == "ErrImagePull" || w.Reason == "ImagePullBackOff") {
			return nil
		}
	}
	return fmt.Errorf("agent %s: %s, want ErrImagePull or ImagePullBackOff", pods[0].Name, podSummary(&pods[0]))
}

// While the node is down, the DaemonSet is upgraded to an agent image the
// node cannot pull (a tag its registry lacks), so the agent
// never runs after the reboot. Plain and istio-system pods start
// uncaptured at once; a pod of an ambient namespace waits with code 11;
// the upgrade back to a good image captures it.
func (l *life) testImageUnpullableAfterReboot(t *testing.T) {
	ctx := context.Background()
	restore := l.restoreChartOnFailure(t, nil)
	r := l.rebootWithout(t, "unpull",
		func() error { return l.n.UpgradeAgentNoWait(ctx, missingTag) },
		agentCannotPull,
		// The DaemonSet still runs on the node: the wait is for its agent.
		"the API server shows the pod must be captured", "check that the ambient-cni node agent is running")
	l.agentReturns(t, restore, r)
}

// While the node is down, the DaemonSet's nodeSelector is changed to one
// this node lacks: its agent pod is deleted without ever running again,
// so no agent unchains the plugin or serves it. Plain and istio-system
// pods start uncaptured (the plugin asks the API server with its
// credential, valid until it expires, at most cni.pluginTokenLifetime); a
// pod of an ambient namespace waits and never starts uncaptured, and its
// sandbox failure says that the DaemonSet no longer runs on this node
// (the fallback read the DaemonSet and the Node with the plugin's own
// role) and what ends the wait.
//
// How an operator recovers: put the node back under the DaemonSet (what
// this test does, restoring the nodeSelector): the agent returns and
// captures the waiting pods. To take the node out of the mesh instead, as
// root on the node: create the uninstall marker (uninstalling in
// agent.stateDir), after which every pod starts, then remove the
// ambient-cni entry from the node's CNI conflist; a pod already waiting
// starts, uncaptured, on the runtime's next retry.
func (l *life) testDaemonSetLeftWhileDown(t *testing.T) {
	ctx := context.Background()
	restore := l.restoreChartOnFailure(t, nil)
	r := l.rebootWithout(t, "left",
		func() error { return l.n.UpgradeAgentNoWait(ctx, ImageTag, "--set-json", leaveNode) },
		func(pods []corev1.Pod) error {
			if len(pods) > 0 {
				return fmt.Errorf("agent pod %s still there: %s", pods[0].Name, podSummary(&pods[0]))
			}
			return nil
		},
		"the agent's DaemonSet "+ReleaseNamespace+"/ambient-cni no longer runs on node "+l.n.Name+" (its nodeSelector does not match the node's labels)",
		"Put the node back in the DaemonSet's scope", "/uninstalling")
	// Still off the node: no agent came back meanwhile.
	pods, err := l.n.AgentPods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(pods) > 0 {
		t.Fatal(errors.New("an agent pod came back to a node the DaemonSet left: " + pods[0].Name))
	}
	l.agentReturns(t, restore, r)
}
