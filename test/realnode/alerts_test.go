//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// alertFor is the for: the test renders the chart's alerts with
// (monitoring.prometheusRule.forOverride): the shipped minutes (pinned by
// test/deploy) are too long to wait out here, and the outages last as long
// as the test needs anyway.
const alertFor = "10s"

// TestRealNodeAlerts is the SRE kit's proof on a node of its own (one
// case, cheaper than a subtest of TestRealNode, whose first steps it does
// not need): the chart installed with its defaults and the ztunnel
// stand-in, then testConfined and testAlerts.
func TestRealNodeAlerts(t *testing.T) {
	e := startAgentNode(t)
	t.Run("the agent runs confined and its node files are private", e.testConfined)
	t.Run("a real Prometheus fires and clears the agent's and ztunnel's alerts", e.testAlerts)
	t.Run("nothing was sent off the machine", testNoEgress(e.n))
}

// A real Prometheus, a host process on the node, scrapes the agent's
// /metrics as the chart's PodMonitor does (job ambient-cni, the node
// label) and evaluates the chart's own alert rules. Freezing the agent
// (SIGSTOP) fires AmbientCNIAgentDown and only it; stopping the ztunnel
// stand-in while a pod is enrolled fires AmbientCNIZtunnelDisconnected and
// only it; each clears once the agent runs again and ztunnel is back.
func (e *e2e) testAlerts(t *testing.T) {
	ctx := context.Background()
	bin := kubeenv.RequireTool(t, kubeenv.Prometheus)
	ns := "alerts-" + randHex(4)
	e.namespace(t, ns, true)
	e.mustCaptured(t, e.start(t, ns, "enrolled", AppOptions{}))

	prom := e.startPrometheus(t, bin)
	if err := e.n.Poll(ctx, "Prometheus scrapes the agent and loaded the chart's rules", func(ctx context.Context) (bool, error) {
		return prom.ready(ctx)
	}); err != nil {
		t.Fatal(err)
	}
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
