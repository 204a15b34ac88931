package deploy

import (
	"bytes"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// An istio-cni values file, as users have it for the istio/cni chart, goes
// through our chart: each of Istio's keys either sets ours with Istio's
// meaning or fails at install with a message naming ours (or why there is
// none). Istio's own files come from the source of each minor the tools
// build (hack/kube-tools.sh --istio-minors: the released minors and
// master as "next"), so a key any of them has shows up here.

// istioChart is manifests/charts/istio-cni of one minor's source.
type istioChart struct{ minor, dir string }

// istioCharts returns Istio's istio-cni chart of every minor the tools
// build, the default first.
func istioCharts(t *testing.T) []istioChart {
	t.Helper()
	minors, err := kubeenv.IstioMinors()
	if err != nil {
		t.Fatal(err)
	}
	var out []istioChart
	for _, m := range minors {
		src, err := kubeenv.IstioSource(m)
		if err != nil {
			testnet.Missing(t, err.Error())
		}
		out = append(out, istioChart{minor: m, dir: filepath.Join(src, "manifests", "charts", "istio-cni")})
	}
	return out
}

// istioDefaults is Istio's values.yaml as its chart takes it: the keys
// under _internal_defaults_do_not_set are the chart's defaults.
func istioDefaults(t *testing.T, chart string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chart, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]map[string]any
	if err := yaml.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	d := raw["_internal_defaults_do_not_set"]
	if d == nil {
		t.Fatal("Istio's values.yaml has no _internal_defaults_do_not_set")
	}
	return d
}

// renderValues renders the chart with an istio-cni values file; it
// returns the manifest or helm's error text.
func renderValues(t *testing.T, values string, extra ...string) ([]byte, string) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(f, []byte(values), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := helm(t, append([]string{"template", releaseName, chartDir, "--namespace", namespace, "-f", f}, extra...)...)
	if err != nil {
		return nil, err.Error()
	}
	return out, ""
}

func mustYAML(t *testing.T, v any) string {
	t.Helper()
	b, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// istioCase is one istio-cni values file and what our chart makes of it:
// the failure text, or a check of what it sets. Neither: it renders exactly
// as our defaults do (the key has no effect here; the docs say why).
type istioCase struct {
	values string
	fail   string
	check  func(t *testing.T, o *objects)
}

func wantEnv(name, value string) func(*testing.T, *objects) {
	return func(t *testing.T, o *objects) {
		t.Helper()
		if got := o.env(t)[name]; got != value {
			t.Errorf("%s = %q, want %q", name, got, value)
		}
	}
}

func wantHostPath(volume, path string) func(*testing.T, *objects) {
	return func(t *testing.T, o *objects) {
		t.Helper()
		for _, v := range o.ds.Spec.Template.Spec.Volumes {
			if v.Name == volume {
				if v.HostPath == nil || v.HostPath.Path != path {
					t.Errorf("volume %s: %+v, want host path %s", volume, v.HostPath, path)
				}
				return
			}
		}
		t.Errorf("no volume %s", volume)
	}
}

// wantImage checks the agent's image starts with prefix.
func wantImage(prefix string) func(*testing.T, *objects) {
	return func(t *testing.T, o *objects) {
		t.Helper()
		if got := o.container(t).Image; !strings.HasPrefix(got, prefix) {
			t.Errorf("image %s, want %s…", got, prefix)
		}
	}
}

func wantPullPolicy(p corev1.PullPolicy) func(*testing.T, *objects) {
	return func(t *testing.T, o *objects) {
		t.Helper()
		if got := o.container(t).ImagePullPolicy; got != p {
			t.Errorf("imagePullPolicy %s, want %s", got, p)
		}
	}
}

func wantRequests(cpu, mem string) func(*testing.T, *objects) {
	return func(t *testing.T, o *objects) {
		t.Helper()
		r := o.container(t).Resources.Requests
		if !r.Cpu().Equal(resource.MustParse(cpu)) || !r.Memory().Equal(resource.MustParse(mem)) {
			t.Errorf("requests %v, want cpu %s memory %s", r, cpu, mem)
		}
	}
}

func both(checks ...func(*testing.T, *objects)) func(*testing.T, *objects) {
	return func(t *testing.T, o *objects) {
		t.Helper()
		for _, c := range checks {
			c(t, o)
		}
	}
}

// genericNetnsEnv is the generic layout's netns dirs, as AMBIENT_NETNS_DIRS.
var genericNetnsEnv = strings.Join(genericNetns, ",")

// istioValueCases pins what each of Istio's keys does here, by its path in
// Istio's values (the istio/cni chart's; global.* as that chart reads it).
// docs/migrating-from-istio-cni.md is the same table for operators.
var istioValueCases = map[string][]istioCase{
	"hub":     {{values: `hub: registry.example/istio`, fail: "hub: registry.example/istio names Istio's install-cni image; ambient-cni runs its own: set image.repository and image.tag"}, {values: `hub: ""`}},
	"tag":     {{values: `tag: 1.28.0`, fail: "tag: 1.28.0 names Istio's install-cni image"}, {values: `tag: ""`}},
	"variant": {{values: `variant: distroless`, fail: "variant: distroless names Istio's install-cni image"}, {values: `variant: ""`}},
	"image":   {{values: `image: install-cni`, fail: "image: install-cni is Istio's install-cni image name; ambient-cni runs its own image: set image.repository and image.tag"}},
	"pullPolicy": {
		{values: `pullPolicy: Always`, check: wantPullPolicy(corev1.PullAlways)},
		{values: `pullPolicy: ""`},
	},
	"logging.level": {
		{values: `logging: {level: debug}`, check: wantEnv("AMBIENT_LOG_LEVEL", "debug")},
		{values: `logging: {level: "default:warn,cni-agent:debug"}`, check: wantEnv("AMBIENT_LOG_LEVEL", "warn")},
		{values: `logging: {level: none}`, check: wantEnv("AMBIENT_LOG_LEVEL", "error")},
		{values: `logging: {level: loud}`, fail: `logging.level "loud": ambient-cni's agent has one level (agent.logLevel`},
		{values: `logging: {level: ""}`},
	},
	"cniBinDir": {
		{values: `cniBinDir: /var/lib/cni/bin`, check: wantHostPath("cni-bin-dir", "/var/lib/cni/bin")},
		{values: "cniBinDir: /a\ncni: {binDir: /b}", fail: "cniBinDir (Istio's name) and cni.binDir disagree; keep cni.binDir"},
		{values: `cniBinDir: /opt/cni/bin`},
	},
	"cniConfDir": {
		{values: `cniConfDir: /etc/cni/multus/net.d`, check: wantHostPath("cni-conf-dir", "/etc/cni/multus/net.d")},
		{values: `cniConfDir: /etc/cni/net.d`},
	},
	"cniConfFileName": {
		{values: `cniConfFileName: 10-calico.conflist`, check: wantEnv("AMBIENT_CNI_CONF_NAME", "10-calico.conflist")},
		{values: `cniConfFileName: ""`},
	},
	"cniNetnsDir": {
		{values: `cniNetnsDir: /var/run/docker/netns`, check: both(wantEnv("AMBIENT_NETNS_DIRS", genericNetnsEnv+",/var/run/docker/netns"), wantHostPath("netns-3", "/var/run/docker/netns"))},
		{values: `cniNetnsDir: /var/run/netns`},
	},
	// Read by Istio only with istioOwnedCNIConfig.
	"istioOwnedCNIConfigFileName": {{values: `istioOwnedCNIConfigFileName: 02-istio-cni.conflist`, check: wantEnv("AMBIENT_CNI_OWNED_CONF_NAME", "02-istio-cni.conflist")}},
	"istioOwnedCNIConfig": {
		{values: `istioOwnedCNIConfig: true`, check: wantEnv("AMBIENT_CNI_OWNED_CONFIG", "true")},
		{values: `istioOwnedCNIConfig: false`, check: wantEnv("AMBIENT_CNI_OWNED_CONFIG", "false")},
	},
	"excludeNamespaces": {
		{values: `excludeNamespaces: [kube-system, monitoring]`, check: wantEnv("AMBIENT_EXCLUDED_NAMESPACES", "kube-system,monitoring")},
		{values: `excludeNamespaces: [kube-system]`},
	},
	"affinity": {{values: `affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: mesh, operator: In, values: ["on"]}]}]}}}`,
		check: func(t *testing.T, o *objects) {
			if a := o.ds.Spec.Template.Spec.Affinity; a == nil || a.NodeAffinity == nil {
				t.Errorf("affinity %+v, want the node affinity", a)
			}
		}}, {values: `affinity: {}`}},
	"daemonSetLabels": {{values: `daemonSetLabels: {team: mesh}`, check: func(t *testing.T, o *objects) {
		if o.ds.Labels["team"] != "mesh" {
			t.Errorf("DaemonSet labels %v, want team: mesh", o.ds.Labels)
		}
	}}, {values: `daemonSetLabels: {}`}},
	"podAnnotations": {{values: `podAnnotations: {example.com/owner: mesh}`, check: func(t *testing.T, o *objects) {
		if o.ds.Spec.Template.Annotations["example.com/owner"] != "mesh" {
			t.Errorf("pod annotations %v", o.ds.Spec.Template.Annotations)
		}
	}}, {values: `podAnnotations: {}`}},
	"podLabels": {{values: `podLabels: {team: mesh}`, check: func(t *testing.T, o *objects) {
		if o.ds.Spec.Template.Labels["team"] != "mesh" {
			t.Errorf("pod labels %v", o.ds.Spec.Template.Labels)
		}
	}}, {values: `podLabels: {}`}},
	"chained": {
		{values: `chained: false`, fail: "chained: false (a standalone config file, as for Multus): ambient-cni always chains into the primary network's config; on OpenShift set platform: openshift"},
		{values: `chained: true`},
	},
	"provider": {
		{values: `provider: multus`, fail: `provider: "multus": ambient-cni has no provider setting`},
		{values: `provider: default`},
	},
	"ambient.enabled": {
		{values: `ambient: {enabled: false}`, fail: "ambient.enabled: false is istio-cni for sidecars only; ambient-cni serves ambient mode only"},
		{values: `ambient: {enabled: true}`},
	},
	"ambient.enablementSelectors": {{values: `ambient: {enablementSelectors: [{podSelector: {matchLabels: {istio.io/dataplane-mode: ambient}}}]}`,
		check: wantEnv("AMBIENT_ENABLEMENT_SELECTOR", `[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]`)}},
	// Not read by Istio's chart or agent at the pinned version.
	"ambient.configDir": {{values: `ambient: {configDir: /etc/ambient-config}`}},
	"ambient.dnsCapture": {
		{values: `ambient: {dnsCapture: false}`, check: wantEnv("AMBIENT_DNS_CAPTURE", "false")},
		{values: `ambient: {dnsCapture: true}`},
	},
	"ambient.ipv6": {
		{values: `ambient: {ipv6: false}`, check: wantEnv("AMBIENT_IPV6", "false")},
		{values: `ambient: {ipv6: true}`},
	},
	"ambient.reconcileIptablesOnStartup": {
		{values: `ambient: {reconcileIptablesOnStartup: false}`, fail: "ambient.reconcileIptablesOnStartup: false: ambient-cni always brings captured pods' rules up to date at startup"},
		{values: `ambient: {reconcileIptablesOnStartup: true}`},
	},
	"ambient.shareHostNetworkNamespace": {
		{values: `ambient: {shareHostNetworkNamespace: false}`, fail: "ambient.shareHostNetworkNamespace: false: ambient-cni's agent always runs in the host network namespace"},
		{values: `ambient: {shareHostNetworkNamespace: true}`},
	},
	// Istio's plugin asks the API server; ours never does (the agent
	// decides from its informer cache).
	"ambient.enableAmbientDetectionRetry": {{values: `ambient: {enableAmbientDetectionRetry: true}`}, {values: `ambient: {enableAmbientDetectionRetry: false}`}},
	"seccompProfile": {
		{values: `seccompProfile: {type: RuntimeDefault}`, check: func(t *testing.T, o *objects) {
			if sp := o.container(t).SecurityContext.SeccompProfile; sp == nil || sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Errorf("seccompProfile %+v, want RuntimeDefault", sp)
			}
		}},
		{values: `seccompProfile: {}`},
	},
	"seLinuxOptions": {
		{values: `seLinuxOptions: {level: "s0"}`, check: func(t *testing.T, o *objects) {
			if se := o.container(t).SecurityContext.SELinuxOptions; se == nil || se.Type != "spc_t" || se.Level != "s0" {
				t.Errorf("seLinuxOptions %+v, want type spc_t (Istio's default type) and level s0", se)
			}
		}},
		{values: `seLinuxOptions: {}`},
	},
	// Ours sets securityContext.appArmorProfile: Unconfined either way.
	"useAppArmorAnnotation": {{values: `useAppArmorAnnotation: true`}, {values: `useAppArmorAnnotation: false`}},
	"resources":             {{values: `resources: {requests: {cpu: 100m, memory: 100Mi}}`, check: wantRequests("100m", "100Mi")}},
	"resourceQuotas": {
		{values: `resourceQuotas: {enabled: true, pods: 100}`, check: func(t *testing.T, o *objects) {
			if o.rq == nil || !o.rq.Spec.Hard[corev1.ResourcePods].Equal(resource.MustParse("100")) {
				t.Errorf("ResourceQuota %+v, want one of 100 pods", o.rq)
			}
		}},
		{values: `resourceQuotas: {enabled: false, pods: 5000}`},
	},
	"tolerations": {{values: `tolerations: [{key: CriticalAddonsOnly, operator: Exists}]`, check: func(t *testing.T, o *objects) {
		if tl := o.ds.Spec.Template.Spec.Tolerations; len(tl) != 1 || tl[0].Key != "CriticalAddonsOnly" {
			t.Errorf("tolerations %+v", tl)
		}
	}}},
	"updateStrategy": {{values: `updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 3}}`, check: func(t *testing.T, o *objects) {
		if ru := o.ds.Spec.UpdateStrategy.RollingUpdate; ru == nil || ru.MaxUnavailable.IntValue() != 3 {
			t.Errorf("updateStrategy %+v", o.ds.Spec.UpdateStrategy)
		}
	}}},
	"terminationGracePeriodSeconds": {{values: `terminationGracePeriodSeconds: 45`, check: func(t *testing.T, o *objects) {
		if g := o.ds.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g != 45 {
			t.Errorf("terminationGracePeriodSeconds %v", g)
		}
	}}},
	"revision": {
		{values: `revision: canary`, fail: `revision: "canary": ambient-cni is one node agent for the whole cluster`},
		{values: `revision: ""`},
	},
	// istioctl's owner label on Istio's objects.
	"ownerName": {{values: `ownerName: unknown`}},
	"env": {
		{values: `env: {REPAIR_ENABLED: "false"}`, fail: "env: istio-cni's own environment; ambient-cni's settings are the chart's values"},
		{values: `env: {}`},
	},
	"repair.enabled": {
		{values: `repair: {enabled: true}`, fail: "repair: istio-cni's repair of sidecar pods"},
		{values: `repair: {enabled: false}`},
	},
	// Istio's global values the istio-cni chart reads.
	// Where Istio's images come from: refused while our image is the
	// source chart's placeholder (it would be pulled from there), of no
	// effect once image.repository names ours.
	"global.hub": {
		{values: `global: {hub: docker.io/istio}`, fail: "global.hub: docker.io/istio is for Istio's images; ambient-cni's image is image.repository, still the chart's placeholder ghcr.io/ambient-cni/ambient-cni"},
		{values: "image: {repository: mirror.example/ambient-cni}\nglobal: {hub: mirror.example/istio}", check: wantImage("mirror.example/ambient-cni:")},
	},
	"global.tag": {
		{values: `global: {tag: 1.28.0}`, fail: "global.tag: 1.28.0 is for Istio's images"},
		{values: "image: {repository: mirror.example/ambient-cni, tag: v1}\nglobal: {tag: 1.28.0}", check: wantImage("mirror.example/ambient-cni:v1")},
	},
	"global.variant": {{values: `global: {variant: distroless}`}},
	"global.imagePullPolicy": {
		{values: `global: {imagePullPolicy: Always}`, check: wantPullPolicy(corev1.PullAlways)},
		{values: "pullPolicy: Never\nglobal: {imagePullPolicy: Always}", check: wantPullPolicy(corev1.PullNever)},
	},
	"global.logging.level": {
		{values: `global: {logging: {level: "default:debug"}}`, check: wantEnv("AMBIENT_LOG_LEVEL", "debug")},
		{values: "logging: {level: error}\nglobal: {logging: {level: debug}}", check: wantEnv("AMBIENT_LOG_LEVEL", "error")},
	},
	"global.logAsJson": {
		{values: `global: {logAsJson: true}`, check: wantEnv("AMBIENT_LOG_FORMAT", "json")},
		{values: `global: {logAsJson: false}`, check: wantEnv("AMBIENT_LOG_FORMAT", "text")},
	},
	// Istio's NetworkPolicy; the agent runs in the host network, where
	// NetworkPolicy does not apply.
	"global.networkPolicy.enabled": {{values: `global: {networkPolicy: {enabled: true}}`}},
	"global.imagePullSecrets": {{values: `global: {imagePullSecrets: [regcred]}`, check: func(t *testing.T, o *objects) {
		if s := o.ds.Spec.Template.Spec.ImagePullSecrets; len(s) != 1 || s[0].Name != "regcred" {
			t.Errorf("imagePullSecrets %+v, want regcred", s)
		}
	}}},
	// Used by Istio only when resources is empty; ours never is.
	"global.defaultResources": {{values: `global: {defaultResources: {requests: {cpu: 1m}}}`}},
	"global.nativeNftables": {
		{values: `global: {nativeNftables: true}`, check: wantEnv("AMBIENT_RULES_BACKEND", "nftables")},
		{values: `global: {nativeNftables: false}`, check: wantEnv("AMBIENT_RULES_BACKEND", "iptables")},
		{values: "agent: {rulesBackend: nft}\nglobal: {nativeNftables: true}", check: wantEnv("AMBIENT_RULES_BACKEND", "nft")},
	},
	"global.resourceScope": {
		{values: `global: {resourceScope: cluster}`, fail: `global.resourceScope: "cluster": the chart installs all of its objects in one release`},
		{values: `global: {resourceScope: all}`},
	},
	// Read by Istio's chart beside its values.yaml (profiles, platforms).
	"profile": {
		{values: `profile: ambient`},
		{values: `profile: demo`, fail: `profile: "demo": Istio's profiles other than ambient leave istio-cni in sidecar mode`},
	},
	"global.profile": {{values: `global: {profile: ambient}`}},
	// An istio/ambient values file's cni section, as the umbrella passes it.
	"cni.profile": {
		{values: `cni: {profile: ambient}`},
		{values: `cni: {profile: demo}`, fail: `profile: "demo"`},
	},
	"platform": {{values: `platform: k3s`, check: wantHostPath("cni-bin-dir", "/var/lib/rancher/k3s/data/cni")}},
	"global.platform": {
		{values: `global: {platform: k3d}`, check: wantHostPath("cni-bin-dir", "/bin")},
		{values: `global: {platform: nope}`, fail: `platform "nope" is not one of the chart's platforms`},
	},
	"compatibilityVersion": {
		{values: `compatibilityVersion: "1.28"`, fail: "compatibilityVersion: 1.28: before 1.29 istio-cni left captured pods' rules alone at startup"},
		{values: `compatibilityVersion: "1.29"`},
	},
	// Istio's chart copies cni.* over the top level.
	"cni": {{values: "cniBinDir: /a\ncni: {cniBinDir: /b, ambient: {dnsCapture: false}, resources: {requests: {cpu: 10m}}}",
		check: both(wantHostPath("cni-bin-dir", "/b"), wantEnv("AMBIENT_DNS_CAPTURE", "false"), wantRequests("10m", "64Mi"))}},
	"_internal_defaults_do_not_set": {{values: "_internal_defaults_do_not_set: {hub: x}", fail: "_internal_defaults_do_not_set: Istio's chart defaults, as helm show values prints them; keep only the keys you changed"}},
}

// istioPaths lists the keys of Istio's values: the leaves, descending only
// into Istio's fixed groups (free-form maps such as resources are one key).
func istioPaths(v map[string]any, prefix string) []string {
	descend := map[string]bool{"logging": true, "ambient": true, "repair": true, "global": true, "global.logging": true, "global.networkPolicy": true}
	var out []string
	for k, e := range v {
		p := strings.TrimPrefix(prefix+"."+k, ".")
		if m, ok := e.(map[string]any); ok && descend[p] {
			out = append(out, istioPaths(m, p)...)
			continue
		}
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// TestIstioValueKeys renders every case of istioValueCases and checks the
// table covers every key of Istio's values.yaml.
func TestIstioValueKeys(t *testing.T) {
	cases := maps.Clone(istioValueCases)
	for _, chart := range istioCharts(t) {
		defaults := istioDefaults(t, chart.dir)
		// repair.* other than enabled: with enabled (Istio's default true)
		// the whole group fails; with enabled: false none has an effect.
		repair, _ := defaults["repair"].(map[string]any)
		for k, v := range repair {
			if k == "enabled" {
				continue
			}
			cases["repair."+k] = []istioCase{
				{values: mustYAML(t, map[string]any{"repair": map[string]any{k: v}}), fail: "repair: istio-cni's repair of sidecar pods"},
				{values: mustYAML(t, map[string]any{"repair": map[string]any{"enabled": false, k: v}})},
			}
		}
		for _, p := range istioPaths(defaults, "") {
			if _, ok := cases[p]; !ok {
				t.Errorf("Istio %s's value %s (istio-cni chart) is not pinned in istioValueCases: decide what it does here, and say so in docs/migrating-from-istio-cni.md", chart.minor, p)
			}
		}
	}
	want := string(render(t, releaseName, namespace))
	for path, cs := range cases {
		for i, c := range cs {
			out, failed := renderValues(t, c.values)
			switch {
			case c.fail != "":
				if failed == "" || !strings.Contains(failed, c.fail) {
					t.Errorf("%s #%d (%q): want a failure with %q, got %q", path, i, c.values, c.fail, failed)
				}
			case failed != "":
				t.Errorf("%s #%d (%q): %s", path, i, c.values, failed)
			case c.check != nil:
				t.Run(path, func(t *testing.T) { c.check(t, decode(t, out)) })
			case string(out) != want:
				t.Errorf("%s #%d (%q): renders other than the defaults (first difference at line %d); a key with no effect must change nothing", path, i, c.values, firstDiffLine(out, []byte(want)))
			}
		}
	}
}

// Istio's values.yaml as helm show values prints it fails with a message
// saying what to keep; its defaults as a values file fail on the first of
// the keys that cannot carry over; with those set as an ambient user of
// ours must (docs/migrating-from-istio-cni.md), they render with Istio's
// meaning.
func TestIstioValuesFile(t *testing.T) {
	for _, chart := range istioCharts(t) {
		t.Run(chart.minor, func(t *testing.T) { testIstioValuesFile(t, chart.dir) })
	}
}

func testIstioValuesFile(t *testing.T, chart string) {
	raw, err := os.ReadFile(filepath.Join(chart, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if _, failed := renderValues(t, string(raw)); !strings.Contains(failed, "_internal_defaults_do_not_set: Istio's chart defaults") {
		t.Errorf("Istio's values.yaml: want the _internal_defaults_do_not_set failure, got %q", failed)
	}
	d := istioDefaults(t, chart)
	if _, failed := renderValues(t, mustYAML(t, d)); !strings.Contains(failed, "image: install-cni is Istio's install-cni image name") {
		t.Errorf("Istio's defaults: want the image failure first, got %q", failed)
	}
	// Our image in place of Istio's (global.hub, which Istio's defaults
	// set, is refused while image.repository is the placeholder).
	d["image"] = map[string]any{"repository": "registry.example/ambient-cni"}
	d["ambient"].(map[string]any)["enabled"] = true
	d["ambient"].(map[string]any)["shareHostNetworkNamespace"] = true
	d["repair"].(map[string]any)["enabled"] = false
	out, failed := renderValues(t, mustYAML(t, d))
	if failed != "" {
		t.Fatalf("Istio's defaults in ambient mode: %s", failed)
	}
	o := decode(t, out)
	for name, check := range map[string]func(*testing.T, *objects){
		"log level":        wantEnv("AMBIENT_LOG_LEVEL", "info"),
		"excluded":         wantEnv("AMBIENT_EXCLUDED_NAMESPACES", "kube-system"),
		"iptables":         wantEnv("AMBIENT_RULES_BACKEND", "iptables"),
		"dns":              wantEnv("AMBIENT_DNS_CAPTURE", "true"),
		"netns dirs":       wantEnv("AMBIENT_NETNS_DIRS", genericNetnsEnv),
		"bin dir":          wantHostPath("cni-bin-dir", "/opt/cni/bin"),
		"conf dir":         wantHostPath("cni-conf-dir", "/etc/cni/net.d"),
		"Istio's requests": wantRequests("100m", "100Mi"),
	} {
		t.Run(name, func(t *testing.T) { check(t, o) })
	}
	if tl := o.ds.Spec.Template.Spec.Tolerations; len(tl) != 3 {
		t.Errorf("tolerations %+v, want Istio's three", tl)
	}
}

// TestIstioProfiles: each of the istio-cni chart's profiles, selected as
// Istio's chart selects it (profile, platform or global.platform,
// compatibilityVersion) and given as a values file (its keys the istio-cni
// chart reads; the others are other charts'), does what it does in Istio's
// chart or fails saying why.
func TestIstioProfiles(t *testing.T) {
	for _, chart := range istioCharts(t) {
		t.Run(chart.minor, func(t *testing.T) { testIstioProfiles(t, chart.dir) })
	}
}

func testIstioProfiles(t *testing.T, chart string) {
	chartKeys := istioDefaults(t, chart)
	files, err := filepath.Glob(filepath.Join(chart, "files", "profile-*.yaml"))
	if err != nil || len(files) < 10 {
		t.Fatalf("Istio's profiles: %v %v", files, err)
	}
	// The failure each profile's values file produces; absent: renders.
	fails := map[string]string{
		"openshift": "chained: false",
	}
	for _, f := range files {
		name := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(f), "profile-"), ".yaml")
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var prof map[string]any
		if err := yaml.Unmarshal(b, &prof); err != nil {
			t.Fatal(err)
		}
		cni, _ := prof["cni"].(map[string]any)
		var selectBy []string
		selectFail := ""
		switch {
		case strings.HasPrefix(name, "platform-"):
			name = strings.TrimPrefix(name, "platform-")
			selectBy = []string{"--set", "global.platform=" + name}
			// Istio's dirs for the platform are ours.
			o := decode(t, render(t, releaseName, namespace, "--set", "platform="+name))
			if d, _ := cni["cniBinDir"].(string); d != "" {
				wantHostPath("cni-bin-dir", d)(t, o)
			}
			if d, _ := cni["cniConfDir"].(string); d != "" && name != "openshift" {
				wantHostPath("cni-conf-dir", d)(t, o)
			}
			if d, _ := cni["cniNetnsDir"].(string); d != "" && !slices.Contains(strings.Split(o.env(t)["AMBIENT_NETNS_DIRS"], ","), d) {
				t.Errorf("platform %s: netns dirs %s lack Istio's %s", name, o.env(t)["AMBIENT_NETNS_DIRS"], d)
			}
		case strings.HasPrefix(name, "compatibility-version-"):
			v := strings.TrimPrefix(name, "compatibility-version-")
			selectBy = []string{"--set-string", "compatibilityVersion=" + v}
			if v < "1.29" {
				selectFail = "compatibilityVersion: " + v
				fails[name] = "ambient.reconcileIptablesOnStartup: false"
			}
		default:
			selectBy = []string{"--set", "profile=" + name}
			if name != "ambient" {
				selectFail = `profile: "` + name + `"`
			}
		}
		_, failed := renderValues(t, "{}", selectBy...)
		if selectFail == "" && failed != "" || !strings.Contains(failed, selectFail) {
			t.Errorf("%s selected by %v: got %q, want failure %q", name, selectBy, failed, selectFail)
		}
		// The profile as a values file: what the istio-cni chart reads of it.
		vals := map[string]any{}
		for k, v := range prof {
			if _, ok := chartKeys[k]; ok || k == "cni" {
				vals[k] = v
			}
		}
		_, failed = renderValues(t, mustYAML(t, vals))
		if want := fails[name]; want == "" && failed != "" || !strings.Contains(failed, want) {
			t.Errorf("profile %s as values (%v): got %q, want failure %q", name, vals, failed, want)
		}
	}
}

// istioCompat.names keeps Istio's DaemonSet name, its label and metrics
// port for runbooks and dashboards. The release's signal keeps its name
// (that of the release): an upgrade that renames the DaemonSet must not
// delete it, which the agents would take for an uninstall.
func TestIstioCompatNames(t *testing.T) {
	o := decode(t, render(t, releaseName, namespace, "--set", "istioCompat.names=true"))
	plain := decode(t, render(t, releaseName, namespace))
	for _, r := range []*objects{o, plain} {
		if env := r.env(t); env["AMBIENT_RELEASE_SIGNAL"] != "ambient-cni-installed" ||
			!bytes.Contains(r.manifest, []byte("kind: Service\nmetadata:\n  name: ambient-cni-installed\n")) {
			t.Errorf("release signal %q, or no Service of that name: want ambient-cni-installed whatever the DaemonSet's name", env["AMBIENT_RELEASE_SIGNAL"])
		}
	}
	if o.ds.Name != "istio-cni-node" || o.ds.Labels["k8s-app"] != "istio-cni-node" || o.ds.Spec.Template.Labels["k8s-app"] != "istio-cni-node" {
		t.Errorf("DaemonSet %s labels %v pod labels %v, want istio-cni-node with k8s-app: istio-cni-node", o.ds.Name, o.ds.Labels, o.ds.Spec.Template.Labels)
	}
	if env := o.env(t); env["AMBIENT_DAEMONSET_NAME"] != "istio-cni-node" || env["AMBIENT_METRICS_ADDR"] != ":15014" {
		t.Errorf("agent told DaemonSet %q, metrics %q", env["AMBIENT_DAEMONSET_NAME"], env["AMBIENT_METRICS_ADDR"])
	}
	if p := o.ds.Spec.Template.Annotations["prometheus.io/port"]; p != "15014" {
		t.Errorf("scrape port %q, want 15014", p)
	}
	if o.sa.Name != "istio-cni-node" || !bytes.Contains(o.manifest, []byte(`resourceNames: ["istio-cni-node"]`)) {
		t.Errorf("ServiceAccount %s, Role %+v: want them named for the DaemonSet", o.sa.Name, o.role.Rules)
	}
	// An explicit port wins.
	o = decode(t, render(t, releaseName, namespace, "--set", "istioCompat.names=true", "--set", "agent.metricsPort=9100"))
	if got := o.env(t)["AMBIENT_METRICS_ADDR"]; got != ":9100" {
		t.Errorf("explicit metrics port: %q", got)
	}
}

// As a subchart (helm injects the parent's global into it), the chart
// renders with Istio's globals and reads those Istio's CNI chart reads.
func TestSubchartWithIstioGlobals(t *testing.T) {
	parent := t.TempDir()
	if err := os.WriteFile(filepath.Join(parent, "Chart.yaml"), []byte("apiVersion: v2\nname: mesh\nversion: 0.1.0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	values := "global: {hub: docker.io/istio, tag: 1.28.0, istioNamespace: istio-system, logging: {level: \"default:debug\"}}\nambient-cni: {profile: ambient, image: {repository: registry.example/ambient-cni}}\n"
	if err := os.WriteFile(filepath.Join(parent, "values.yaml"), []byte(values), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(filepath.Join(parent, "charts", "ambient-cni"), os.DirFS(filepath.Join(repoRoot(t), chartDir))); err != nil {
		t.Fatal(err)
	}
	out, err := helm(t, "template", releaseName, parent, "--namespace", namespace)
	if err != nil {
		t.Fatal(err)
	}
	wantEnv("AMBIENT_LOG_LEVEL", "debug")(t, decode(t, out))
}
