package kubectlplugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
)

var testAgent = Agent{Node: "node-1", Namespace: "istio-system", Pod: "ambient-cni-x7k2p"}

func renderFixture(t *testing.T, name string) string {
	t.Helper()
	var b bytes.Buffer
	if err := RenderPod(&b, PodAnswer{Agent: testAgent, Report: fixture(t, name)}); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s:\n%s", name, b.String())
	return b.String()
}

func mustContain(t *testing.T, out string, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !strings.Contains(out, l) {
			t.Errorf("output lacks %q", l)
		}
	}
}

func TestRenderCaptured(t *testing.T) {
	out := renderFixture(t, "captured.json")
	mustContain(t, out,
		"Pod:      demo/web (Running) on node node-1\n",
		"Agent:    istio-system/ambient-cni-x7k2p\n",
		"Verdict:  captured (namespace labelled ambient)\n",
		"Status:   OK\n",
		"  policy      to be captured: namespace labelled ambient (istio.io/dataplane-mode: namespace ambient)\n",
		"  agent       holds it: enabled, ztunnel acknowledged, captured at its start (CNI ADD), since 2026-11-30T13:16:05Z\n",
		"  rules       nftables, verified clean just now\n",
		"  verifier    proven at 2026-11-30T13:17:05Z\n",
		"  netns       found: held by the agent since it captured the pod\n",
		"  annotation  ambient.istio.io/redirection: enabled\n",
		"What to do:\n  - nothing: the pod is in the mesh\n")
	if strings.Contains(out, "Problems:") {
		t.Error("a captured pod with no problems lists problems")
	}
}

func TestRenderUncaptured(t *testing.T) {
	out := renderFixture(t, "uncaptured.json")
	mustContain(t, out,
		"Verdict:  not captured: neither pod nor namespace labelled ambient\n",
		"Status:   OK\n",
		"  agent       does not hold it\n",
		"  annotation  ambient.istio.io/redirection: absent\n",
		"  - to capture it, label its namespace (`kubectl label namespace plain istio.io/dataplane-mode=ambient`) or the pod\n")
}

func TestRenderFailing(t *testing.T) {
	out := renderFixture(t, "failing-sidecar.json")
	mustContain(t, out,
		"Pod:      demo/sidecar (Pending) on node node-1\n",
		"Verdict:  not captured: sidecar-injected pod\n",
		"Status:   NEEDS ATTENTION\n",
		"Problems:\n  - the pod was injected for istio-cni's sidecar mode",
		"run this sidecar pod where istio-cni runs")
	out = renderFixture(t, "drifted.json")
	mustContain(t, out,
		"Status:   NEEDS ATTENTION\n",
		"  agent       holds it: pending, ztunnel has not acknowledged, captured while running",
		"  rules       nftables, drifted: inet istio-ambient-nat output: missing nft rule #1",
		"  - check ztunnel on this node",
		"`kubectl -n istio-system delete pod ambient-cni-x7k2p`")
	out = renderFixture(t, "should-be-captured.json")
	mustContain(t, out,
		"Verdict:  NOT CAPTURED, but should be (namespace labelled ambient)\n",
		"  netns       found: found by a /proc scan just now",
		"`kubectl -n demo get events --field-selector involvedObject.name=late,reason=AmbientEnrollFailed`")
}

// A report no advice covers still says where to look.
func TestRenderUnknownProblem(t *testing.T) {
	raw := []byte(`{"pod":"a/b","verdict":"something new","ok":false,"problems":["a problem from a newer agent"],"policy":{"capture":true,"reason":"r"},"netns":{"found":false,"how":"h"},"annotation":""}`)
	var b bytes.Buffer
	if err := RenderPod(&b, PodAnswer{Agent: testAgent, Report: raw}); err != nil {
		t.Fatal(err)
	}
	mustContain(t, b.String(), "  - a problem from a newer agent\n", "see docs/troubleshooting.md and the agent's log (`kubectl -n istio-system logs ambient-cni-x7k2p`)")
}

func TestRenderNode(t *testing.T) {
	var b bytes.Buffer
	a := NodeAnswer{Agent: testAgent, Ready: true, Readiness: "ok", Report: fixture(t, "node.json")}
	if err := RenderNode(&b, a); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	t.Log("\n" + out)
	mustContain(t, out, "Node:     node-1\n", "Ready:    yes\n", "Rules:    nftables\n", "Ztunnel:  1 connected\n",
		"Pods:     5 on the node, 2 captured, 3 need attention\n",
		"  demo/api: captured (namespace labelled ambient)\n",
		"  - kubectl ambient-cni explain demo/sidecar\n")
	if strings.Contains(out, "explain demo/web") {
		t.Error("a pod without problems is listed")
	}
	b.Reset()
	a.Ready, a.Readiness = false, "plugin not installed\n"
	if err := RenderNode(&b, a); err != nil {
		t.Fatal(err)
	}
	mustContain(t, b.String(), "Ready:    NO: plugin not installed\n", "the agent is not ready")
}

func TestRenderJSON(t *testing.T) {
	var b bytes.Buffer
	if err := RenderJSON(&b, PodAnswer{Agent: testAgent, Report: fixture(t, "captured.json")}); err != nil {
		t.Fatal(err)
	}
	var back struct {
		Agent  Agent
		Report explainwire.Report
	}
	if err := json.Unmarshal(b.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if back.Agent != testAgent || back.Report.Verdict != "captured (namespace labelled ambient)" || !back.Report.OK {
		t.Errorf("round trip: %+v", back)
	}
}

// Answers that are not a report are refused (Explain and Status check the
// answer is one JSON object; rendering checks its fields), never half
// rendered.
func TestHostileAnswers(t *testing.T) {
	for _, raw := range []string{"", "null", "[]", "not json", `{"pod":`, `{"verdict": 1}`, `{"reports": 1}`, "\x00\xff", strings.Repeat("[", 1<<16)} {
		if checkJSON([]byte(raw)) == nil && RenderPod(io.Discard, PodAnswer{Report: json.RawMessage(raw)}) == nil {
			t.Errorf("%.40q: accepted as a pod report", raw)
		}
		if checkJSON([]byte(raw)) == nil && RenderNode(io.Discard, NodeAnswer{Report: json.RawMessage(raw)}) == nil && raw != `{"verdict": 1}` {
			t.Errorf("%.40q: accepted as a node report", raw)
		}
	}
	// A node report with a null entry renders.
	if err := RenderNode(io.Discard, NodeAnswer{Report: json.RawMessage(`{"pods":1,"reports":[null]}`)}); err != nil {
		t.Error(err)
	}
}

func TestLimited(t *testing.T) {
	l := &limited{max: 4}
	if n, err := l.Write([]byte("abcdef")); n != 6 || err != nil || l.String() != "abcd" || !l.over {
		t.Errorf("wrote %d %v %q over=%v", n, err, l.String(), l.over)
	}
	if n, _ := l.Write([]byte("g")); n != 1 || l.String() != "abcd" {
		t.Errorf("second write kept %q", l.String())
	}
}

func TestParseArgs(t *testing.T) {
	for _, c := range []struct {
		args []string
		want Options
	}{
		{[]string{"explain", "demo/web"}, Options{Verb: "explain", Target: "demo/web", Output: "text", AgentNamespace: "istio-system"}},
		{[]string{"explain", "demo/web", "-o", "json"}, Options{Verb: "explain", Target: "demo/web", Output: "json", AgentNamespace: "istio-system"}},
		{[]string{"--kubeconfig=k", "explain", "web", "-n", "demo", "--agent-namespace", "kube-system", "--context", "c"},
			Options{Verb: "explain", Target: "web", Output: "text", Namespace: "demo", AgentNamespace: "kube-system", Kubeconfig: "k", Context: "c"}},
		{[]string{"status", "node-1", "--output=json"}, Options{Verb: "status", Target: "node-1", Output: "json", AgentNamespace: "istio-system"}},
	} {
		got, err := ParseArgs(c.args, io.Discard)
		if err != nil || got != c.want {
			t.Errorf("%q: %+v %v, want %+v", c.args, got, err, c.want)
		}
	}
	for _, args := range [][]string{nil, {"explain"}, {"explain", "a/b", "c"}, {"delete", "a/b"}, {"status", "ns/pod"}, {"explain", "a/b", "-o", "yaml"}, {"explain", "a/b", "--bogus"}, {"explain", ""}} {
		if _, err := ParseArgs(args, io.Discard); err == nil {
			t.Errorf("%q: accepted", args)
		}
	}
	if _, err := ParseArgs([]string{}, io.Discard); !errors.Is(err, ErrUsage) {
		t.Errorf("no args: %v, want ErrUsage", err)
	}
}
