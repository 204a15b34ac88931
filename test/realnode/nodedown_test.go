//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// The cases of a broken agent on a real node: whatever is wrong with the
// agent or its DaemonSet, the node keeps starting the pods that do not
// depend on it.

// outageWindow is the plugin's agentDownAfter in the crashloop case. The
// shipped 2m (pinned by test/deploy) would make each outage last minutes
// of the suite; the plugin applies any window the same way, and 20s stays
// above the agent's heartbeat interval so a live agent is never taken
// for gone.
const outageWindow = 20 * time.Second

// brokenKubeconfig makes install-cni exit at start (its API client
// config cannot be read) with a setting the chart accepts: a crashloop
// from a bad upgrade.
const brokenKubeconfig = `extraEnv=[{"name":"AMBIENT_KUBECONFIG","value":"/nonexistent/kubeconfig"}]`

// crashloopAgent makes the bad upgrade: the DaemonSet replaces the one
// agent running now with one that exits at start (extra are more helm
// arguments), and it waits until the new agent has exited once. The
// returned function upgrades back to the chart's defaults; a test that
// fails first gets that from a cleanup.
func (e *e2e) crashloopAgent(t *testing.T, extra ...string) func() error {
	t.Helper()
	ctx := context.Background()
	// An earlier upgrade's rollout may still be removing the agent it
	// replaced.
	var old corev1.Pod
	err := e.n.Poll(ctx, "one agent pod before the bad upgrade", func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentPods(ctx)
		if err != nil || len(pods) != 1 {
			return false, fmt.Errorf("%d agent pods, %v", len(pods), err)
		}
		old = pods[0]
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	fixed := e.restoreChartOnFailure(t, nil)
	if err := e.n.UpgradeAgentNoWait(ctx, ImageTag, append(extra, "--set-json", brokenKubeconfig)...); err != nil {
		t.Fatal(err)
	}
	err = e.n.Poll(ctx, "agent crashlooping", func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		if len(pods) != 1 || pods[0].Name == old.Name {
			return false, fmt.Errorf("%d agent pods, the old one %s may still be there", len(pods), old.Name)
		}
		for _, cs := range pods[0].Status.ContainerStatuses {
			if term := cs.LastTerminationState.Terminated; term != nil && term.ExitCode != 0 {
				return true, nil
			}
		}
		return false, fmt.Errorf("agent %s has not exited yet: %s", pods[0].Name, podSummary(&pods[0]))
	})
	if err != nil {
		t.Fatal(err)
	}
	return fixed
}

// The agent crashloops (a bad helm upgrade): the plugin asks the API
// server with its own credential, so a pod of a plain namespace starts
// uncaptured at once and is recorded for the agent; a pod of an enabled
// namespace stays ContainerCreating with the plugin's error. (The window
// setting is kept to show it no longer holds any pod back.) The fix (helm upgrade back) captures the waiting pod, and the
// returning agent re-checks the recorded ones: the one whose namespace
// stayed plain stays uncaptured, the one whose namespace was labelled
// during the outage is captured.
func (e *e2e) testAgentCrashloop(t *testing.T) {
	ctx := context.Background()
	suffix := randHex(4)
	plainNS, meshNS, lateNS := "down-plain-"+suffix, "down-mesh-"+suffix, "down-late-"+suffix
	e.namespace(t, plainNS, false)
	e.namespace(t, meshNS, true)
	e.namespace(t, lateNS, false)

	window := []string{"--set", "cni.agentDownAfter=" + outageWindow.String()}
	if err := e.n.InstallAgent(ctx, "upgrade", ImageTag, window...); err != nil {
		t.Fatal(err)
	}
	// The window reaches the plugin's conflist entry, and the snapshot the
	// plugin will decide by knows the namespaces as they are now.
	err := e.n.Poll(ctx, "plugin entry with the short window", func(context.Context) (bool, error) {
		pc, err := pluginConf(e.n)
		if err != nil {
			return false, err
		}
		if d, err := time.ParseDuration(pc.AgentDownAfter); err != nil || d != outageWindow {
			return false, fmt.Errorf("conflist agentDownAfter %q, want %s", pc.AgentDownAfter, outageWindow)
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	snapPath := e.n.Layout().Snapshot()
	err = e.n.Poll(ctx, "snapshot shows "+meshNS+" enabled", func(context.Context) (bool, error) {
		s, err := nodefiles.ReadSnapshot(snapPath)
		if err != nil {
			return false, err
		}
		if s.PodLevelEnablement {
			return false, errors.New("the snapshot shows pod-level enablement: every namespace would fail closed")
		}
		if !slices.Contains(s.EnabledNamespaces, meshNS) || slices.Contains(s.EnabledNamespaces, plainNS) || slices.Contains(s.EnabledNamespaces, lateNS) {
			return false, fmt.Errorf("snapshot enables %v", s.EnabledNamespaces)
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}

	fixed := e.crashloopAgent(t, window...)
	// The old agent is gone (its pod left the API once its container
	// stopped) and the new one never starts serving: its last sign of
	// life is final.
	lastAlive := e.lastAlive(t)
	t.Logf("the agent was last alive at %s", lastAlive.Format(time.RFC3339))

	mesh := e.create(t, meshNS, "waits")
	plain := e.create(t, plainNS, "starts")
	late := e.create(t, lateNS, "late")
	for _, p := range []*corev1.Pod{plain, late} {
		ready, err := e.n.WaitPodReady(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		*p = *ready
		t.Logf("%s/%s started at %s", p.Namespace, p.Name, containerStarted(p).Format(time.RFC3339))
		if ok, err := e.n.released(ctx, p); !ok {
			t.Errorf("%s/%s, started while the agent is gone: %v", p.Namespace, p.Name, err)
		}
	}
	adds, err := nodefiles.ListAdds(e.n.Layout().AddSpool())
	if err != nil {
		t.Fatal(err)
	}
	var recorded []string
	for _, a := range adds {
		if a.Event != nil {
			recorded = append(recorded, a.Event.PodUID)
		}
	}
	for _, p := range []*corev1.Pod{plain, late} {
		if !slices.Contains(recorded, string(p.UID)) {
			t.Errorf("%s/%s started without the agent but is not in the ADD spool (%v)", p.Namespace, p.Name, recorded)
		}
	}
	// Enabled while the agent is gone: only the returning agent can act
	// on it.
	if _, err := e.n.Client.CoreV1().Namespaces().Patch(ctx, lateNS, types.MergePatchType,
		fmt.Appendf(nil, `{"metadata":{"labels":{%q:%q}}}`, ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	// The pod to capture is refused, on the API server's word, and waits
	// for its sandbox.
	e.waitSandboxError(t, mesh, "the API server shows the pod must be captured")
	cur, err := e.n.Client.CoreV1().Pods(meshNS).Get(ctx, mesh.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !containerCreating(cur) {
		t.Errorf("%s/%s while the agent is gone: %s, want ContainerCreating", meshNS, mesh.Name, podSummary(cur))
	}

	// The fix.
	if err := fixed(); err != nil {
		t.Fatal(err)
	}
	ready, err := e.n.WaitPodReady(ctx, meshNS, mesh.Name)
	if err != nil {
		t.Fatal(err)
	}
	e.mustCaptured(t, ready)
	e.mustCaptured(t, late)
	err = e.n.Poll(ctx, "ADD spool re-checked", func(context.Context) (bool, error) {
		adds, err := nodefiles.ListAdds(e.n.Layout().AddSpool())
		if err != nil {
			return false, err
		}
		if len(adds) > 0 {
			return false, fmt.Errorf("%d entries left", len(adds))
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	if ok, err := e.n.released(ctx, plain); !ok {
		t.Errorf("%s/%s, re-checked in a namespace still outside the mesh: %v", plainNS, plain.Name, err)
	}
}

// helm upgrade with a nodeSelector this node lacks takes the agent off the
// node: that is an uninstall here, so the plugin leaves the conflist and
// new pods of every namespace start without it. Restoring the selector
// brings the agent back, which captures what it must.
func (e *e2e) testNodeSelectorExcludes(t *testing.T) {
	ctx := context.Background()
	suffix := randHex(4)
	meshNS, plainNS := "excl-mesh-"+suffix, "excl-plain-"+suffix
	e.namespace(t, meshNS, true)
	e.namespace(t, plainNS, false)
	restore := e.restoreChartOnFailure(t, nil)
	if err := e.n.InstallAgent(ctx, "upgrade", ImageTag, "--set-json", `nodeSelector={"ambient-cni.test/agent":"elsewhere"}`); err != nil {
		t.Fatal(err)
	}
	err := e.n.Poll(ctx, "agent off the node, plugin unchained", func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		if len(pods) > 0 {
			return false, fmt.Errorf("agent pod %s still there", pods[0].Name)
		}
		if err := pluginInstalled(e.n); err == nil {
			return false, errors.New("the plugin is still installed")
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if conf, err := os.ReadFile(e.n.CNIConfFile); err != nil || string(conf) != string(e.n.CNIConfOriginal) {
		t.Errorf("conflist with the agent off the node (%v):\n%s\nwant the original:\n%s", err, conf, e.n.CNIConfOriginal)
	}
	unmeshed := e.start(t, meshNS, "unmeshed", AppOptions{})
	e.start(t, plainNS, "plain", AppOptions{})
	if ok, err := e.n.releasedNoStandIn(ctx, unmeshed); !ok {
		t.Errorf("a pod started with the agent off the node: %v", err)
	}

	if err := restore(); err != nil {
		t.Fatal(err)
	}
	if err := e.n.Poll(ctx, "plugin chained again", func(context.Context) (bool, error) { return pluginInstalled(e.n) == nil, pluginInstalled(e.n) }); err != nil {
		t.Fatal(err)
	}
	e.mustCaptured(t, e.start(t, meshNS, "meshed", AppOptions{}))
	e.mustCaptured(t, unmeshed)
}

// A process on the host holds the agent's metrics port before the agent
// starts: the agent reports it and serves on, becoming ready without a
// restart, and pods start (captured where they must be).
func (e *e2e) testMetricsPortTaken(t *testing.T) {
	ctx := context.Background()
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	old := e.oneAgent(t)
	// Back to the chart's port, free again.
	restore := e.restoreChartOnFailure(t, func() { _ = ln.Close() })
	if err := e.n.UpgradeAgentNoWait(ctx, ImageTag, "--set", "agent.metricsPort="+strconv.Itoa(port)); err != nil {
		t.Fatal(err)
	}
	var agent corev1.Pod
	err = e.n.Poll(ctx, "agent ready with its metrics port taken", func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		if len(pods) != 1 || pods[0].Name == old.Name {
			return false, fmt.Errorf("%d agent pods, the old one %s may still be there", len(pods), old.Name)
		}
		agent = pods[0]
		if !isReady(&agent) {
			return false, fmt.Errorf("agent %s not ready: %s", agent.Name, podSummary(&agent))
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if env := containerEnv(&agent, "AMBIENT_METRICS_ADDR"); env != ":"+strconv.Itoa(port) {
		t.Fatalf("the agent's metrics address %q, want the taken port %d", env, port)
	}
	for _, cs := range agent.Status.ContainerStatuses {
		if cs.RestartCount > 0 {
			t.Errorf("the agent restarted %d times with its metrics port taken", cs.RestartCount)
		}
	}
	suffix := randHex(4)
	e.namespace(t, "mport-mesh-"+suffix, true)
	e.namespace(t, "mport-plain-"+suffix, false)
	e.mustCaptured(t, e.start(t, "mport-mesh-"+suffix, "meshed", AppOptions{}))
	e.start(t, "mport-plain-"+suffix, "plain", AppOptions{})
	err = e.n.Poll(ctx, "Warning event about the metrics port", func(ctx context.Context) (bool, error) {
		l, err := e.n.Client.CoreV1().Events("").List(ctx, metav1.ListOptions{FieldSelector: "type=Warning"})
		if err != nil {
			return false, err
		}
		for _, ev := range l.Items {
			if strings.Contains(ev.Message, strconv.Itoa(port)) {
				t.Logf("event %s %s/%s: %s", ev.Reason, ev.InvolvedObject.Kind, ev.InvolvedObject.Name, ev.Message)
				return true, nil
			}
		}
		return false, fmt.Errorf("no Warning event names port %d", port)
	})
	if err != nil {
		t.Error(err)
	}

	if err := restore(); err != nil {
		t.Fatal(err)
	}
	err = e.n.Poll(ctx, "metrics served again", func(ctx context.Context) (bool, error) {
		_, err := e.n.AgentGet(ctx, "/metrics")
		return err == nil, err
	})
	if err != nil {
		t.Error(err)
	}
}

// restoreChartOnFailure returns the step that puts the chart back to the
// node's values (after first, when set) and waits for the agent. A case
// that stops before calling it has it run at cleanup, so the cases after
// it find a working agent.
func (e *e2e) restoreChartOnFailure(t *testing.T, first func()) func() error {
	t.Helper()
	done := false
	restore := func() error {
		done = true
		if first != nil {
			first()
		}
		return e.n.InstallAgent(context.Background(), "upgrade", ImageTag)
	}
	t.Cleanup(func() {
		if !done {
			if err := restore(); err != nil {
				t.Errorf("restore the chart: %v", err)
			}
		}
	})
	return restore
}

// oneAgent returns the node's agent pod, which must be the only one.
func (e *e2e) oneAgent(t *testing.T) corev1.Pod {
	t.Helper()
	pods, err := e.n.AgentPods(context.Background())
	if err != nil || len(pods) != 1 {
		t.Fatalf("agent pods: %d, %v", len(pods), err)
	}
	return pods[0]
}

// freezeAgent stops the node's agent with SIGSTOP (it hangs, alive to
// its probes' connects, answering nothing) and returns what resumes it;
// the test's cleanup resumes it too, once.
func (e *e2e) freezeAgent(t *testing.T) (resume func()) {
	t.Helper()
	agent := e.oneAgent(t)
	pid := e.containerPID(t, agent.Namespace, agent.Name)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resumed := false
	resume = func() {
		if !resumed {
			resumed = true
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	t.Cleanup(resume)
	return resume
}

// lastAlive is the agent's last sign of life as the plugin reads it: the
// newer of its heartbeat and its snapshot's write time.
func (e *e2e) lastAlive(t *testing.T) time.Time {
	t.Helper()
	s, err := nodefiles.ReadSnapshot(e.n.Layout().Snapshot())
	if err != nil {
		t.Fatal(err)
	}
	last := s.Written
	if hb, err := nodefiles.LastAlive(e.n.Layout().Heartbeat()); err == nil && hb.After(last) {
		last = hb
	}
	return last
}

// create creates an app pod without waiting for it.
func (e *e2e) create(t *testing.T, ns, name string) *corev1.Pod {
	t.Helper()
	p, err := e.n.Client.CoreV1().Pods(ns).Create(context.Background(), e.n.AppPod(ns, name, AppOptions{}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitSandboxError waits for kubelet's report that a pod's sandbox failed
// with the plugin's error containing want.
func (e *e2e) waitSandboxError(t *testing.T, p *corev1.Pod, want string, more ...string) {
	t.Helper()
	err := e.n.Poll(context.Background(), p.Name+" refused by the plugin", func(ctx context.Context) (bool, error) {
		evs, err := e.n.PodEvents(ctx, p.Namespace, p.Name)
		if err != nil {
			return false, err
		}
		var seen []string
		for _, ev := range evs {
			if ev.Reason != "FailedCreatePodSandBox" {
				continue
			}
			if strings.Contains(ev.Message, "ambient-cni:") && strings.Contains(ev.Message, want) &&
				!slices.ContainsFunc(more, func(m string) bool { return !strings.Contains(ev.Message, m) }) {
				t.Logf("%s/%s: %s", p.Namespace, p.Name, ev.Message)
				return true, nil
			}
			seen = append(seen, ev.Message)
		}
		return false, fmt.Errorf("no sandbox failure saying %q; seen: %q", append([]string{want}, more...), seen)
	})
	if err != nil {
		// What the pod waits for instead: its state and every event.
		if cur, gerr := e.n.Client.CoreV1().Pods(p.Namespace).Get(context.Background(), p.Name, metav1.GetOptions{}); gerr == nil {
			t.Logf("%s/%s: %s", p.Namespace, p.Name, podSummary(cur))
		}
		if evs, eerr := e.n.PodEvents(context.Background(), p.Namespace, p.Name); eerr == nil {
			for _, ev := range evs {
				t.Logf("%s/%s event %s (x%d): %s", p.Namespace, p.Name, ev.Reason, ev.Count, ev.Message)
			}
		}
		t.Fatalf("%s/%s: %v", p.Namespace, p.Name, err)
	}
}

// pluginConf returns the plugin's entry in the node's conflist.
func pluginConf(n *Node) (ambient.PluginConf, error) {
	var conf struct {
		Plugins []json.RawMessage
	}
	b, err := os.ReadFile(n.CNIConfFile)
	if err != nil {
		return ambient.PluginConf{}, err
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return ambient.PluginConf{}, fmt.Errorf("conflist: %w", err)
	}
	for _, raw := range conf.Plugins {
		var typ struct{ Type string }
		if json.Unmarshal(raw, &typ) == nil && typ.Type == "ambient-cni" {
			var pc ambient.PluginConf
			err := json.Unmarshal(raw, &pc)
			return pc, err
		}
	}
	return ambient.PluginConf{}, errors.New("conflist does not chain ambient-cni")
}

func isReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// containerCreating is true while a pod's containers wait for its sandbox.
func containerCreating(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodPending || isReady(p) {
		return false
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.State.Waiting == nil || cs.State.Waiting.Reason != "ContainerCreating" {
			return false
		}
	}
	return true
}

// containerStarted is when a pod's first container last started.
func containerStarted(p *corev1.Pod) time.Time {
	for _, cs := range p.Status.ContainerStatuses {
		if r := cs.State.Running; r != nil {
			return r.StartedAt.Time
		}
	}
	return time.Time{}
}

func containerEnv(p *corev1.Pod, name string) string {
	for _, v := range p.Spec.Containers[0].Env {
		if v.Name == name {
			return v.Value
		}
	}
	return ""
}
