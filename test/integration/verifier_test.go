package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// testVerifyPeriod is the verifier's period in these tests: short, so a
// tamper is found within a test's wait rather than a minute later.
// TestVerifierShippedPeriod pins the shipped default.
const testVerifyPeriod = 2 * time.Second

// gauge reads a prometheus gauge.
func gauge(t testing.TB, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// proofAfter waits for the verifier's first proof of p begun after t0.
func (n *node) proofAfter(p *kubesim.Pod, t0 time.Time) verifier.Proof {
	n.t.Helper()
	var proof verifier.Proof
	poll.Within(n.t, waitLong, "a proof of "+p.Obj.Name+" begun after "+t0.Format(time.StampMilli), func() bool {
		got, ok := n.d.Verifier().Last(p.Obj.UID)
		proof = got
		return ok && got.At.After(t0)
	})
	return proof
}

// driftEvents lists the verifier's Warning Events on p.
func (n *node) driftEvents(p *kubesim.Pod) []string {
	n.t.Helper()
	list, err := n.env.Client.CoreV1().Events(p.Obj.Namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.name=" + p.Obj.Name + ",reason=" + verifier.ReasonDrift,
	})
	if err != nil {
		n.t.Fatal(err)
	}
	var out []string
	for _, e := range list.Items {
		if e.Type == corev1.EventTypeWarning && e.InvolvedObject.UID == p.Obj.UID {
			out = append(out, e.Message)
		}
	}
	return out
}

// flushPodRules removes every rule of the agent's backend from the pod's
// netns from the host, as another tool flushing the tables would.
func (n *node) flushPodRules(p *kubesim.Pod) {
	n.t.Helper()
	if n.rules.Name == nftablesBackend {
		n.inNetns(p.NS.Path(), "nft", "flush", "ruleset")
		return
	}
	f := n.iptablesFlavour(n.rules.Name)
	for _, fam := range []ruleset.Family{ruleset.IPv4, ruleset.IPv6} {
		for _, table := range []string{"nat", "mangle"} {
			n.inNetns(p.NS.Path(), f.Cmd(fam), "-t", table, "-F")
		}
	}
}

// podRulesClean reports whether the pod's rules are exactly the agent's.
func (n *node) podRulesClean(p *kubesim.Pod) bool {
	n.t.Helper()
	want := ruleset.PodConfig{ProbeSNATv4: n.cfg.ProbeSNATv4, ProbeSNATv6: n.cfg.ProbeSNATv6, DNSCapture: n.cfg.DNSCapture, IPv4Only: !n.cfg.IPv6}
	d, err := n.rules.Rules.Verify(p.NS.Path(), want)
	return err == nil && d.Empty()
}

// TestVerifierRepairsTampering: each way a captured pod silently drops out
// of the mesh behind the agent's back (its rules flushed from the host,
// ztunnel losing its listeners, its probe-set entry deleted, its
// annotation changed) is found by the pod's next proof (so within one
// period), repaired, and reported: a Warning Event on the pod, the drift
// counter of its kind, and explain's verification; the unproven gauge
// returns to 0, and the other pod is left alone.
func TestVerifierRepairsTampering(t *testing.T) {
	n, v, a, b := twoProvenPods(t)
	if g := gauge(t, n.metrics.PodsUnproven); g != 0 {
		t.Fatalf("unproven gauge %v on a healthy node", g)
	}

	for _, c := range []struct {
		kind     verifier.Kind
		tamper   func()
		repaired func() bool
	}{
		{verifier.KindRules, func() { n.flushPodRules(a) }, func() bool { return n.podRulesClean(a) }},
		{verifier.KindZtunnel, func() {
			if !n.zt.CloseListeners(string(a.Obj.UID)) {
				t.Fatal("the stand-in does not serve pod a")
			}
		}, func() bool {
			return listening(a, ambient.ZtunnelOutboundPort) && listening(a, ambient.ZtunnelInboundPlaintextPort) && listening(a, ambient.ZtunnelInboundHBONEPort)
		}},
		{verifier.KindProbeSet, func() {
			if err := n.rules.Probe.DelIP(a.Addr(4)); err != nil {
				t.Fatal(err)
			}
		}, func() bool { return n.inProbeSet(a) }},
		{verifier.KindAnnotation, func() {
			patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"disabled"}}}`, ambient.RedirectionAnnotation)
			if _, err := n.env.Client.CoreV1().Pods(a.Obj.Namespace).Patch(context.Background(), "a", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				t.Fatal(err)
			}
		}, func() bool { return n.annotation(a) == ambient.RedirectionEnabled }},
	} {
		t.Run(string(c.kind), func(t *testing.T) {
			counted := counter(t, n.metrics.VerifyDrift.WithLabelValues(string(c.kind)))
			events := len(n.driftEvents(a))
			bProof, _ := v.Last(b.Obj.UID)
			tampered := time.Now()
			c.tamper()
			tamperedAt := time.Now()
			// The first proof begun after the tamper found it: drift is
			// found within one period.
			proof := n.proofAfter(a, tamperedAt)
			t.Logf("%s drift found %v after the tamper (period %v): %+v", c.kind, proof.At.Sub(tampered).Round(time.Millisecond), testVerifyPeriod, proof)
			if !slices.ContainsFunc(proof.Found, func(f verifier.Finding) bool { return f.Kind == c.kind }) {
				t.Fatalf("the first proof after the tamper did not find %s drift: %+v", c.kind, proof)
			}
			if !proof.OK || !proof.Repaired {
				t.Errorf("not repaired: %+v", proof)
			}
			poll.Within(t, waitLong, "the pod repaired", c.repaired)
			if got := counter(t, n.metrics.VerifyDrift.WithLabelValues(string(c.kind))); got != counted+1 {
				t.Errorf("ambient_cni_verify_drift_total{kind=%q} = %v, want %v", c.kind, got, counted+1)
			}
			var msgs []string
			poll.Within(t, waitLong, "a Warning Event on the pod naming the drift", func() bool {
				msgs = n.driftEvents(a)
				return len(msgs) > events && slices.ContainsFunc(msgs, func(m string) bool { return strings.Contains(m, string(c.kind)+":") })
			})
			r := n.explain(a.Obj.Namespace, "a")
			if r.Captured == nil || r.Captured.Verification == nil || r.Captured.Verification.LastDriftAt == nil ||
				!slices.ContainsFunc(r.Captured.Verification.LastDrift, func(s string) bool { return strings.HasPrefix(s, string(c.kind)+":") }) {
				t.Errorf("explain does not show the drift: %+v", r.Captured)
			}
			poll.Within(t, waitLong, "the unproven gauge back at 0", func() bool { return gauge(t, n.metrics.PodsUnproven) == 0 })
			mustGet(t, b, a)
			n.requireTunneled(b, a)
			if p, _ := v.Last(b.Obj.UID); p.LastDriftAt != bProof.LastDriftAt || !p.OK {
				t.Errorf("pod b, untouched, was found drifted: %+v", p)
			}
		})
	}
}

// TestVerifierRepairThatDoesNotHold: ztunnel loses one pod's listeners
// for good (it acks the repair's Del and Add and never listens in the pod
// again: its rules redirect into ports nobody listens on). Every proof
// finds it and tries again, and the pod stays unproven: the gauge holds
// at 1 proof after proof, never back at 0, so the critical alert fires.
// Once ztunnel listens again, the next repair holds and the gauge is 0;
// the other pod is left alone throughout.
func TestVerifierRepairThatDoesNotHold(t *testing.T) {
	n, v, a, b := twoProvenPods(t)
	drifts := n.metrics.VerifyDrift.WithLabelValues(string(verifier.KindZtunnel))
	counted := counter(t, drifts)
	uid := string(a.Obj.UID)
	n.zt.SetFaults(ztunnel.Faults{Deaf: func(u string) bool { return u == uid }})
	if !n.zt.CloseListeners(uid) {
		t.Fatal("the stand-in does not serve pod a")
	}
	tampered := time.Now()
	proof := n.proofAfter(a, tampered)
	if proof.OK || proof.Repaired || !slices.ContainsFunc(proof.Found, func(f verifier.Finding) bool { return f.Kind == verifier.KindZtunnel }) ||
		!strings.Contains(proof.Problem, "ztunnel: ztunnel is not listening on") {
		t.Fatalf("the first proof after the listeners went: %+v, want ztunnel drift found and the pod unproven", proof)
	}
	// Two more proofs, each finding it and repairing in vain; the gauge
	// sampled all along never leaves 1.
	var low []float64
	poll.Within(t, waitLong, "two more failed repairs of pod a", func() bool {
		if g := gauge(t, n.metrics.PodsUnproven); g != 1 {
			low = append(low, g)
		}
		return counter(t, drifts) >= counted+3
	})
	if len(low) > 0 {
		t.Fatalf("unproven gauge left 1 while pod a stayed unproven: %v", low)
	}
	if p, _ := v.Last(a.Obj.UID); p.OK || p.Repaired || p.Problem == "" {
		t.Fatalf("pod a after failed repairs: %+v", p)
	}
	for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
		if listening(a, port) {
			t.Fatalf("pod a has a listener on %d: the stand-in is not deaf to it", port)
		}
	}
	n.zt.SetFaults(ztunnel.Faults{})
	poll.Within(t, waitLong, "pod a proven after a repair that holds", func() bool {
		p, _ := v.Last(a.Obj.UID)
		return p.OK && gauge(t, n.metrics.PodsUnproven) == 0
	})
	mustGet(t, b, a)
	n.requireTunneled(b, a)
	if p, _ := v.Last(b.Obj.UID); !p.OK || !p.LastDriftAt.IsZero() {
		t.Errorf("pod b, untouched, was found drifted: %+v", p)
	}
}

// TestVerifierCapturesPodNeverGivenToAgent: a pod of an enabled namespace
// whose sandbox came up without our plugin (a missed ADD: the plugin was
// not chained) is found and captured, and the unproven gauge ends at 0.
func TestVerifierCapturesPodNeverGivenToAgent(t *testing.T) {
	n := newNode(t, nodeOptions{VerifyPeriod: testVerifyPeriod})
	shop := n.namespace("shop", ambientLabel)
	// The runtime as it runs while our plugin is not chained.
	bare := kubesim.NewNode(t, n.env.Client, n.Name, []string{n.binDir}, n.unchainedConf())
	p, err := bare.Run(context.Background(), podSpec(shop, "missed", nil, nil))
	if err != nil {
		t.Fatal(err)
	}
	serveApp(t, p)
	n.waitEnrolled(waitLong, p)
	if !n.podRulesClean(p) || !n.inProbeSet(p) {
		t.Fatal("the missed pod is enrolled without its rules or probe-set entry")
	}
	poll.Within(t, waitLong, "the missed pod proven", func() bool {
		proof, ok := n.d.Verifier().Last(p.Obj.UID)
		return ok && proof.OK
	})
	poll.Within(t, waitLong, "the unproven gauge at 0", func() bool { return gauge(t, n.metrics.PodsUnproven) == 0 })
}

// unchainedConf is the node's primary conflist without our entry, as the
// runtime reads it while our plugin is not chained (a primary CNI that
// rewrote its config at boot, before the agent put the entry back).
func (n *node) unchainedConf() []byte {
	n.t.Helper()
	conf, err := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf))
	if err != nil {
		n.t.Fatal(err)
	}
	var list map[string]any
	if err := json.Unmarshal(conf, &list); err != nil {
		n.t.Fatal(err)
	}
	plugins := list["plugins"].([]any)
	list["plugins"] = slices.DeleteFunc(slices.Clone(plugins), func(p any) bool { return p.(map[string]any)["type"] == cnibin.PluginName })
	if len(list["plugins"].([]any)) == len(plugins) {
		n.t.Fatalf("the conflist does not name our plugin:\n%s", conf)
	}
	out, err := json.Marshal(list)
	if err != nil {
		n.t.Fatal(err)
	}
	return out
}

// TestVerifierFindsSandboxRecreatedUnchained: a captured pod whose sandbox
// the runtime recreates while our plugin is not chained (no DEL, no ADD
// reach the agent, and the pod's status change is nothing the controller
// acts on for a pod it holds) is found by its next proof, captured in its
// new network namespace (rules, ztunnel, probe set) and reported.
func TestVerifierFindsSandboxRecreatedUnchained(t *testing.T) {
	n := newNode(t, nodeOptions{VerifyPeriod: testVerifyPeriod})
	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "web", nil, nil))
	client := n.runPod(podSpec(shop, "client", nil, nil))
	n.waitEnrolled(waitLong, p, client)
	oldIP := p.Addr(4)

	chained := n.kube.Conf
	unchained, err := libcni.ConfListFromBytes(n.unchainedConf())
	if err != nil {
		t.Fatal(err)
	}
	n.kube.Conf = unchained
	recreated := time.Now()
	if err := n.kube.Teardown(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	np, err := n.kube.Start(context.Background(), p.Obj)
	n.kube.Conf = chained
	if err != nil {
		t.Fatal(err)
	}
	serveApp(t, np)
	t.Logf("sandbox recreated unchained: %v -> %v", oldIP, np.Addr(4))
	if n.podRulesClean(np) {
		t.Fatal("the new sandbox has our rules although the plugin was not chained")
	}

	proof := n.proofAfter(np, recreated)
	if !slices.ContainsFunc(proof.Found, func(f verifier.Finding) bool { return f.Kind == verifier.KindSandbox }) {
		// The pod's status may have reached the cache after the proof
		// began; the next one finds it.
		proof = n.proofAfter(np, time.Now())
	}
	if !slices.ContainsFunc(proof.Found, func(f verifier.Finding) bool { return f.Kind == verifier.KindSandbox }) || !proof.OK {
		t.Fatalf("recreated sandbox not found and captured: %+v", proof)
	}
	if !n.podRulesClean(np) || !n.inProbeSet(np) {
		t.Fatal("the new sandbox is not captured")
	}
	n.waitStandIn(func() bool {
		w, ok := n.zt.Workload(string(np.Obj.UID))
		return ok && slices.Contains(w.IPs, np.Addr(4))
	}, "the stand-in serving the new sandbox")
	mustGet(t, client, np)
	n.requireTunneled(client, np)
	if got := counter(t, n.metrics.VerifyDrift.WithLabelValues(string(verifier.KindSandbox))); got != 1 {
		t.Errorf("sandbox drift counted %v times, want 1", got)
	}
	poll.Within(t, waitLong, "a Warning Event naming the recreated sandbox", func() bool {
		return slices.ContainsFunc(n.driftEvents(np), func(m string) bool { return strings.Contains(m, "sandbox:") })
	})
	poll.Within(t, waitLong, "the unproven gauge at 0", func() bool { return gauge(t, n.metrics.PodsUnproven) == 0 })
}

// TestVerifierCapturesPodReleasedByLateDel: a captured pod's sandbox is
// recreated while our plugin is not chained, and the runtime's repeated
// DEL of the old sandbox reaches the agent once the plugin is chained
// again, after the pod's new IPs were seen: the agent releases the pod
// and nothing else will bring it back (no ADD came, no pod event
// follows). The verifier finds the pod uncaptured under IPs its released
// sandbox never had and it is captured in its new network namespace.
func TestVerifierCapturesPodReleasedByLateDel(t *testing.T) {
	n := newNode(t, nodeOptions{VerifyPeriod: testVerifyPeriod})
	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "web", nil, nil))
	client := n.runPod(podSpec(shop, "client", nil, nil))
	n.waitEnrolled(waitLong, p, client)

	ctx := context.Background()
	chained := n.kube.Conf
	unchained, err := libcni.ConfListFromBytes(n.unchainedConf())
	if err != nil {
		t.Fatal(err)
	}
	n.kube.Conf = unchained
	if err := n.kube.Teardown(ctx, p); err != nil {
		t.Fatal(err)
	}
	np, err := n.kube.Start(ctx, p.Obj)
	n.kube.Conf = chained
	if err != nil {
		t.Fatal(err)
	}
	serveApp(t, np)
	// The agent's pod cache (which explain reads) has the new IP, so the
	// controller has seen the status change while it still held the pod.
	poll.Within(t, waitLong, "the agent's pod cache showing the new sandbox's IP", func() bool {
		return slices.Contains(n.explain(shop, "web").IPs, np.Addr(4).String())
	})
	if err := n.kube.DelAgain(ctx, p); err != nil {
		t.Fatal(err)
	}
	if n.d.Agent().SandboxReleased(p.Obj.UID) {
		t.Logf("the late DEL released the pod (%v -> %v)", p.Addr(4), np.Addr(4))
	} else {
		// The verifier moved the pod to its new sandbox first: the DEL
		// then names nothing the agent holds.
		t.Logf("the verifier had captured the new sandbox before the late DEL")
	}
	poll.Within(t, waitLong, "the new sandbox captured", func() bool {
		proof, ok := n.d.Verifier().Last(np.Obj.UID)
		return ok && proof.OK && n.podRulesClean(np) && n.inProbeSet(np)
	})
	n.waitStandIn(func() bool {
		w, ok := n.zt.Workload(string(np.Obj.UID))
		return ok && slices.Contains(w.IPs, np.Addr(4))
	}, "the stand-in serving the new sandbox")
	mustGet(t, client, np)
	n.requireTunneled(client, np)
	poll.Within(t, waitLong, "the unproven gauge at 0", func() bool { return gauge(t, n.metrics.PodsUnproven) == 0 })
}

// TestVerifierNoAPIRequestsWhenNothingDrifted: proving a healthy node's
// pods reads the pod cache only; the agent's client sends no request
// over several verifier rounds.
func TestVerifierNoAPIRequestsWhenNothingDrifted(t *testing.T) {
	n := newNode(t, nodeOptions{VerifyPeriod: testVerifyPeriod})
	shop := n.namespace("shop", ambientLabel)
	pods := []*kubesim.Pod{n.runPod(podSpec(shop, "a", nil, nil)), n.runPod(podSpec(shop, "b", nil, nil)), n.runPod(podSpec(shop, "c", nil, nil))}
	n.waitEnrolled(waitLong, pods...)
	// Settled: every pod proven once after its annotation was written.
	settled := time.Now()
	for _, p := range pods {
		n.proofAfter(p, settled)
	}
	before := n.apiRequests.Load()
	mark := time.Now()
	for round := range 3 {
		for _, p := range pods {
			if proof := n.proofAfter(p, mark); !proof.OK || len(proof.Found) > 0 {
				t.Fatalf("round %d: pod %s: %+v", round, p.Obj.Name, proof)
			}
		}
		mark = time.Now()
	}
	if got := n.apiRequests.Load() - before; got != 0 {
		t.Fatalf("the agent sent %d API requests over three verifier rounds of a healthy node; want 0", got)
	}
}

// TestVerifierShippedPeriod pins the shipped period: one minute, from the
// chart as from the flag's default, and 0 turns the verifier off.
func TestVerifierShippedPeriod(t *testing.T) {
	cfg := chartConfig(t, nil)
	if cfg.VerifyPeriod != time.Minute || verifier.DefaultPeriod != time.Minute {
		t.Fatalf("chart's verify period %v (default %v), want 1m", cfg.VerifyPeriod, verifier.DefaultPeriod)
	}
	off, err := installcni.Parse([]string{"--node-name=n", "--verify-period=0"}, func(string) string { return "" }, io.Discard)
	if err != nil || off.VerifyPeriod != 0 {
		t.Fatalf("--verify-period=0: %v, %v", off, err)
	}
}

// twoProvenPods starts a node whose verifier runs on the tests' period
// and two captured pods of an ambient namespace, each proven once.
func twoProvenPods(t *testing.T) (n *node, v *verifier.Verifier, a, b *kubesim.Pod) {
	t.Helper()
	n = newNode(t, nodeOptions{VerifyPeriod: testVerifyPeriod})
	shop := n.namespace("shop", ambientLabel)
	a = n.runPod(podSpec(shop, "a", nil, nil))
	b = n.runPod(podSpec(shop, "b", nil, nil))
	n.waitEnrolled(waitLong, a, b)
	if v = n.d.Verifier(); v == nil {
		t.Fatal("the verifier is off")
	}
	start := time.Now()
	for _, p := range []*kubesim.Pod{a, b} {
		if proof := n.proofAfter(p, start); !proof.OK {
			t.Fatalf("healthy pod %s not proven: %+v", p.Obj.Name, proof)
		}
	}
	return n, v, a, b
}
