//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// alertFor is the for: the test renders the chart's alerts with
// (monitoring.prometheusRule.forOverride): the shipped minutes (pinned by
// test/deploy) are too long to wait out here, and the outages last as long
// as the test needs anyway.
const alertFor = "10s"

// alertsVerifyPeriod is the verifier's period on TestRealNodeAlerts's
// node, the one value it sets beyond the chart's defaults: a repair that
// does not hold is shown over several proofs in a row, and the shipped
// minute would make that minutes of waiting. The shipped default is
// pinned by TestVerifierShippedPeriod (test/integration).
const alertsVerifyPeriod = e2eVerifyPeriod

// TestRealNodeAlerts is the SRE kit's proof on a node of its own (cheaper
// than subtests of TestRealNode, whose first steps it does not need): the
// chart installed with its defaults but the verifier's period
// (alertsVerifyPeriod), the ztunnel stand-in, and a real Prometheus, a
// host process on the node, scraping the agent's /metrics as the chart's
// PodMonitor does (job ambient-cni, the node label) and evaluating the
// chart's own alert rules; first, testConfined.
func TestRealNodeAlerts(t *testing.T) {
	e := startAgentNode(t, "--set", "agent.verifyPeriod="+alertsVerifyPeriod.String())
	prom := e.startPrometheus(t, kubeenv.RequireTool(t, kubeenv.Prometheus))
	if err := e.n.Poll(context.Background(), "Prometheus scrapes the agent and loaded the chart's rules", prom.ready); err != nil {
		t.Fatal(err)
	}
	t.Run("the agent runs confined and its node files are private", e.testConfined)
	t.Run("a real Prometheus fires and clears the agent's and ztunnel's alerts", func(t *testing.T) { e.testAlerts(t, prom) })
	t.Run("a repair that does not hold keeps the pod unproven and fires the critical alert", func(t *testing.T) {
		e.testRepairThatDoesNotHold(t, prom)
	})
	t.Run("nothing was sent off the machine", testNoEgress(e.n))
}

// Freezing the agent (SIGSTOP) fires AmbientCNIAgentDown and only it;
// stopping the ztunnel stand-in while a pod is enrolled fires
// AmbientCNIZtunnelDisconnected and only it; each clears once the agent
// runs again and ztunnel is back.
func (e *e2e) testAlerts(t *testing.T, prom *prometheus) {
	ctx := context.Background()
	ns := "alerts-" + randHex(4)
	e.namespace(t, ns, true)
	e.mustCaptured(t, e.start(t, ns, "enrolled", AppOptions{}))

	quiet := func(what string) {
		t.Helper()
		if err := e.n.Poll(ctx, what, func(ctx context.Context) (bool, error) {
			firing, err := prom.firing(ctx)
			if err != nil {
				return false, err
			}
			for _, a := range []string{"AmbientCNIAgentDown", "AmbientCNIZtunnelDisconnected"} {
				if firing[a] != nil {
					return false, fmt.Errorf("%s firing: %v", a, firing[a])
				}
			}
			return true, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	quiet("no agent or ztunnel alert on the healthy node")

	// The agent hangs: its scrape times out.
	resume := e.freezeAgent(t)
	prom.waitFiring(t, "AmbientCNIAgentDown", "AmbientCNIZtunnelDisconnected")
	resume()
	quiet("AmbientCNIAgentDown clears once the agent runs again")

	// ztunnel leaves the node; the enrolled pod stays.
	if err := e.n.Client.CoreV1().Pods(ReleaseNamespace).Delete(ctx, StandInName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	e.standIn = false
	t.Cleanup(func() {
		if !e.standIn {
			if err := e.n.StartStandIn(context.Background()); err != nil {
				t.Errorf("ztunnel stand-in: %v", err)
			}
			e.standIn = true
		}
	})
	if err := e.n.WaitPodGone(ctx, ReleaseNamespace, StandInName); err != nil {
		t.Fatal(err)
	}
	prom.waitFiring(t, "AmbientCNIZtunnelDisconnected", "AmbientCNIAgentDown")
	if err := e.n.StartStandIn(ctx); err != nil {
		t.Fatal(err)
	}
	e.standIn = true
	quiet("AmbientCNIZtunnelDisconnected clears once ztunnel is back")
}

// The stand-in goes deaf to one captured pod: its in-pod listeners
// closed, and every Add of the pod acked without listening again, as a
// ztunnel that lost the pod for good (its rules redirect into ports
// nobody listens on). The pod's next proof finds ztunnel drift; the
// agent's repair (a Del and an Add, acked) does not hold, so the pod stays
// unproven proof after proof: explain shows it unproven, the gauge is 1
// at every sample, and the critical AmbientCNIPodsUnproven fires. Once
// the stand-in listens again, the agent's next repair holds: the pod is
// proven, the gauge is 0 and the alert clears. The other pods stay
// proven throughout (the gauge counts the deaf pod alone).
func (e *e2e) testRepairThatDoesNotHold(t *testing.T, prom *prometheus) {
	const (
		gauge    = "ambient_cni_pods_unproven"
		unproven = "AmbientCNIPodsUnproven"
	)
	ctx := context.Background()
	n := e.n
	ns := "unproven-" + randHex(4)
	e.namespace(t, ns, true)
	target := e.start(t, ns, "target", AppOptions{})
	other := e.start(t, ns, "bystander", AppOptions{})
	started := time.Now()
	for _, p := range []*corev1.Pod{target, other} {
		e.mustCaptured(t, p)
		if err := n.Poll(ctx, p.Name+" proven", func(ctx context.Context) (bool, error) {
			v, err := e.verificationIn(ctx, ns, p.Name)
			if err != nil {
				return false, err
			}
			if !v.At.After(started) || !v.Proven {
				return false, fmt.Errorf("last proof %+v", v)
			}
			return true, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	e.unprovenZero(t)
	nodeAlert := func(firing map[string][]alert) *alert {
		for i, a := range firing[unproven] {
			if a.Labels["node"] == n.Name && a.Labels["job"] == "ambient-cni" {
				return &firing[unproven][i]
			}
		}
		return nil
	}
	if err := n.Poll(ctx, unproven+" not firing on the healthy node", func(ctx context.Context) (bool, error) {
		firing, err := prom.firing(ctx)
		if err != nil {
			return false, err
		}
		if a := nodeAlert(firing); a != nil {
			return false, fmt.Errorf("firing: %v", *a)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	otherBefore, err := e.verificationIn(ctx, ns, other.Name)
	if err != nil {
		t.Fatal(err)
	}
	drifts := fmt.Sprintf(`ambient_cni_verify_drift_total{kind=%q}`, verifier.KindZtunnel)
	counted := e.metric(t, drifts)
	adds := func() int {
		t.Helper()
		msgs, err := n.StandInMessages(ctx)
		if err != nil {
			t.Fatal(err)
		}
		k := 0
		for _, m := range msgs {
			if m.Kind == ztunnel.KindAdd && m.UID == string(target.UID) && m.AckError == "" {
				k++
			}
		}
		return k
	}
	addsBefore := adds()

	uid := string(target.UID)
	if err := n.standInFault(ctx, http.MethodPost, "/deaf", uid); err != nil {
		t.Fatal(err)
	}
	deaf := true
	restore := func() {
		if deaf {
			if err := n.standInFault(context.Background(), http.MethodDelete, "/deaf", uid); err != nil {
				t.Errorf("the stand-in listens again: %v", err)
			}
			deaf = false
		}
	}
	t.Cleanup(restore)
	tampered := time.Now()

	// Three proofs begun after the listeners went (the first finds them
	// gone, two more periods try again), each unproven; the gauge read
	// after every look at explain, so it reflects that proof or a later
	// one.
	var proofs []explainwire.Verification
	var fired *alert
	var bad []string
	if err := n.Poll(ctx, "three unproven proofs of the deaf pod and "+unproven+" firing", func(ctx context.Context) (bool, error) {
		v, err := e.verificationIn(ctx, ns, target.Name)
		if err != nil {
			return false, err
		}
		if v.At.After(tampered) && (len(proofs) == 0 || v.At.After(proofs[len(proofs)-1].At)) {
			proofs = append(proofs, v)
			if v.Proven || !hasKind(v.Found, verifier.KindZtunnel) || v.Problem == "" {
				bad = append(bad, fmt.Sprintf("proof %d after the listeners went: %+v", len(proofs), v))
				return true, nil
			}
		}
		if len(proofs) > 0 {
			if g := e.metric(t, gauge); g != 1 {
				bad = append(bad, fmt.Sprintf("%s = %v after %d unproven proofs of the deaf pod alone", gauge, g, len(proofs)))
				return true, nil
			}
		}
		if fired == nil {
			firing, err := prom.firing(ctx)
			if err != nil {
				return false, err
			}
			fired = nodeAlert(firing)
		}
		if len(proofs) < 3 || fired == nil {
			return false, fmt.Errorf("%d proofs since the listeners went (last %+v), %s firing: %v", len(proofs), v, unproven, fired != nil)
		}
		return true, nil
	}); err != nil {
		t.Fatalf("%v\n%s", err, n.AgentLogTail(ctx, 100))
	}
	if len(bad) > 0 {
		t.Fatalf("the deaf pod was not kept unproven: %s\n%s", strings.Join(bad, "\n"), n.AgentLogTail(ctx, 100))
	}
	t.Logf("FIGURE unproven-repair: %d proofs unproven over %v (period %v); %s fired %v after the listeners went; last proof %+v",
		len(proofs), proofs[len(proofs)-1].At.Sub(proofs[0].At).Round(time.Millisecond), alertsVerifyPeriod, unproven,
		time.Since(tampered).Round(time.Second), proofs[len(proofs)-1])
	if fired.Labels["severity"] != "critical" {
		t.Errorf("%s fires with labels %v, want severity critical", unproven, fired.Labels)
	}
	// Every proof repaired in vain: the agent handed the pod to ztunnel
	// again each time (acked), and the pod still has no listener.
	if got, want := adds()-addsBefore, len(proofs); got < want {
		t.Errorf("ztunnel acked %d Adds of the deaf pod over %d failed repairs", got, want)
	}
	if got := e.metric(t, drifts); got < counted+float64(len(proofs)) {
		t.Errorf("%s = %v, was %v before %d proofs found the drift", drifts, got, counted, len(proofs))
	}
	if ok, _ := e.standInListens(ctx, target); ok {
		t.Fatal("the stand-in listens in the deaf pod")
	}

	// ztunnel listens again: the agent's next repair holds.
	restore()
	restored := time.Now()
	if err := n.Poll(ctx, "the pod proven once a repair holds", func(ctx context.Context) (bool, error) {
		v, err := e.verificationIn(ctx, ns, target.Name)
		if err != nil {
			return false, err
		}
		if !v.At.After(restored) || !v.Proven {
			return false, fmt.Errorf("last proof %+v", v)
		}
		return e.standInListens(ctx, target)
	}); err != nil {
		t.Fatalf("%v\n%s", err, n.AgentLogTail(ctx, 100))
	}
	e.unprovenZero(t)
	if err := n.Poll(ctx, unproven+" clears", func(ctx context.Context) (bool, error) {
		firing, err := prom.firing(ctx)
		if err != nil {
			return false, err
		}
		if a := nodeAlert(firing); a != nil {
			return false, fmt.Errorf("firing: %v", *a)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("FIGURE unproven-restored: proven and %s cleared %v after ztunnel listened again", unproven, time.Since(restored).Round(time.Second))
	if v, err := e.verificationIn(ctx, ns, other.Name); err != nil || !v.Proven || !sameTime(v.LastDriftAt, otherBefore.LastDriftAt) {
		t.Errorf("the untouched pod: %+v (%v); before %+v", v, err, otherBefore)
	}
}

// prometheus is a Prometheus server the test started, reached over its
// HTTP API on loopback.
type prometheus struct {
	e   *e2e
	url string
	// rules is how many alerting rules the chart renders.
	rules int
}

// startPrometheus writes the configuration and the chart's rendered rule
// groups into a directory of the test and runs Prometheus until the test
// ends.
func (e *e2e) startPrometheus(t *testing.T, bin string) *prometheus {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	out, err := e.n.Helm(ctx, "template", Release, ChartDir, "--namespace", ReleaseNamespace,
		"--set", "monitoring.prometheusRule.enabled=true",
		"--set", "monitoring.prometheusRule.forOverride="+alertFor,
		"--show-only", "templates/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rule unstructured.Unstructured
	if err := yaml.Unmarshal([]byte(out), &rule.Object); err != nil {
		t.Fatalf("the chart's PrometheusRule: %v", err)
	}
	spec, _, _ := unstructured.NestedMap(rule.Object, "spec")
	groups, err := yaml.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &prometheus{e: e, rules: strings.Count(string(groups), "alert: ")}
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), groups, 0o644); err != nil {
		t.Fatal(err)
	}
	// As the chart's PodMonitor labels the agent's series: job
	// (monitoring.job's default) and node. Short intervals: the test
	// waits for alerts, not for minutes of samples.
	cfg := fmt.Sprintf(`global:
  scrape_interval: 2s
  scrape_timeout: 1s
  evaluation_interval: 2s
rule_files: [rules.yaml]
scrape_configs:
  - job_name: ambient-cni
    static_configs:
      - targets: ["127.0.0.1:%d"]
        labels: {node: %q}
`, AgentMetricsPort, e.n.Name)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(ports[0])
	p.url = "http://" + addr
	cmd := exec.Command(bin,
		"--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = e.out, e.out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start prometheus: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return p
}

// get decodes the data of one Prometheus API answer.
func (p *prometheus) get(ctx context.Context, path string, data any) error {
	b, err := httpGet(ctx, p.url+path)
	if err != nil {
		return err
	}
	var r struct {
		Status string          `json:"status"`
		Data   json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if r.Status != "success" {
		return fmt.Errorf("%s: %s", path, b)
	}
	return json.Unmarshal(r.Data, data)
}

// ready reports whether the agent's target is up and every rule of the
// chart is loaded.
func (p *prometheus) ready(ctx context.Context) (bool, error) {
	var targets struct {
		ActiveTargets []struct {
			Health    string `json:"health"`
			LastError string `json:"lastError"`
		} `json:"activeTargets"`
	}
	if err := p.get(ctx, "/api/v1/targets", &targets); err != nil {
		return false, err
	}
	if len(targets.ActiveTargets) != 1 || targets.ActiveTargets[0].Health != "up" {
		return false, fmt.Errorf("targets: %+v", targets.ActiveTargets)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Type string `json:"type"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := p.get(ctx, "/api/v1/rules", &rules); err != nil {
		return false, err
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Type == "alerting" {
				n++
			}
		}
	}
	if n == 0 || n != p.rules {
		return false, fmt.Errorf("%d alerting rules loaded, the chart has %d", n, p.rules)
	}
	return true, nil
}

// alert is one entry of /api/v1/alerts.
type alert struct {
	Labels map[string]string `json:"labels"`
	State  string            `json:"state"`
}

// firing returns the firing alerts by name.
func (p *prometheus) firing(ctx context.Context) (map[string][]alert, error) {
	var r struct {
		Alerts []alert `json:"alerts"`
	}
	if err := p.get(ctx, "/api/v1/alerts", &r); err != nil {
		return nil, err
	}
	out := map[string][]alert{}
	for _, a := range r.Alerts {
		if a.State == "firing" {
			out[a.Labels["alertname"]] = append(out[a.Labels["alertname"]], a)
		}
	}
	return out, nil
}

// waitFiring waits until name fires for this node, and checks that other
// (the alert of the other outage) does not.
func (p *prometheus) waitFiring(t *testing.T, name, other string) {
	t.Helper()
	var firing map[string][]alert
	err := p.e.n.Poll(context.Background(), name+" fires", func(ctx context.Context) (bool, error) {
		var err error
		if firing, err = p.firing(ctx); err != nil {
			return false, err
		}
		for _, a := range firing[name] {
			if a.Labels["node"] == p.e.n.Name && a.Labels["job"] == "ambient-cni" {
				return true, nil
			}
		}
		return false, errors.New("not firing yet")
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s fires: %v", name, firing[name])
	if firing[other] != nil {
		t.Errorf("%s fires too: %v", other, firing[other])
	}
}
