package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/pkg/metrics"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// The SRE kit's files: the promtool unit tests of the alert rules, the
// Grafana dashboard and the runbooks the alerts link.
const (
	alertTests    = "test/deploy/testdata/alerts-test.yaml"
	dashboardPath = "deploy/charts/ambient-cni/files/dashboard.json"
	alertsDoc     = "docs/alerts.md"
)

// kitOn turns every part of the kit on.
var kitOn = []string{
	"--set", "monitoring.podMonitor.enabled=true",
	"--set", "monitoring.prometheusRule.enabled=true",
	"--set", "monitoring.dashboard.enabled=true",
}

// monitoringObject reports whether o is part of the SRE kit: the
// Prometheus Operator's kinds and the dashboard's ConfigMap.
func monitoringObject(o *unstructured.Unstructured) bool {
	return o.GroupVersionKind().Group == "monitoring.coreos.com" ||
		(o.GetKind() == "ConfigMap" && strings.HasSuffix(o.GetName(), "-dashboard"))
}

// withoutMonitoring is manifest without the kit's objects.
func withoutMonitoring(t testing.TB, manifest []byte) []byte {
	t.Helper()
	objs, err := kubeenv.ParseObjects(manifest)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	for _, o := range objs {
		if monitoringObject(o) {
			continue
		}
		b, err := yaml.Marshal(o.Object)
		if err != nil {
			t.Fatal(err)
		}
		out.WriteString("---\n")
		out.Write(b)
	}
	return out.Bytes()
}

// kit is the SRE kit of one rendering.
type kit struct {
	podMonitor, rule, dashboard *unstructured.Unstructured
	ds                          *unstructured.Unstructured
}

func renderKit(t testing.TB, extra ...string) kit {
	t.Helper()
	objs, err := kubeenv.ParseObjects(render(t, releaseName, namespace, append(slices.Clone(kitOn), extra...)...))
	if err != nil {
		t.Fatal(err)
	}
	var k kit
	for _, o := range objs {
		switch {
		case o.GetKind() == "PodMonitor":
			k.podMonitor = o
		case o.GetKind() == "PrometheusRule":
			k.rule = o
		case o.GetKind() == "ConfigMap" && monitoringObject(o):
			k.dashboard = o
		case o.GetKind() == "DaemonSet":
			k.ds = o
		}
	}
	if k.podMonitor == nil || k.rule == nil || k.dashboard == nil || k.ds == nil {
		t.Fatalf("the kit renders without its PodMonitor, PrometheusRule, dashboard ConfigMap or DaemonSet: %+v", k)
	}
	return k
}

// ruleGroups is the spec of the rendered PrometheusRule as a Prometheus
// rule file.
func ruleGroups(t testing.TB, k kit) []byte {
	t.Helper()
	spec, _, _ := unstructured.NestedMap(k.rule.Object, "spec")
	b, err := yaml.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// alertRule is one alerting rule of the rendered PrometheusRule.
type alertRule struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	For         string            `json:"for"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

func alerts(t testing.TB, k kit) []alertRule {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []alertRule `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(ruleGroups(t, k), &f); err != nil {
		t.Fatal(err)
	}
	var out []alertRule
	for _, g := range f.Groups {
		out = append(out, g.Rules...)
	}
	if len(out) == 0 {
		t.Fatal("the PrometheusRule holds no rule")
	}
	return out
}

// The kit is off by default: a chart installed as it is needs no CRD of
// the Prometheus Operator.
func TestMonitoringOffByDefault(t *testing.T) {
	objs, err := kubeenv.ParseObjects(render(t, releaseName, namespace))
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if monitoringObject(o) {
			t.Errorf("%s %s rendered with default values", o.GetKind(), o.GetName())
		}
	}
}

// The PodMonitor scrapes the DaemonSet's pods on the container port the
// agent serves /metrics on, whichever it is (Istio's 15014 with
// istioCompat.names), with the job the rules select by and the node label
// the alerts name.
func TestPodMonitorFollowsMetricsPort(t *testing.T) {
	cases := map[string]struct {
		args []string
		port int
	}{
		"defaults":                  {nil, 9974},
		"istioCompat.names":         {[]string{"--set", "istioCompat.names=true"}, 15014},
		"istioCompat.names, a port": {[]string{"--set", "istioCompat.names=true", "--set", "agent.metricsPort=9123"}, 9123},
	}
	for name, c := range cases {
		k := renderKit(t, c.args...)
		ctrs, _, _ := unstructured.NestedSlice(k.ds.Object, "spec", "template", "spec", "containers")
		var portName string
		for _, p := range ctrs[0].(map[string]any)["ports"].([]any) {
			pm := p.(map[string]any)
			if fmt.Sprint(pm["containerPort"]) == strconv.Itoa(c.port) {
				portName, _ = pm["name"].(string)
			}
		}
		eps, _, _ := unstructured.NestedSlice(k.podMonitor.Object, "spec", "podMetricsEndpoints")
		if len(eps) != 1 {
			t.Fatalf("%s: %d podMetricsEndpoints, want 1", name, len(eps))
		}
		ep := eps[0].(map[string]any)
		if portName == "" || ep["port"] != portName || ep["path"] != "/metrics" {
			t.Errorf("%s: PodMonitor scrapes port %v%v; the agent serves /metrics on container port %d named %q", name, ep["port"], ep["path"], c.port, portName)
		}
		sel, _, _ := unstructured.NestedStringMap(k.podMonitor.Object, "spec", "selector", "matchLabels")
		podLabels, _, _ := unstructured.NestedStringMap(k.ds.Object, "spec", "template", "metadata", "labels")
		for l, v := range sel {
			if podLabels[l] != v {
				t.Errorf("%s: PodMonitor selects %s=%s, the agent's pods have %q", name, l, v, podLabels[l])
			}
		}
		ns, _, _ := unstructured.NestedStringSlice(k.podMonitor.Object, "spec", "namespaceSelector", "matchNames")
		if !slices.Equal(ns, []string{namespace}) {
			t.Errorf("%s: PodMonitor looks in namespaces %v, want %s", name, ns, namespace)
		}
		b, _ := json.Marshal(ep["relabelings"])
		for _, want := range []string{`"targetLabel":"node"`, `"__meta_kubernetes_pod_node_name"`, `"replacement":"ambient-cni","targetLabel":"job"`} {
			if !strings.Contains(string(b), want) {
				t.Errorf("%s: PodMonitor relabelings %s lack %s", name, b, want)
			}
		}
	}
}

// shippedFor pins each alert's for: duration as shipped (docs/alerts.md
// gives them): an alert that fires on a blip pages people for nothing,
// one that waits too long leaves pods uncaptured. forOverride shortens
// them only for the real node's test.
var shippedFor = map[string]string{
	"AmbientCNIAgentDown":              "5m",
	"AmbientCNIAgentAbsent":            "15m",
	"AmbientCNIPluginNotInstalled":     "5m",
	"AmbientCNIZtunnelDisconnected":    "2m",
	"AmbientCNIPodsUnproven":           "10m",
	"AmbientCNIEnrollmentStuckPending": "10m",
	"AmbientCNIAddFailing":             "15m",
	"AmbientCNIAddRetrying":            "15m",
	"AmbientCNIRuleErrors":             "1m",
	"AmbientCNIVerifierDrift":          "1m",
	// Renewals fail for a long time before the credential is at risk
	// (it is renewed with half its lifetime or more left).
	"AmbientCNIPluginCredentialRenewalFailing": "30m",
	"AmbientCNIPluginCredentialExpiring":       "10m",
}

// Every alert ships with its pinned for:, a severity and a runbook_url
// pointing at its own section of docs/alerts.md; forOverride replaces
// every for: and nothing else.
func TestAlertRulesShipped(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repoRoot(t), alertsDoc))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, a := range alerts(t, renderKit(t)) {
		got[a.Alert] = a.For
		if s := a.Labels["severity"]; s != "critical" && s != "warning" {
			t.Errorf("%s: severity %q", a.Alert, s)
		}
		if a.Annotations["summary"] == "" {
			t.Errorf("%s: no summary", a.Alert)
		}
		want := "https://github.com/ambient-cni/ambient-cni/blob/main/docs/alerts.md#" + strings.ToLower(a.Alert)
		if a.Annotations["runbook_url"] != want {
			t.Errorf("%s: runbook_url %q, want %q", a.Alert, a.Annotations["runbook_url"], want)
		}
		if !bytes.Contains(doc, []byte("\n## "+a.Alert+"\n")) {
			t.Errorf("%s: %s has no section \"## %s\" for its runbook_url", a.Alert, alertsDoc, a.Alert)
		}
	}
	if !reflect.DeepEqual(got, shippedFor) {
		t.Errorf("alerts and their for: are %v, want %v", got, shippedFor)
	}
	for _, a := range alerts(t, renderKit(t, "--set", "monitoring.prometheusRule.forOverride=20s")) {
		if a.For != "20s" {
			t.Errorf("forOverride=20s: %s has for: %q", a.Alert, a.For)
		}
	}
}

// promtoolTests is the part of alerts-test.yaml the coverage check reads.
type promtoolTests struct {
	Tests []struct {
		AlertRuleTest []struct {
			Alertname string `json:"alertname"`
			ExpAlerts []any  `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

// The rendered rules pass promtool check rules, and promtool test rules
// passes test/deploy/testdata/alerts-test.yaml against them, which holds
// for each alert a case where it fires and one where it does not.
func TestAlertRulesPromtool(t *testing.T) {
	promtool := kubeenv.RequireTool(t, kubeenv.Promtool)
	k := renderKit(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), ruleGroups(t, k), 0o644); err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile(filepath.Join(repoRoot(t), alertTests))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "alerts-test.yaml"), tests, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"check", "rules", "rules.yaml"}, {"test", "rules", "alerts-test.yaml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
	}

	var pt promtoolTests
	if err := yaml.Unmarshal(tests, &pt); err != nil {
		t.Fatal(err)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, g := range pt.Tests {
		for _, c := range g.AlertRuleTest {
			if len(c.ExpAlerts) > 0 {
				fires[c.Alertname] = true
			} else {
				quiet[c.Alertname] = true
			}
		}
	}
	for _, a := range alerts(t, k) {
		if !fires[a.Alert] || !quiet[a.Alert] {
			t.Errorf("%s: %s needs a case where it fires (%v) and one where it does not (%v)", a.Alert, alertTests, fires[a.Alert], quiet[a.Alert])
		}
	}
}

// servedMetrics is every metric name an agent's /metrics serves: each
// family of pkg/metrics (described, so label-less vectors count too) and
// of the Go and process collectors, with a histogram's series names.
func servedMetrics(t testing.TB) map[string]bool {
	t.Helper()
	m := metrics.New()
	served := map[string]bool{}
	fqName := regexp.MustCompile(`fqName: "([^"]+)"`)
	v := reflect.ValueOf(m).Elem()
	for i := range v.NumField() {
		c, ok := v.Field(i).Interface().(prometheus.Collector)
		if !ok {
			continue
		}
		ch := make(chan *prometheus.Desc, 16)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			if mm := fqName.FindStringSubmatch(d.String()); mm != nil {
				served[mm[1]] = true
			}
		}
	}
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		served[f.GetName()] = true
		if f.GetType() == dto.MetricType_HISTOGRAM || f.GetType() == dto.MetricType_SUMMARY {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				served[f.GetName()+s] = true
			}
		}
	}
	for _, must := range []string{"ambient_cni_pods_unproven", "ambient_cni_cni_requests_total", "ztunnel_connected", "go_goroutines", "process_resident_memory_bytes"} {
		if !served[must] {
			t.Fatalf("served metrics %v lack %s: the collection is broken", served, must)
		}
	}
	return served
}

// promqlNoise is what metricNames drops before it reads identifiers:
// strings, label matchers, ranges and subqueries, grouping clauses, and
// Grafana's $variables.
var promqlNoise = []*regexp.Regexp{
	regexp.MustCompile(`"(\\.|[^"\\])*"|'(\\.|[^'\\])*'|` + "`[^`]*`"),
	regexp.MustCompile(`\{[^{}]*\}`),
	regexp.MustCompile(`\[[^\[\]]*\]`),
	regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`),
	regexp.MustCompile(`\$\{[^}]*\}|\$\w+`),
}

var (
	promqlIdent = regexp.MustCompile(`[A-Za-z_:][A-Za-z0-9_:]*`)
	// Keywords and modifiers, and the functions' and aggregations' names
	// (an identifier followed by "(").
	promqlWords = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true,
		"group_left": true, "group_right": true, "inf": true, "nan": true, "Inf": true, "NaN": true}
)

// metricNames returns the metric names a PromQL expression selects. A
// careful tokenizer rather than Prometheus's parser, which would bring
// Prometheus into the project's module.
func metricNames(expr string) []string {
	for _, re := range promqlNoise {
		expr = re.ReplaceAllString(expr, " ")
	}
	var out []string
	for _, loc := range promqlIdent.FindAllStringIndex(expr, -1) {
		name := expr[loc[0]:loc[1]]
		if loc[0] > 0 && (expr[loc[0]-1] >= '0' && expr[loc[0]-1] <= '9' || expr[loc[0]-1] == '.') {
			continue // the exponent or unit of a number (1e3, 5m)
		}
		if promqlWords[name] || strings.HasPrefix(strings.TrimLeft(expr[loc[1]:], " \t\n"), "(") {
			continue
		}
		out = append(out, name)
	}
	return out
}

func TestMetricNames(t *testing.T) {
	cases := map[string][]string{
		`up{job="a"} == 0`: {"up"},
		`(a_b == 0) and on (instance) (sum by (instance) (c_d{x="y"}) > 0)`:                    {"a_b", "c_d"},
		`histogram_quantile(0.99, sum by (le) (rate(h_bucket{job="$job"}[$__rate_interval])))`: {"h_bucket"},
		`count(up{job="x"} == 0) or vector(0)`:                                                 {"up"},
		`sum(rate(x_total[5m])) by (node) > 1e3`:                                               {"x_total"},
		`absent(up{job="ambient-cni"})`:                                                        {"up"},
	}
	for expr, want := range cases {
		if got := metricNames(expr); !slices.Equal(got, want) {
			t.Errorf("metricNames(%q) = %v, want %v", expr, got, want)
		}
	}
}

// Every metric a rule or the dashboard reads is one the agent serves (or
// Prometheus's own up): a renamed metric cannot leave an alert that never
// fires or a panel that stays empty.
func TestKitNamesServedMetrics(t *testing.T) {
	served := servedMetrics(t)
	served["up"] = true // Prometheus's own, per target
	check := func(where, expr string) {
		names := metricNames(expr)
		if len(names) == 0 {
			t.Errorf("%s: no metric found in %q", where, expr)
		}
		for _, n := range names {
			if !served[n] {
				t.Errorf("%s: %q reads %s, which the agent does not serve", where, expr, n)
			}
		}
	}
	if got := metricNames(`rate(ambient_cni_not_served_total[5m])`); served[got[0]] {
		t.Fatal("an unserved name passes the check")
	}
	k := renderKit(t)
	for _, a := range alerts(t, k) {
		check("alert "+a.Alert, a.Expr)
	}

	raw, err := os.ReadFile(filepath.Join(repoRoot(t), dashboardPath))
	if err != nil {
		t.Fatal(err)
	}
	if cm, _, _ := unstructured.NestedString(k.dashboard.Object, "data", "ambient-cni.json"); strings.TrimSpace(cm) != strings.TrimSpace(string(raw)) {
		t.Errorf("the dashboard ConfigMap does not hold %s as it is", dashboardPath)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	if len(dash.Panels) == 0 {
		t.Fatalf("%s has no panel", dashboardPath)
	}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("dashboard panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			check("dashboard panel "+p.Title, q.Expr)
		}
	}
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*\w+\)$`)
	for _, v := range dash.Templating.List {
		if v.Definition == "" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("dashboard variable %s: %q is not label_values(SELECTOR, LABEL)", v.Name, v.Definition)
			continue
		}
		check("dashboard variable "+v.Name, m[1])
	}
}
