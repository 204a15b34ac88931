package kubectlplugin

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
)

var update = flag.Bool("update", false, "rewrite testdata/ from the explain report's wire types")

// The fixtures are the explain report's wire types marshalled: the agent's
// JSON as it prints it. go test -run TestFixtures -update rewrites them.
func fixtures() map[string]any {
	since := time.Date(2026, 11, 30, 13, 16, 5, 0, time.UTC)
	captured := &explainwire.Report{
		Pod: "demo/web", UID: "0e3f3763-c01b-4751-97ea-b20cc73313f0", Phase: "Running", IPs: []string{"10.244.0.7"},
		Verdict: "captured (" + string(enablement.ReasonNamespaceLabel) + ")", OK: true,
		Policy: explainwire.Policy{Capture: true, Reason: string(enablement.ReasonNamespaceLabel), NamespaceLabel: "ambient"},
		Captured: &explainwire.Capture{
			State: "enabled", ZtunnelAcked: true, Via: "cni", SandboxID: "5d1c0ffee", Since: since,
			Rules:        explainwire.Rules{Backend: "nftables", Clean: true, DNSCapture: true, InboundCapture: true},
			Verification: &explainwire.Verification{At: since.Add(time.Minute), Proven: true},
		},
		Netns:      explainwire.Netns{Found: true, How: "held by the agent since it captured the pod", Path: "/var/run/netns/cni-1234", Inode: 4026532531},
		Annotation: "enabled",
	}
	uncaptured := &explainwire.Report{
		Pod: "plain/web", UID: "7a1d0c55-2f1e-4d0b-9a43-6a2c1d1c9e01", Phase: "Running", IPs: []string{"10.244.0.8"},
		Verdict: "not captured: " + string(enablement.ReasonNotEnabled), OK: true,
		Policy: explainwire.Policy{Reason: string(enablement.ReasonNotEnabled)},
		Netns:  explainwire.Netns{How: "not looked for: the pod is not to be captured"},
	}
	sidecarPod := &corev1.Pod{Spec: corev1.PodSpec{InitContainers: []corev1.Container{{Name: ambient.IstioValidationInitContainer}}}}
	failing := &explainwire.Report{
		Pod: "demo/sidecar", UID: "c3a7e1f0-8d9b-4e1c-b2a5-0f6e7d8c9b10", Phase: "Pending", IPs: []string{"10.244.0.9"},
		Verdict: "not captured: " + string(enablement.ReasonSidecar), OK: false,
		Problems: []string{enablement.IstioCNIExpected(sidecarPod)},
		Policy:   explainwire.Policy{Reason: string(enablement.ReasonSidecar), NamespaceLabel: "ambient"},
		Netns:    explainwire.Netns{How: "not looked for: the pod is not to be captured"},
	}
	drift := "inet istio-ambient-nat output: missing nft rule #1 \"ip daddr 169.254.7.127 meta l4proto tcp return\""
	drifted := &explainwire.Report{
		Pod: "demo/api", UID: "1b2c3d4e-5f60-4718-8293-a4b5c6d7e8f9", Phase: "Running", IPs: []string{"10.244.0.10"},
		Verdict: "captured (" + string(enablement.ReasonNamespaceLabel) + ")", OK: false,
		Problems: []string{
			"ztunnel has not acknowledged the pod (state pending): its traffic is redirected but no ztunnel serves it; the agent retries (is ztunnel running on this node?)",
			"the pod's rules drifted from what the agent applied: " + drift,
		},
		Policy: explainwire.Policy{Capture: true, Reason: string(enablement.ReasonNamespaceLabel), NamespaceLabel: "ambient"},
		Captured: &explainwire.Capture{
			State: "pending", Via: "controller", Since: since,
			Rules: explainwire.Rules{Backend: "nftables", Drift: []string{drift}, DNSCapture: true, InboundCapture: true},
		},
		Netns:      explainwire.Netns{Found: true, How: "held by the agent since it captured the pod", Path: "/host/proc/14049/ns/net", Inode: 4026532600},
		Annotation: "pending",
	}
	shouldBe := &explainwire.Report{
		Pod: "demo/late", UID: "9f8e7d6c-5b4a-4392-8170-6e5d4c3b2a19", Phase: "Running", IPs: []string{"10.244.0.11"},
		Verdict: "NOT CAPTURED, but should be (" + string(enablement.ReasonNamespaceLabel) + ")", OK: false,
		Problems: []string{"its network namespace is found, but the agent does not hold the pod: the pod controller retries (see the pod's events, reason AmbientEnrollFailed, and the agent's log)"},
		Policy:   explainwire.Policy{Capture: true, Reason: string(enablement.ReasonNamespaceLabel), NamespaceLabel: "ambient"},
		Netns:    explainwire.Netns{Found: true, How: "found by a /proc scan just now (a process of the pod in a namespace holding its IP)", Path: "/host/proc/15000/ns/net", Inode: 4026532700},
	}
	one := 1
	node := &explainwire.NodeReport{
		RulesBackend: "nftables", ZtunnelConnections: &one, ReleaseSignal: "present",
		Pods: 5, Captured: 2, WithProblems: 3,
		Reports: []*explainwire.Report{drifted, shouldBe, failing, uncaptured, captured},
	}
	return map[string]any{
		"captured.json": captured, "uncaptured.json": uncaptured, "failing-sidecar.json": failing,
		"drifted.json": drifted, "should-be-captured.json": shouldBe, "node.json": node,
	}
}

func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFixtures(t *testing.T) {
	for name, v := range fixtures() {
		want, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, '\n')
		path := filepath.Join("testdata", name)
		if *update {
			if err := os.WriteFile(path, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if got := fixture(t, name); !bytes.Equal(got, want) {
			t.Errorf("%s is not what the explain report's wire types marshal today; go test -run TestFixtures -update\ngot:\n%s\nwant:\n%s", path, got, want)
		}
	}
}
