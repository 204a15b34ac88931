package kubectlplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
)

// writeValues writes a values file in a temporary directory.
func writeValues(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "istio-cni-values.yaml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReadIstioValuesRefusesHostileFiles: what is not a map of values, a
// file too large, an alias bomb, a directory and keys of the wrong type
// are refused with a message, never read as defaults.
func TestReadIstioValuesRefusesHostileFiles(t *testing.T) {
	bomb := "a: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n" +
		"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\n" +
		"g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]\nh: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]\n"
	for _, c := range []struct {
		name, body, want string
	}{
		{"not YAML", "profile: ambient\n  : : [\n", "not YAML"},
		{"a list", "- profile\n- ambient\n", "want a map"},
		{"a string", "ambient\n", "want a map"},
		{"cni not a map", "cni: [1, 2]\n", "cni is a"},
		{"owned config a string", "istioOwnedCNIConfig: \"yes\"\n", "istioOwnedCNIConfig is yes"},
		{"chained under cni a number", "cni:\n  chained: 0\n", "chained is 0"},
		{"ambient.enabled a map", "ambient:\n  enabled: {a: b}\n", "ambient.enabled is"},
		{"provider a list", "provider: [multus]\n", "provider is"},
		{"too large", "profile: ambient\n" + strings.Repeat("# padding\n", maxValuesBytes/10+1), "larger than"},
		{"an alias bomb", bomb, "values"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := ReadIstioValues(writeValues(t, c.body))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("ReadIstioValues: %v, want an error containing %q", err, c.want)
			}
		})
	}
	if _, err := ReadIstioValues(t.TempDir()); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("a directory: %v", err)
	}
	if _, err := ReadIstioValues(filepath.Join(t.TempDir(), "missing.yaml")); err == nil {
		t.Error("a missing file read without error")
	}
}

// TestReadIstioValuesAsIstiosChart: cni.* wins over the top level, as
// Istio's chart copies it; an empty file is Istio's defaults.
func TestReadIstioValuesAsIstiosChart(t *testing.T) {
	v, err := ReadIstioValues(writeValues(t, "chained: true\nistioOwnedCNIConfig: false\ncni:\n  chained: false\n  istioOwnedCNIConfig: true\nambient:\n  enableAmbientDetectionRetry: true\n"))
	if err != nil {
		t.Fatal(err)
	}
	if v.Chained == nil || *v.Chained || !v.OwnedConfig || v.DetectionRetry == nil || !*v.DetectionRetry {
		t.Errorf("read %+v, want cni's chained false and owned config true, the retry on", v)
	}
	if v, err := ReadIstioValues(writeValues(t, "")); err != nil || v.OwnedConfig || v.Chained != nil {
		t.Errorf("an empty file: %+v, %v", v, err)
	}
}

// istioCNI is istio-cni's DaemonSet and ConfigMap as Istio's chart makes
// them, version 1.30.3, with data over its defaults.
func istioCNI(data map[string]string) []runtime.Object {
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "istio-cni-node",
			Labels:      map[string]string{"app.kubernetes.io/name": "istio-cni", "app.kubernetes.io/version": "1.30.3", "install.operator.istio.io/owning-resource": "unknown"},
			Annotations: map[string]string{"meta.helm.sh/release-name": "istio-cni"}},
		Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/os": "linux"},
			Containers:   []corev1.Container{{Name: "install-cni", Image: "docker.io/istio/install-cni:1.30.3-distroless"}},
			Volumes: []corev1.Volume{{Name: "cni-socket-dir", VolumeSource: corev1.VolumeSource{
				HostPath: &corev1.HostPathVolumeSource{Path: "/var/run/istio-cni"}}}},
		}}},
	}
	d := map[string]string{"AMBIENT_ENABLED": "true", "CHAINED_CNI_PLUGIN": "true", "ISTIO_OWNED_CNI_CONFIG": "false", "ENABLE_AMBIENT_DETECTION_RETRY": "false"}
	for k, v := range data {
		d[k] = v
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "istio-cni-config"}, Data: d}
	return []runtime.Object{ds, cm,
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-b"}},
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}}
}

func preflight(t *testing.T, values string, objs []runtime.Object, render func(context.Context, []string) error) *PreflightResult {
	t.Helper()
	p := &Preflight{Kube: fake.NewClientset(objs...), Namespace: "istio-system", DaemonSet: "istio-cni-node",
		ValuesFile: writeValues(t, values), Chart: "./deploy/charts/ambient-cni",
		ImageRepository: "registry.example/ambient-cni", ImageTag: "v1", Render: render}
	r, err := p.Run(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func blockers(r *PreflightResult) string {
	var b []string
	for _, f := range r.Findings {
		if f.Blocker {
			b = append(b, f.Text)
		}
	}
	return strings.Join(b, "\n")
}

// TestPreflightPlan: a plain ambient istio-cni passes, and the plan is
// the page's with the cluster's facts: its version kept by the upgrade
// that turns the retry on, a block per node in name order, the values
// through the chart with the takeover on.
func TestPreflightPlan(t *testing.T) {
	var rendered []string
	r := preflight(t, "profile: ambient\n", istioCNI(nil), func(_ context.Context, args []string) error {
		rendered = args
		return nil
	})
	if r.Blocked() {
		t.Fatalf("blocked: %s", blockers(r))
	}
	if r.IstioVersion != "1.30.3" {
		t.Errorf("version %q", r.IstioVersion)
	}
	if !strings.Contains(strings.Join(rendered, " "), "migration.fromIstioCNI.enabled=true") {
		t.Errorf("rendered with %q", rendered)
	}
	var text strings.Builder
	if err := RenderPreflight(&text, r); err != nil {
		t.Fatal(err)
	}
	out := text.String()
	for _, want := range []string{
		"helm upgrade istio-cni istio/cni -n istio-system --version 1.30.3 --reuse-values",
		"--set image.repository=registry.example/ambient-cni --set image.tag=v1",
		"kubectl label node node-a " + SwitchLabel + "=off --overwrite",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the plan does not say %q:\n%s", want, out)
		}
	}
	if strings.Index(out, "node node-a") > strings.Index(out, "node node-b") {
		t.Errorf("nodes out of order:\n%s", out)
	}

	// istio-cni's own conflist (istioOwnedCNIConfig) is no blocker: the
	// takeover removes it once ours is chained for the primary's.
	r = preflight(t, "", istioCNI(map[string]string{"ISTIO_OWNED_CNI_CONFIG": "true"}), nil)
	if r.Blocked() || !strings.Contains(fmt.Sprint(r.Findings), "02-istio-cni.conflist") {
		t.Errorf("istioOwnedCNIConfig in the cluster: blocked %v (%s), findings %+v: want a note naming its conflist", r.Blocked(), blockers(r), r.Findings)
	}

	// The retry already on: no istio-cni upgrade.
	r = preflight(t, "", istioCNI(map[string]string{"ENABLE_AMBIENT_DETECTION_RETRY": "true"}), nil)
	if len(r.Plan) == 0 || strings.Contains(r.Plan[0].Commands, "helm upgrade istio-cni") {
		t.Errorf("the retry on, the plan still upgrades istio-cni: %+v", r.Plan)
	}
}

// TestPreflightBlocks: every case the switch cannot go through exits
// non-zero with the reason, and prints no plan.
func TestPreflightBlocks(t *testing.T) {
	for _, c := range []struct {
		name, values string
		data         map[string]string
		render       error
		objs         func([]runtime.Object) []runtime.Object
		want         string
	}{
		{name: "values refused by the chart", render: errors.New("Error: values don't meet the specifications"), want: "the chart refuses"},
		{name: "malformed values", values: "- a\n", want: "want a map"},
		{name: "owned config in the values", values: "istioOwnedCNIConfig: true\n", want: "istioOwnedCNIConfig is true"},
		{name: "Multus", data: map[string]string{"CHAINED_CNI_PLUGIN": "false"}, want: "Multus"},
		{name: "sidecar only", data: map[string]string{"AMBIENT_ENABLED": "false"}, want: "sidecars only"},
		{name: "too old for the retry", objs: func(o []runtime.Object) []runtime.Object {
			o[0].(*appsv1.DaemonSet).Labels["app.kubernetes.io/version"] = "1.27.3"
			return o
		}, want: "1.28.4"},
		{name: "no istio-cni", objs: func([]runtime.Object) []runtime.Object { return nil }, want: "nothing to switch from"},
		{name: "istio-cni in kube-system", objs: func(o []runtime.Object) []runtime.Object {
			o[0].(*appsv1.DaemonSet).Namespace = "kube-system"
			return o
		}, want: "kube-system/istio-cni-node"},
	} {
		t.Run(c.name, func(t *testing.T) {
			objs := istioCNI(c.data)
			if c.objs != nil {
				objs = c.objs(objs)
			}
			r := preflight(t, c.values, objs, func(context.Context, []string) error { return c.render })
			if !r.Blocked() || !strings.Contains(blockers(r), c.want) {
				t.Errorf("blockers %q, want one saying %q", blockers(r), c.want)
			}
			var out strings.Builder
			if err := RenderPreflight(&out, r); err != nil {
				t.Fatal(err)
			}
			if strings.Contains(out.String(), "kubectl label") {
				t.Errorf("a blocked preflight printed the plan:\n%s", out.String())
			}
		})
	}
}

// TestPreflightArgs: preflight needs the values file.
func TestPreflightArgs(t *testing.T) {
	if _, err := ParseArgs([]string{"preflight"}, new(strings.Builder)); err == nil {
		t.Error("preflight without -f parsed")
	}
	o, err := ParseArgs([]string{"preflight", "-f", "v.yaml", "--istio-namespace", "kube-system"}, new(strings.Builder))
	if err != nil || o.Verb != "preflight" || o.Values != "v.yaml" || o.IstioNamespace != "kube-system" {
		t.Errorf("%+v, %v", o, err)
	}
}

// TestMigrationPageIsThePlan: the migration page's commands for the
// switch are the plan's for PageParams, block by block in order (the
// real-node switch test runs the page's blocks).
func TestMigrationPageIsThePlan(t *testing.T) {
	blocks, err := PageBlocks(filepath.Join("..", "..", "docs", "migrating-from-istio-cni.md"), PageSwitchSection)
	if err != nil {
		t.Fatal(err)
	}
	plan := Plan(PageParams)
	if len(blocks) != len(plan) {
		t.Fatalf("the page's switch has %d sh blocks, the plan %d steps", len(blocks), len(plan))
	}
	for i, s := range plan {
		if blocks[i] != s.Commands {
			t.Errorf("block %d (%s): the page says\n%s\nthe plan\n%s", i+1, s.Title, blocks[i], s.Commands)
		}
	}
}
