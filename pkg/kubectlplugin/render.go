package kubectlplugin

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
)

// advice is one rule of what to do: when matches the report, say do (with
// {ns} the pod's namespace, {pod} its name, {agentns} the agent's
// namespace, {agent} the agent's pod). Rules are matched in order; every match is said.
type advice struct {
	when func(r *explainwire.Report) bool
	do   string
}

func verdictHas(prefix string) func(*explainwire.Report) bool {
	return func(r *explainwire.Report) bool { return strings.HasPrefix(r.Verdict, prefix) }
}

func problemHas(s string) func(*explainwire.Report) bool {
	return func(r *explainwire.Report) bool {
		for _, p := range r.Problems {
			if strings.Contains(p, s) {
				return true
			}
		}
		return false
	}
}

func reasonIs(reason string) func(*explainwire.Report) bool {
	return func(r *explainwire.Report) bool {
		return !r.Policy.Capture && strings.HasPrefix(r.Verdict, "not captured: "+reason)
	}
}

// advices maps the agent's verdicts and problems (pkg/explain) to what an
// operator does next; docs/troubleshooting.md's table says the same.
var advices = []advice{
	{func(r *explainwire.Report) bool { return r.OK && strings.HasPrefix(r.Verdict, "captured (") }, "nothing: the pod is in the mesh"},
	{problemHas("ztunnel has not acknowledged"), "check ztunnel on this node (is it running and connected? `kubectl ambient-cni status` shows its connections); its log says why it refused the pod"},
	{problemHas("rules drifted"), "find what changed the pod's rules (another CNI, an operator); restarting the node's agent (`kubectl -n {agentns} delete pod {agent}`) or recreating the pod re-applies them"},
	{problemHas("could not be verified"), "read the agent's log: `kubectl -n {agentns} logs {agent}`"},
	{problemHas("verifier's last proof"), "read the agent's log: `kubectl -n {agentns} logs {agent}`"},
	{problemHas("istiod's view of the pod is stale"), "look for failed pod status patches in the agent's log: `kubectl -n {agentns} logs {agent}`"},
	{problemHas("network namespace is found"), "see why capturing failed: `kubectl -n {ns} get events --field-selector involvedObject.name={pod},reason=AmbientEnrollFailed` and the agent's log (`kubectl -n {agentns} logs {agent}`); the agent retries"},
	{problemHas("network namespace cannot be found"), "the agent cannot find the running pod's network namespace (docs/netns-discovery.md); recreating the pod captures it at its start"},
	{verdictHas("not captured yet"), "nothing: the pod is being set up and is captured before it starts"},
	{verdictHas("not captured: terminating"), "nothing: the pod is going away"},
	{verdictHas("captured, but should not be"), "nothing if it passes: the agent releases it; if it persists, the agent's log (`kubectl -n {agentns} logs {agent}`)"},
	{verdictHas("captured, but its pod object is gone"), "nothing if it passes: the agent releases it; if it persists, the agent's log (`kubectl -n {agentns} logs {agent}`)"},
	{reasonIs("neither pod nor namespace labelled ambient"), "to capture it, label its namespace (`kubectl label namespace {ns} istio.io/dataplane-mode=ambient`) or the pod"},
	{reasonIs("no enablement selector matches"), "to capture it, label its namespace or the pod to match one of the chart's ambient.enablementSelectors"},
	{reasonIs("namespace matches an enablement selector, the pod's labels do not"), "to capture it, label the pod to match the chart's ambient.enablementSelectors"},
	{reasonIs("pod labelled none"), "to capture it, remove its label: `kubectl -n {ns} label pod {pod} istio.io/dataplane-mode-`"},
	{reasonIs("hostNetwork pod"), "nothing: a hostNetwork pod shares the node's network and is never captured"},
	{reasonIs("namespace excluded"), "to capture it, take its namespace out of the chart's agent.excludedNamespaces"},
	{reasonIs("ztunnel or node-agent pod"), "nothing: the mesh's own data plane is never captured"},
	{reasonIs("pod phase is terminal"), "nothing: the pod has finished"},
	{problemHas("injected for istio-cni's sidecar mode"), "run this sidecar pod where istio-cni runs, or inject it with istio-init (pilot.cni.enabled=false): see docs/differences-from-istio.md"},
	{func(r *explainwire.Report) bool { return r.OK && reasonIs("sidecar-injected pod")(r) }, "nothing for ambient: sidecar pods are served by their sidecar, not captured"},
	{problemHas("is not a boolean"), "fix the pod's annotation (true or false)"},
	{problemHas("still holds an earlier pod of this name"), "nothing if it passes: the agent releases the earlier pod"},
	{problemHas("stale annotation"), "nothing if it passes: the agent clears it"},
	{problemHas("istiod believes it is captured"), "nothing if it passes; if it persists, the agent's log (`kubectl -n {agentns} logs {agent}`)"},
}

// whatToDo is the advice for a report; a report no rule covers that needs
// attention gets the troubleshooting guide and the agent's log.
func whatToDo(r *explainwire.Report, a Agent) []string {
	ns, name, _ := strings.Cut(r.Pod, "/")
	fill := strings.NewReplacer("{ns}", ns, "{pod}", name, "{agentns}", a.Namespace, "{agent}", a.Pod)
	var out []string
	for _, ad := range advices {
		if ad.when(r) {
			out = append(out, fill.Replace(ad.do))
		}
	}
	if len(out) == 0 {
		if r.OK {
			out = append(out, "nothing")
		} else {
			out = append(out, fmt.Sprintf("see docs/troubleshooting.md and the agent's log (`kubectl -n %s logs %s`)", a.Namespace, a.Pod))
		}
	}
	return out
}

// checks are the lines of what the agent checked.
func checks(r *explainwire.Report) [][2]string {
	var out [][2]string
	p := r.Policy
	pol := "not to be captured: " + p.Reason
	if p.Capture {
		pol = "to be captured: " + p.Reason
	}
	var labels []string
	if p.NamespaceLabel != "" {
		labels = append(labels, "namespace "+p.NamespaceLabel)
	}
	if p.PodLabel != "" {
		labels = append(labels, "pod "+p.PodLabel)
	}
	if len(labels) > 0 {
		pol += " (istio.io/dataplane-mode: " + strings.Join(labels, ", ") + ")"
	}
	if p.Selector > 0 {
		pol += fmt.Sprintf(" (enablement selector #%d)", p.Selector)
	}
	out = append(out, [2]string{"policy", pol})
	if p.Note != "" {
		out = append(out, [2]string{"", p.Note})
	}
	if c := r.Captured; c != nil {
		held := "holds it: " + c.State
		if c.ZtunnelAcked {
			held += ", ztunnel acknowledged"
		} else {
			held += ", ztunnel has not acknowledged"
		}
		if c.Via == "cni" {
			held += ", captured at its start (CNI ADD)"
		} else {
			held += ", captured while running"
		}
		if !c.Since.IsZero() {
			held += ", since " + c.Since.UTC().Format(time.RFC3339)
		}
		out = append(out, [2]string{"agent", held})
		rules := c.Rules.Backend
		if rules != "" {
			rules += ", "
		}
		switch {
		case c.Rules.Error != "":
			rules += "could not be verified: " + c.Rules.Error
		case !c.Rules.Clean:
			rules += "drifted: " + strings.Join(c.Rules.Drift, "; ")
		default:
			rules += "verified clean just now"
		}
		out = append(out, [2]string{"rules", rules})
		if v := c.Verification; v != nil {
			proof := "proven at " + v.At.UTC().Format(time.RFC3339)
			if !v.Proven {
				proof = "not proven at " + v.At.UTC().Format(time.RFC3339) + ": " + v.Problem
			}
			out = append(out, [2]string{"verifier", proof})
		}
	} else {
		out = append(out, [2]string{"agent", "does not hold it"})
	}
	ns := "not found: " + r.Netns.How
	if strings.HasPrefix(r.Netns.How, "not ") {
		ns = r.Netns.How
	}
	if r.Netns.Found {
		ns = "found: " + r.Netns.How
	}
	out = append(out, [2]string{"netns", ns})
	ann := "absent"
	if r.Annotation != "" {
		ann = r.Annotation
	}
	out = append(out, [2]string{"annotation", "ambient.istio.io/redirection: " + ann})
	return out
}

// RenderPod writes the human answer to `explain NS/POD`.
func RenderPod(w io.Writer, a PodAnswer) error {
	var r explainwire.Report
	if err := json.Unmarshal(a.Report, &r); err != nil {
		return fmt.Errorf("read the agent's report: %w", err)
	}
	if r.Pod == "" || r.Verdict == "" {
		return fmt.Errorf("the agent's answer is not a pod report (no pod or verdict)")
	}
	return renderReport(w, &r, a.Agent)
}

func renderReport(w io.Writer, r *explainwire.Report, a Agent) error {
	b := &strings.Builder{}
	fmt.Fprintf(b, "Pod:      %s", r.Pod)
	if r.Phase != "" {
		fmt.Fprintf(b, " (%s", r.Phase)
		if r.Terminating {
			b.WriteString(", terminating")
		}
		b.WriteString(")")
	}
	fmt.Fprintf(b, " on node %s\nAgent:    %s/%s\n", a.Node, a.Namespace, a.Pod)
	fmt.Fprintf(b, "Verdict:  %s\n", r.Verdict)
	if r.OK {
		b.WriteString("Status:   OK\n")
	} else {
		b.WriteString("Status:   NEEDS ATTENTION\n")
	}
	b.WriteString("Checked:\n")
	for _, c := range checks(r) {
		fmt.Fprintf(b, "  %-11s %s\n", c[0], c[1])
	}
	if len(r.Problems) > 0 {
		b.WriteString("Problems:\n")
		for _, p := range r.Problems {
			fmt.Fprintf(b, "  - %s\n", p)
		}
	}
	b.WriteString("What to do:\n")
	for _, d := range whatToDo(r, a) {
		fmt.Fprintf(b, "  - %s\n", d)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// RenderNode writes the human answer to `status NODE`.
func RenderNode(w io.Writer, a NodeAnswer) error {
	var nr explainwire.NodeReport
	if err := json.Unmarshal(a.Report, &nr); err != nil {
		return fmt.Errorf("read the agent's report: %w", err)
	}
	b := &strings.Builder{}
	fmt.Fprintf(b, "Node:     %s\nAgent:    %s/%s\n", a.Agent.Node, a.Agent.Namespace, a.Agent.Pod)
	if a.Ready {
		b.WriteString("Ready:    yes\n")
	} else {
		fmt.Fprintf(b, "Ready:    NO: %s\n", strings.TrimSpace(a.Readiness))
	}
	if nr.RulesBackend != "" {
		fmt.Fprintf(b, "Rules:    %s\n", nr.RulesBackend)
	}
	if nr.ZtunnelConnections != nil {
		fmt.Fprintf(b, "Ztunnel:  %d connected\n", *nr.ZtunnelConnections)
	}
	if nr.ReleaseSignal != "" {
		fmt.Fprintf(b, "Release signal: %s\n", nr.ReleaseSignal)
	}
	fmt.Fprintf(b, "Pods:     %d on the node, %d captured, %d need attention\n", nr.Pods, nr.Captured, nr.WithProblems)
	var bad []*explainwire.Report
	for _, r := range nr.Reports {
		if r != nil && !r.OK {
			bad = append(bad, r)
		}
	}
	if len(bad) > 0 {
		b.WriteString("Need attention:\n")
		for _, r := range bad {
			fmt.Fprintf(b, "  %s: %s\n", r.Pod, r.Verdict)
			for _, p := range r.Problems {
				fmt.Fprintf(b, "    - %s\n", p)
			}
		}
	}
	b.WriteString("What to do:\n")
	switch {
	case !a.Ready:
		fmt.Fprintf(b, "  - the agent is not ready: new pods that must be captured wait for it; read its log (`kubectl -n %s logs %s`)\n", a.Agent.Namespace, a.Agent.Pod)
	case nr.ZtunnelConnections != nil && *nr.ZtunnelConnections == 0 && nr.Captured > 0:
		b.WriteString("  - no ztunnel is connected while pods are captured: check ztunnel on this node\n")
	}
	if len(bad) > 0 {
		for _, r := range bad {
			fmt.Fprintf(b, "  - kubectl ambient-cni explain %s\n", r.Pod)
		}
	} else if a.Ready {
		b.WriteString("  - nothing\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// RenderJSON writes v indented, for -o json.
func RenderJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
