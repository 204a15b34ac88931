package deploy

import (
	"bufio"
	"bytes"
	"io"
	"net/netip"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// objects decodes a rendered manifest into typed objects.
type objects struct {
	ds   *appsv1.DaemonSet
	sa   *corev1.ServiceAccount
	cr   *rbacv1.ClusterRole
	crb  *rbacv1.ClusterRoleBinding
	role *rbacv1.Role
	rb   *rbacv1.RoleBinding
	// signal is the release's signal Service.
	signal *corev1.Service
	// rq is the ResourceQuota for the priority class, on the platforms
	// that need one (nil elsewhere).
	rq *corev1.ResourceQuota
	// policy and binding limit the agent's Node writes to the startup
	// taint (startupTaint.enabled only).
	policy   *admissionregistrationv1.ValidatingAdmissionPolicy
	binding  *admissionregistrationv1.ValidatingAdmissionPolicyBinding
	kinds    []string
	manifest []byte
	// pluginSA, pluginCR, pluginCRB, pluginRole and pluginRB are the
	// plugin's own identity (named <fullname>-plugin): get on pods,
	// namespaces and nodes, and on the agent's DaemonSet.
	pluginSA   *corev1.ServiceAccount
	pluginCR   *rbacv1.ClusterRole
	pluginCRB  *rbacv1.ClusterRoleBinding
	pluginRole *rbacv1.Role
	pluginRB   *rbacv1.RoleBinding
	// hooks are the helm hook objects (helm.sh/hook annotation), kept
	// apart: helm runs them around the release, they are not part of it.
	hooks []*unstructured.Unstructured
}

func decode(t testing.TB, manifest []byte) *objects {
	t.Helper()
	objs, err := kubeenv.ParseObjects(manifest)
	if err != nil {
		t.Fatal(err)
	}
	out := &objects{manifest: manifest}
	for _, o := range objs {
		if _, hook := o.GetAnnotations()["helm.sh/hook"]; hook {
			out.hooks = append(out.hooks, o)
			continue
		}
		if monitoringObject(o) {
			continue // monitoring_test.go checks the SRE kit
		}
		plugin := strings.HasSuffix(o.GetName(), "-plugin")
		if o.GetKind() != "ResourceQuota" && !plugin {
			out.kinds = append(out.kinds, o.GetKind())
		}
		var dst any
		switch kind := o.GetKind(); {
		case plugin && kind == "ServiceAccount":
			out.pluginSA = &corev1.ServiceAccount{}
			dst = out.pluginSA
		case plugin && kind == "ClusterRole":
			out.pluginCR = &rbacv1.ClusterRole{}
			dst = out.pluginCR
		case plugin && kind == "ClusterRoleBinding":
			out.pluginCRB = &rbacv1.ClusterRoleBinding{}
			dst = out.pluginCRB
		case plugin && kind == "Role":
			out.pluginRole = &rbacv1.Role{}
			dst = out.pluginRole
		case plugin && kind == "RoleBinding":
			out.pluginRB = &rbacv1.RoleBinding{}
			dst = out.pluginRB
		case plugin:
			t.Fatalf("unexpected %s %s in the manifest", kind, o.GetName())
		default:
			switch o.GetKind() {
			case "DaemonSet":
				out.ds = &appsv1.DaemonSet{}
				dst = out.ds
			case "ServiceAccount":
				out.sa = &corev1.ServiceAccount{}
				dst = out.sa
			case "ClusterRole":
				out.cr = &rbacv1.ClusterRole{}
				dst = out.cr
			case "ClusterRoleBinding":
				out.crb = &rbacv1.ClusterRoleBinding{}
				dst = out.crb
			case "Role":
				out.role = &rbacv1.Role{}
				dst = out.role
			case "RoleBinding":
				out.rb = &rbacv1.RoleBinding{}
				dst = out.rb
			case "ResourceQuota":
				out.rq = &corev1.ResourceQuota{}
				dst = out.rq
			case "Service":
				out.signal = &corev1.Service{}
				dst = out.signal
			case "ValidatingAdmissionPolicy":
				out.policy = &admissionregistrationv1.ValidatingAdmissionPolicy{}
				dst = out.policy
			case "ValidatingAdmissionPolicyBinding":
				out.binding = &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
				dst = out.binding
			default:
				t.Fatalf("unexpected %s %s in the manifest", o.GetKind(), o.GetName())
			}
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, dst, true); err != nil {
			t.Fatalf("%s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	slices.Sort(out.kinds)
	want := []string{"ClusterRole", "ClusterRoleBinding", "DaemonSet", "Role", "RoleBinding", "Service", "ServiceAccount"}
	if out.policy != nil || out.binding != nil {
		want = []string{"ClusterRole", "ClusterRoleBinding", "DaemonSet", "Role", "RoleBinding", "Service", "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
	}
	if !slices.Equal(out.kinds, want) {
		t.Fatalf("manifest holds %v, want one each of %v", out.kinds, want)
	}
	if out.pluginSA == nil || out.pluginCR == nil || out.pluginCRB == nil || out.pluginRole == nil || out.pluginRB == nil {
		t.Fatalf("manifest lacks the plugin's ServiceAccount, ClusterRole, ClusterRoleBinding, Role or RoleBinding")
	}
	return out
}

func (o *objects) container(t testing.TB) corev1.Container {
	t.Helper()
	cs := o.ds.Spec.Template.Spec.Containers
	if len(cs) != 1 || len(o.ds.Spec.Template.Spec.InitContainers) != 0 {
		t.Fatalf("want exactly one container, got %d (+%d init)", len(cs), len(o.ds.Spec.Template.Spec.InitContainers))
	}
	return cs[0]
}

// downward stands in for the kubelet's downward API.
var downward = map[string]string{"spec.nodeName": "node-a", "metadata.name": "agent-x1"}

// env resolves the container's environment as the kubelet would.
func (o *objects) env(t testing.TB) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, e := range o.container(t).Env {
		if _, dup := m[e.Name]; dup {
			t.Errorf("env %s is set twice", e.Name)
		}
		switch {
		case e.ValueFrom == nil:
			m[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace":
			m[e.Name] = o.ds.Namespace
		case e.ValueFrom.FieldRef != nil && downward[e.ValueFrom.FieldRef.FieldPath] != "":
			m[e.Name] = downward[e.ValueFrom.FieldRef.FieldPath]
		default:
			t.Errorf("env %s: unexpected source %+v", e.Name, e.ValueFrom)
		}
	}
	return m
}

// config parses the container's environment with install-cni's own code.
func (o *objects) config(t testing.TB) *app.Config {
	t.Helper()
	env := o.env(t)
	c, err := app.Parse(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatalf("install-cni refuses the rendered environment: %v", err)
	}
	return c
}

// settings reads install-cni's settings table (flag and variable of every
// option) from the documentation install-cni's settings table renders.
func settings(t testing.TB) map[string]string {
	t.Helper()
	var doc bytes.Buffer
	if err := app.WriteMarkdown(&doc); err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("^\\| `--([a-z0-9-]+)` \\| `([A-Z0-9_]+)` \\|")
	out := map[string]string{}
	sc := bufio.NewScanner(&doc)
	for sc.Scan() {
		if m := row.FindStringSubmatch(sc.Text()); m != nil {
			if app.EnvName(m[1]) != m[2] {
				t.Fatalf("table row %q: EnvName(%s) = %s", sc.Text(), m[1], app.EnvName(m[1]))
			}
			out[m[2]] = m[1]
		}
	}
	if len(out) < 20 {
		t.Fatalf("only %d settings parsed from install-cni's table", len(out))
	}
	return out
}

// notInChart lists the settings the chart deliberately leaves to their
// defaults, with the reason.
var notInChart = map[string]string{
	"AMBIENT_KUBECONFIG":                  "the agent uses its ServiceAccount (in-cluster configuration); extraEnv can still set it",
	"AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE": "as in Istio, whose chart has no value for it either: the variable, set with extraEnv",
	"AMBIENT_ISTIO_CNI_RUN_DIR":           "set only with migration.fromIstioCNI.enabled, for the switch from istio-cni",
	"AMBIENT_ISTIO_CNI_DAEMONSET":         "set only with migration.fromIstioCNI.enabled, for the switch from istio-cni",
}

// Every AMBIENT_* variable the chart sets is a real setting of install-cni,
// every setting is set by the chart (or deliberately left out), and
// install-cni accepts the rendered values.
func TestEnvNamesAreKnownSettings(t *testing.T) {
	known := settings(t)
	for name, manifest := range map[string][]byte{
		"defaults":   render(t, releaseName, namespace),
		"all values": render(t, "all", "all-values-ns", "-f", allValues),
	} {
		o := decode(t, manifest)
		env := o.env(t)
		for k := range env {
			if !strings.HasPrefix(k, app.EnvPrefix) {
				if name == "defaults" {
					t.Errorf("%s: unexpected non-AMBIENT variable %s", name, k)
				}
				continue
			}
			if _, ok := known[k]; !ok {
				t.Errorf("%s: the chart sets %s, which install-cni does not read", name, k)
			}
		}
		for k := range known {
			_, set := env[k]
			if _, skip := notInChart[k]; skip && name == "defaults" {
				if set {
					t.Errorf("%s: %s is listed as not set by the chart, but it is", name, k)
				}
				continue
			}
			if !set && notInChart[k] == "" {
				t.Errorf("%s: install-cni reads %s but the chart does not set it", name, k)
			}
		}
		o.config(t)
	}
}

// With default values the chart configures install-cni exactly as its own
// defaults do, except where the container's view differs on purpose.
func TestChartDefaultsMatchProcessDefaults(t *testing.T) {
	o := decode(t, render(t, releaseName, namespace))
	got := o.config(t)
	want, err := app.Parse([]string{"--node-name=node-a"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want.PodName = "agent-x1"
	want.PodNamespace = namespace
	want.ProcRoot = "/host/proc" // the host's /proc, mounted read-only
	// The host's name of the mounted config directory, which the process
	// cannot know: the platform's (generic).
	want.CNIHostConfDir = "/etc/cni/net.d"
	// The plugin's ServiceAccount and the release's signal are named for
	// the release (the process has no release: no signal by default).
	want.PluginServiceAccount = releaseName + "-plugin"
	want.ReleaseSignal = releaseName + "-installed"
	// The selector setting as given (JSON from the chart): its meaning is
	// compared through EnablementSelectors.
	want.EnablementSelectorText = got.EnablementSelectorText
	if !reflect.DeepEqual(got, want) {
		t.Errorf("chart defaults differ from install-cni's:\n got %+v\nwant %+v", got, want)
	}
}

// Istio's namespace is the control plane's whatever the release namespace:
// a release in kube-system (as GKE installs often are) still lets istiod,
// ztunnel and Istio's gateways start while the agent cannot answer; a
// platform's system namespaces come on top.
func TestControlPlaneNamespacesNamed(t *testing.T) {
	for _, c := range []struct {
		ns    string
		extra []string
		want  []string
	}{
		{"kube-system", nil, []string{"istio-system", "kube-system"}},
		{namespace, nil, []string{"istio-system"}},
		{"mesh", []string{"--set", "platform=openshift"}, []string{"istio-system", "mesh", "openshift-*"}},
	} {
		if got := decode(t, render(t, releaseName, c.ns, c.extra...)).config(t).ControlPlane(); !slices.Equal(got, c.want) {
			t.Errorf("release in %s %v: control-plane namespaces %v, want %v", c.ns, c.extra, got, c.want)
		}
	}
}

// The shipped agentDownAfter is 2m, in the chart and in the plugin alike:
// longer than an agent restart or upgrade takes (pods to capture are never
// let through during one), short enough that pods outside the mesh start
// soon when the agent is really gone. Tests that shorten it (the real
// node's outage case) rely on this one to keep the default honest.
func TestShippedAgentDownAfter(t *testing.T) {
	if got := decode(t, render(t, releaseName, namespace)).config(t).AgentDownAfter; got != 2*time.Minute {
		t.Errorf("the chart's default agentDownAfter reaches install-cni as %s, want 2m", got)
	}
	if ambient.DefaultAgentDownAfter != 2*time.Minute {
		t.Errorf("the plugin's default agentDownAfter is %s, want 2m", ambient.DefaultAgentDownAfter)
	}
}

// Every value of the all-values file lands in the configuration install-cni
// parses.
func TestAllValuesReachTheProcess(t *testing.T) {
	o := decode(t, render(t, "all", "all-values-ns", "-f", allValues))
	got := o.config(t)
	want := &app.Config{
		NodeName: "node-a", PodName: "agent-x1", PodNamespace: "all-values-ns",
		DaemonSet: "mesh-node", ReleaseSignal: "ambient-cni-all-installed", Kubeconfig: "/etc/mesh/kubeconfig",
		CNIBinDir: "/host/opt/cni/bin", CNIExtraBinDirs: []string{"/host/extra-cni-bin/opt/cni/bin", "/host/extra-cni-bin/usr/libexec/cni"}, CNIConfDir: "/host/etc/cni/net.d", CNIHostConfDir: "/etc/cni/custom.d", CNIConfName: "10-primary.conflist",
		CNIOwnedConfig: true, CNIOwnedConfName: "01-mesh.conflist", CNIChainInNetworkFolder: true,
		IstioCNIRunDir: "/run/istio-cni-all-values", IstioCNIDaemonSet: "istio-cni-all-values",
		PluginType: "mesh-cni", PluginBinary: "/custom/plugins/ambient-cni",
		PluginTimeout: 45 * time.Second, PluginLogLevel: "debug", StatusChecksAgent: true, AgentUnreachable: "fail-closed", AgentDownAfter: 5 * time.Minute,
		AgentSocket: "/var/run/mesh-agent/agent.sock", StateDir: "/var/lib/mesh-agent", ZDSSocket: "/var/run/ztunnel-custom/zds.sock",
		ProcRoot: "/host/proc", NetnsDirs: []string{"/var/run/custom-netns", "/run/custom/netns"},
		ExcludedNamespaces:  []string{"kube-system", "istio-system", "monitoring"},
		DataPlaneNamespaces: []string{"all-values-ns", "ztunnel-system"},
		ZtunnelWait:         7 * time.Second, VerifyPeriod: 30 * time.Second, DNSCapture: false,
		RulesBackend: rulesbackend.Selection{Choice: rulesbackend.IPTables, Flavour: iptables.BackendNFT},
		ProbeSNATv4:  netip.MustParseAddr("169.254.7.42"), ProbeSNATv6: netip.MustParseAddr("fd16::42"),
		HealthAddr: ":15999", MetricsAddr: ":15998", LogLevel: "debug", LogFormat: "json", KubeClientQPS: 12.5, KubeClientBurst: 25, AnnotationQPS: 7.5, AnnotationBurst: 15,
		StartupTaint: true, StartupTaintOnShutdown: true,
		// No chart value (Istio has none): install-cni's default, on.
		AWSBranchENIProbe:      true,
		ControlPlaneNamespaces: []string{"openshift-*", "platform-system"}, PluginServiceAccount: "mesh-node-plugin", PluginTokenLifetime: 12 * time.Hour,
	}
	sel, err := enablement.ParseSelectors([]byte(`[{namespaceSelector: {matchLabels: {mesh: "yes"}}}, {podSelector: {matchExpressions: [{key: team, operator: In, values: [payments]}]}}]`))
	if err != nil {
		t.Fatal(err)
	}
	want.EnablementSelectors = sel
	want.EnablementSelectorText = got.EnablementSelectorText
	if !reflect.DeepEqual(got, want) {
		t.Errorf("all-values configuration\n got %+v\nwant %+v", got, want)
	}
}

// hostPaths are the host side of what install-cni touches, per values.
type hostPaths struct {
	binDir, confDir, agentDir, ztunnelDir, xtablesLock string
	netnsDirs                                          []string
	extraBinDirs                                       []string
}

// Every path install-cni is configured with is backed by the right host
// mount; the plugin binary comes from the image, not the host.
func TestMountsBackEveryPath(t *testing.T) {
	cases := map[string]struct {
		manifest []byte
		host     hostPaths
	}{
		"defaults": {render(t, releaseName, namespace), hostPaths{
			"/opt/cni/bin", "/etc/cni/net.d", "/var/run/ambient-cni", "/var/run/ztunnel", "/run/xtables.lock",
			[]string{"/var/run/netns", "/run/netns", "/run/containerd/io.containerd.grpc.v1.cri/netns"}, nil}},
		"all values": {render(t, "all", "all-values-ns", "-f", allValues), hostPaths{
			"/home/kubernetes/bin", "/etc/cni/custom.d", "/var/run/mesh-agent", "/var/run/ztunnel-custom", "/var/run/xtables-custom.lock",
			[]string{"/var/run/custom-netns", "/run/custom/netns"}, []string{"/opt/cni/bin", "/usr/libexec/cni"}}},
		// A runtime's search list (containerd 2.x bin_dirs) on the generic
		// layout: each extra dir is its own host mount.
		"extra bin dirs": {render(t, releaseName, namespace, "--set", "cni.extraBinDirs={/usr/libexec/cni,/var/lib/cni/bin}"), hostPaths{
			"/opt/cni/bin", "/etc/cni/net.d", "/var/run/ambient-cni", "/var/run/ztunnel", "/run/xtables.lock",
			[]string{"/var/run/netns", "/run/netns", "/run/containerd/io.containerd.grpc.v1.cri/netns"}, []string{"/usr/libexec/cni", "/var/lib/cni/bin"}}},
	}
	for name, c := range cases {
		o := decode(t, c.manifest)
		cfg := o.config(t)
		ctr := o.container(t)
		vols := map[string]corev1.Volume{}
		for _, v := range o.ds.Spec.Template.Spec.Volumes {
			vols[v.Name] = v
		}
		// mountOf finds the mount holding a container path.
		mountOf := func(p string) (corev1.VolumeMount, *corev1.HostPathVolumeSource) {
			var best corev1.VolumeMount
			for _, m := range ctr.VolumeMounts {
				if (p == m.MountPath || strings.HasPrefix(p, m.MountPath+"/")) && len(m.MountPath) > len(best.MountPath) {
					best = m
				}
			}
			return best, vols[best.Name].HostPath
		}
		check := func(what, containerPath, wantHost string, wantType corev1.HostPathType, readOnly bool) {
			t.Helper()
			m, hp := mountOf(containerPath)
			switch {
			case hp == nil:
				t.Errorf("%s: %s %s is on no host mount", name, what, containerPath)
			case hp.Path != wantHost:
				t.Errorf("%s: %s %s comes from host %s, want %s", name, what, containerPath, hp.Path, wantHost)
			case hp.Type == nil || *hp.Type != wantType:
				t.Errorf("%s: %s host path type %v, want %s", name, what, hp.Type, wantType)
			case m.ReadOnly != readOnly:
				t.Errorf("%s: %s mount readOnly=%v, want %v", name, what, m.ReadOnly, readOnly)
			}
		}
		check("cni bin dir", cfg.CNIBinDir, c.host.binDir, corev1.HostPathDirectoryOrCreate, false)
		check("cni conf dir", cfg.CNIConfDir, c.host.confDir, corev1.HostPathDirectoryOrCreate, false)
		// The plugin is kept in every dir of the runtime's list, each
		// written through a mount of exactly that host dir.
		if len(cfg.CNIExtraBinDirs) != len(c.host.extraBinDirs) {
			t.Errorf("%s: extra bin dirs %v, want one per host dir %v", name, cfg.CNIExtraBinDirs, c.host.extraBinDirs)
		}
		for k, d := range cfg.CNIExtraBinDirs {
			if k < len(c.host.extraBinDirs) {
				check("extra cni bin dir", d, c.host.extraBinDirs[k], corev1.HostPathDirectoryOrCreate, false)
			}
		}
		check("proc root", cfg.ProcRoot, "/proc", corev1.HostPathDirectory, true)
		check("xtables lock", "/run/xtables.lock", c.host.xtablesLock, corev1.HostPathFileOrCreate, false)
		// The plugin on the host dials the socket path the agent listens
		// on, so the container sees the socket dir at its host path.
		check("agent socket dir", filepath.Dir(cfg.AgentSocket), c.host.agentDir, corev1.HostPathDirectoryOrCreate, false)
		if filepath.Dir(cfg.AgentSocket) != c.host.agentDir {
			t.Errorf("%s: agent socket %s is not in host dir %s", name, cfg.AgentSocket, c.host.agentDir)
		}
		check("ZDS socket dir", filepath.Dir(cfg.ZDSSocket), c.host.ztunnelDir, corev1.HostPathDirectoryOrCreate, false)
		// The runtime hands the plugin host paths of netns mounts; the
		// agent opens them at the same path, seeing later mounts.
		if !slices.Equal(cfg.NetnsDirs, c.host.netnsDirs) {
			t.Errorf("%s: netns dirs %v, want %v", name, cfg.NetnsDirs, c.host.netnsDirs)
		}
		for _, d := range cfg.NetnsDirs {
			check("netns dir", d, d, corev1.HostPathDirectoryOrCreate, true)
			if m, _ := mountOf(d); m.MountPath != d || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer {
				t.Errorf("%s: netns dir %s mount %+v: want it at the same path with HostToContainer propagation", name, d, m)
			}
		}
		if _, hp := mountOf(cfg.PluginBinary); hp != nil {
			t.Errorf("%s: plugin binary %s is on a host mount; it must come from the image", name, cfg.PluginBinary)
		}
		for _, m := range ctr.VolumeMounts {
			if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
				t.Errorf("%s: %s: Bidirectional propagation needs a privileged container", name, m.Name)
			}
		}
	}
}

// The DaemonSet has the shape issue 6 asks for.
func TestDaemonSetShape(t *testing.T) {
	o := decode(t, render(t, releaseName, namespace))
	spec := o.ds.Spec.Template.Spec
	ctr := o.container(t)
	cfg := o.config(t)

	if !spec.HostNetwork || spec.HostPID || spec.HostIPC {
		t.Errorf("hostNetwork=%v hostPID=%v hostIPC=%v: want only the host network", spec.HostNetwork, spec.HostPID, spec.HostIPC)
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}
	if len(spec.Tolerations) != 1 || spec.Tolerations[0].Operator != corev1.TolerationOpExists || spec.Tolerations[0].Key != "" || spec.Tolerations[0].Effect != "" {
		t.Errorf("tolerations %+v: want to tolerate every taint", spec.Tolerations)
	}
	if s := o.ds.Spec.UpdateStrategy; s.Type != appsv1.RollingUpdateDaemonSetStrategyType || s.RollingUpdate == nil || s.RollingUpdate.MaxUnavailable.String() != "1" {
		t.Errorf("update strategy %+v: want a rolling update, one node at a time", s)
	}
	if spec.ServiceAccountName != o.sa.Name || o.sa.Namespace != o.ds.Namespace {
		t.Errorf("serviceAccountName %q, ServiceAccount %s/%s", spec.ServiceAccountName, o.sa.Namespace, o.sa.Name)
	}
	if o.ds.Name != cfg.DaemonSet || o.ds.Namespace != namespace {
		t.Errorf("DaemonSet %s/%s, agent told %s", o.ds.Namespace, o.ds.Name, cfg.DaemonSet)
	}
	labels := o.ds.Spec.Template.Labels
	if labels["istio.io/dataplane-mode"] != "none" || labels["sidecar.istio.io/inject"] != "false" {
		t.Errorf("pod labels %v: want it out of the mesh", labels)
	}
	for k, v := range o.ds.Spec.Selector.MatchLabels {
		if labels[k] != v {
			t.Errorf("selector %s=%s does not match the pod template", k, v)
		}
	}

	sc := ctr.SecurityContext
	if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 || (sc.Privileged != nil && *sc.Privileged) {
		t.Fatalf("security context %+v: want root, not privileged", sc)
	}
	if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("capabilities %+v: want ALL dropped", sc.Capabilities)
	} else {
		add := slices.Clone(sc.Capabilities.Add)
		slices.Sort(add)
		if want := []corev1.Capability{"DAC_READ_SEARCH", "NET_ADMIN", "NET_RAW", "SYS_ADMIN", "SYS_PTRACE"}; !slices.Equal(add, want) {
			t.Errorf("added capabilities %v, want %v", add, want)
		}
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("root filesystem writable")
	}
	// The runtime's default seccomp profile, not Unconfined: the agent's
	// syscalls need nothing it refuses a container holding SYS_ADMIN
	// (TestRealNodeAlerts runs the chart's defaults on containerd).
	if sp := sc.SeccompProfile; sp == nil || sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccompProfile %+v, want RuntimeDefault", sp)
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("privilege escalation allowed")
	}

	// Both probes exec install-cni probe, which asks the debug socket:
	// the agent holds no health port another hostNetwork pod could take.
	for which, p := range map[string]*corev1.Probe{"ready": ctr.ReadinessProbe, "live": ctr.LivenessProbe} {
		if p == nil || p.Exec == nil || p.HTTPGet != nil || p.TCPSocket != nil {
			t.Errorf("%s probe %+v: want an exec probe", which, p)
			continue
		}
		if want := []string{ctr.Command[0], "probe", which}; !slices.Equal(p.Exec.Command, want) {
			t.Errorf("%s probe runs %q, want %q", which, p.Exec.Command, want)
		}
		// The subcommand takes the arguments (it fails only for the
		// missing agent) and gives up inside kubelet's timeout.
		var stderr strings.Builder
		err := app.ProbeMain(p.Exec.Command[2:], func(k string) string {
			if k == app.EnvName("agent-socket") {
				return filepath.Join(t.TempDir(), "agent.sock")
			}
			return ""
		}, io.Discard, &stderr)
		if err == nil || strings.Contains(err.Error(), "want live or ready") {
			t.Errorf("install-cni %q with no agent: %v %s; want it to try the socket and fail", p.Exec.Command[1:], err, stderr.String())
		}
		if p.TimeoutSeconds < 5 {
			t.Errorf("%s probe timeoutSeconds %d: below the probe command's own 4 s", which, p.TimeoutSeconds)
		}
	}
	if cfg.AgentSocket == "" {
		t.Error("the container's environment does not name the agent socket the probes need")
	}
	if cfg.HealthAddr != "" {
		t.Errorf("health served on %q by default; want no TCP port", cfg.HealthAddr)
	}
	for _, p := range ctr.Ports {
		if p.Name == "health" {
			t.Errorf("a health container port %d by default", p.ContainerPort)
		}
	}
}

// istioPorts are the well-known ports of Istio's components on a node
// (istiod, proxies, ztunnel, gateways): none of our defaults may use one.
var istioPorts = []int{15000, 15001, 15004, 15006, 15008, 15009, 15010, 15012, 15014, 15017, 15020, 15021, 15053, 15090}

// /metrics has its own named container port, the one the agent listens
// on, and the scrape annotations point at it (off in all-values); the
// debug endpoints have no port at all (a root-only socket).
func TestMetricsPort(t *testing.T) {
	for name, c := range map[string]struct {
		manifest    []byte
		annotations bool
	}{
		"defaults":   {render(t, releaseName, namespace), true},
		"all values": {render(t, "all", "all-values-ns", "-f", allValues), false},
	} {
		o := decode(t, c.manifest)
		cfg := o.config(t)
		var metrics int32
		for _, p := range o.container(t).Ports {
			if p.Name == "metrics" {
				metrics = p.ContainerPort
			}
			if strings.Contains(p.Name, "debug") {
				t.Errorf("%s: a %s port: the debug endpoints must not be reachable over the network", name, p.Name)
			}
		}
		if want := ":" + strconv.Itoa(int(metrics)); metrics == 0 || cfg.MetricsAddr != want || cfg.MetricsAddr == cfg.HealthAddr {
			t.Errorf("%s: metrics container port %d, agent serves /metrics on %q (health on %q)", name, metrics, cfg.MetricsAddr, cfg.HealthAddr)
		}
		if name == "defaults" && slices.Contains(istioPorts, int(metrics)) {
			t.Errorf("default metrics port %d is one of Istio's", metrics)
		}
		ann := o.ds.Spec.Template.Annotations
		scrape := ann["prometheus.io/scrape"] == "true" && ann["prometheus.io/port"] == strconv.Itoa(int(metrics)) && ann["prometheus.io/path"] == "/metrics"
		if scrape != c.annotations {
			t.Errorf("%s: scrape annotations %v, want them %v", name, ann, c.annotations)
		}
	}
}

// TestOldBackendValue: the chart's old value name for the rules backend
// still reaches install-cni, and wins over the new one when set.
func TestOldBackendValue(t *testing.T) {
	for args, want := range map[[4]string]string{
		{"--set", "agent.rulesBackend=nftables", "--set", "agent.logLevel=info"}:       "nftables",
		{"--set", "agent.iptablesBackend=legacy", "--set", "agent.logLevel=info"}:      "legacy",
		{"--set", "agent.iptablesBackend=nft", "--set", "agent.rulesBackend=iptables"}: "nft",
	} {
		env := decode(t, render(t, releaseName, namespace, args[:]...)).env(t)
		if got := env[app.EnvName("rules-backend")]; got != want {
			t.Errorf("%v: %s=%q, want %q", args, app.EnvName("rules-backend"), got, want)
		}
	}
}
