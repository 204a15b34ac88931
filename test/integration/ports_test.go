package integration

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
)

// TestMetricsPortTaken: another process on the node holds the metrics
// port (in the host network, a hostNetwork pod can). The agent still
// becomes ready and serves ADDs; the taken port is a Warning Event on the
// agent's pod; once the port is free, /metrics is served without a
// restart.
func TestMetricsPortTaken(t *testing.T) {
	holder, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	addr := holder.Addr().String()
	n := newNode(t, nodeOptions{MetricsAddr: addr})

	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "web", nil, nil))
	n.waitEnrolled(waitLong, p)
	if code, body := n.get("/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz with the metrics port taken = %d %s", code, body)
	}

	ev := n.agentEvent("MetricsUnavailable")
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, addr) || ev.InvolvedObject.Kind != "Pod" {
		t.Errorf("event %s %s about %+v: %q; want a Warning on the agent's pod naming %s", ev.Type, ev.Reason, ev.InvolvedObject, ev.Message, addr)
	}
	t.Logf("event: %s %s: %s", ev.Type, ev.Reason, ev.Message)
	logged := false
	for _, l := range n.logs.warningsSince(0) {
		logged = logged || (strings.Contains(l, "level=ERROR") && strings.Contains(l, "metrics unavailable"))
	}
	if !logged {
		t.Error("the taken metrics port is not an error in the agent's log")
	}

	// The port is freed: the agent binds it on its own.
	_ = holder.Close()
	if got := n.metricsAddress(); got != addr {
		t.Fatalf("/metrics bound on %s, want %s", got, addr)
	}
	if code, _ := n.getFrom(addr, "/metrics"); code != http.StatusOK {
		t.Fatalf("/metrics once the port is free: HTTP %d", code)
	}
}

// TestProbeCommand: install-cni probe, what the chart's exec probes run,
// answers from the debug socket: live and ready succeed on a ready agent,
// a missing agent is a failure, and a wrong argument is refused.
func TestProbeCommand(t *testing.T) {
	n := newNode(t, nodeOptions{})
	env := func(string) string { return "" }
	for _, which := range []string{"live", "ready"} {
		var out bytes.Buffer
		if err := installcni.ProbeMain([]string{"--agent-socket=" + n.cfg.AgentSocket, which}, env, &out, io.Discard); err != nil {
			t.Errorf("install-cni probe %s: %v (%s)", which, err, out.String())
		}
	}
	// The environment the chart's container has finds the socket too.
	sockEnv := func(k string) string {
		if k == installcni.EnvName("agent-socket") {
			return n.cfg.AgentSocket
		}
		return ""
	}
	if err := installcni.ProbeMain([]string{"ready"}, sockEnv, io.Discard, io.Discard); err != nil {
		t.Errorf("install-cni probe ready with the socket from the environment: %v", err)
	}
	if err := installcni.ProbeMain([]string{"--agent-socket=" + n.dir + "/nowhere/agent.sock", "live"}, env, io.Discard, io.Discard); err == nil {
		t.Error("install-cni probe live succeeded with no agent behind the socket")
	}
	if err := installcni.ProbeMain([]string{"--agent-socket=" + n.cfg.AgentSocket, "sideways"}, env, io.Discard, io.Discard); err == nil {
		t.Error("install-cni probe sideways was accepted")
	}
}
