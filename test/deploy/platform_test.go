package deploy

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// platforms are the chart's platform values (files/platforms.yaml); the
// schema accepts exactly these and the empty one.
var platforms = []string{"gke", "eks", "k3s", "k3d", "microk8s", "minikube", "openshift", "kind"}

// genericNetns is where the generic layout looks for pod namespaces.
var genericNetns = []string{"/var/run/netns", "/run/netns", "/run/containerd/io.containerd.grpc.v1.cri/netns"}

// platformGolden is the checked-in render of one platform.
func platformGolden(name string) string {
	return filepath.Join("test", "deploy", "testdata", "platform-"+name+".yaml")
}

// renderPlatform renders the release as the plain manifest is rendered,
// with the platform value and extra arguments.
func renderPlatform(t testing.TB, name string, extra ...string) []byte {
	t.Helper()
	return render(t, releaseName, namespace, append([]string{"--no-hooks", "--set", "platform=" + name}, extra...)...)
}

// TestPlatformGoldens keeps testdata/platform-*.yaml equal to the chart's
// render of each platform, so a change to a platform's objects shows in
// review. `make manifests` runs it with UPDATE_MANIFESTS=1 to rewrite them.
func TestPlatformGoldens(t *testing.T) {
	for _, name := range platforms {
		want := renderPlatform(t, name)
		path := filepath.Join(repoRoot(t), platformGolden(name))
		if os.Getenv("UPDATE_MANIFESTS") == "1" {
			if err := os.WriteFile(path, want, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("wrote %s", platformGolden(name))
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Errorf("%v; run make manifests", err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is not what the chart renders for platform %s (first difference at line %d); run make manifests", platformGolden(name), name, firstDiffLine(got, want))
		}
	}
}

// platformWant is what a platform must give the agent and the cluster.
type platformWant struct {
	binDir, confDir string
	netnsDirs       []string
	quota           bool   // a ResourceQuota for the priority class
	seLinuxType     string // the container's SELinux type
	scc             bool   // the ClusterRole may use the privileged SCC
}

var generic = platformWant{binDir: "/opt/cni/bin", confDir: "/etc/cni/net.d", netnsDirs: genericNetns}

// Each platform mounts the host directories its runtime uses, and adds the
// objects and settings its cluster needs, on top of an otherwise generic
// DaemonSet that install-cni accepts.
func TestPlatformLayouts(t *testing.T) {
	k3sConf := "/var/lib/rancher/k3s/agent/etc/cni/net.d"
	cases := map[string]struct {
		args []string
		want platformWant
	}{
		"generic": {nil, generic},
		"gke":     {[]string{"--set", "platform=gke"}, platformWant{binDir: "/home/kubernetes/bin", confDir: "/etc/cni/net.d", netnsDirs: genericNetns, quota: true}},
		// A -gke cluster version selecting gke is not among these: helm
		// template drops the version's pre-release part (-gke.N) of
		// --kube-version; TestGKEDetectedFromClusterVersion renders
		// against a cluster that reports it.
		"gke, version without -gke": {[]string{"--kube-version", "v1.33.5"}, generic},
		"eks":                       {[]string{"--set", "platform=eks"}, generic},
		"kind":                      {[]string{"--set", "platform=kind"}, generic},
		"k3s":                       {[]string{"--set", "platform=k3s"}, platformWant{binDir: "/var/lib/rancher/k3s/data/cni", confDir: k3sConf, netnsDirs: genericNetns}},
		"k3d":                       {[]string{"--set", "platform=k3d"}, platformWant{binDir: "/bin", confDir: k3sConf, netnsDirs: genericNetns}},
		"microk8s":                  {[]string{"--set", "platform=microk8s"}, platformWant{binDir: "/var/snap/microk8s/current/opt/cni/bin", confDir: "/var/snap/microk8s/current/args/cni-network", netnsDirs: genericNetns}},
		"minikube":                  {[]string{"--set", "platform=minikube"}, platformWant{binDir: "/opt/cni/bin", confDir: "/etc/cni/net.d", netnsDirs: append(slices.Clone(genericNetns), "/var/run/docker/netns")}},
		"openshift":                 {[]string{"--set", "platform=openshift"}, platformWant{binDir: "/var/lib/cni/bin", confDir: "/etc/kubernetes/cni/net.d", netnsDirs: genericNetns, seLinuxType: "spc_t", scc: true}},
		// Explicit values win over the platform's.
		"k3s, own bin dir": {[]string{"--set", "platform=k3s", "--set", "cni.binDir=/opt/k3s-cni"}, platformWant{binDir: "/opt/k3s-cni", confDir: k3sConf, netnsDirs: genericNetns}},
		"gke, no quota":    {[]string{"--set", "platform=gke", "--set", "resourceQuotas.enabled=false"}, platformWant{binDir: "/home/kubernetes/bin", confDir: "/etc/cni/net.d", netnsDirs: genericNetns}},
		"openshift, own SELinux type": {[]string{"--set", "platform=openshift", "--set", "securityContext.seLinuxOptions.type=container_runtime_t", "--set", "cni.netnsDirs={/run/netns}"},
			platformWant{binDir: "/var/lib/cni/bin", confDir: "/etc/kubernetes/cni/net.d", netnsDirs: []string{"/run/netns"}, seLinuxType: "container_runtime_t", scc: true}},
		"generic, quota": {[]string{"--set", "resourceQuotas.enabled=true", "--set", "resourceQuotas.pods=7"}, platformWant{binDir: "/opt/cni/bin", confDir: "/etc/cni/net.d", netnsDirs: genericNetns, quota: true}},
	}
	for name, c := range cases {
		o := decode(t, render(t, releaseName, namespace, c.args...))
		cfg := o.config(t) // install-cni accepts what it is given
		vols := map[string]string{}
		for _, v := range o.ds.Spec.Template.Spec.Volumes {
			if v.HostPath != nil {
				vols[v.Name] = v.HostPath.Path
			}
		}
		if vols["cni-bin-dir"] != c.want.binDir || vols["cni-conf-dir"] != c.want.confDir {
			t.Errorf("%s: host bin dir %s, conf dir %s; want %s, %s", name, vols["cni-bin-dir"], vols["cni-conf-dir"], c.want.binDir, c.want.confDir)
		}
		if !slices.Equal(cfg.NetnsDirs, c.want.netnsDirs) {
			t.Errorf("%s: netns dirs %v, want %v", name, cfg.NetnsDirs, c.want.netnsDirs)
		}
		for _, d := range c.want.netnsDirs {
			if !slices.Contains(mapValues(vols), d) {
				t.Errorf("%s: netns dir %s is not mounted", name, d)
			}
		}
		if got := o.rq != nil; got != c.want.quota {
			t.Errorf("%s: ResourceQuota rendered: %v, want %v", name, got, c.want.quota)
		}
		if o.rq != nil {
			checkQuota(t, name, o.rq, o.ds.Spec.Template.Spec.PriorityClassName)
		}
		var seType string
		if sc := o.container(t).SecurityContext; sc != nil && sc.SELinuxOptions != nil {
			seType = sc.SELinuxOptions.Type
		}
		if seType != c.want.seLinuxType {
			t.Errorf("%s: SELinux type %q, want %q", name, seType, c.want.seLinuxType)
		}
		// No platform loosens the agent's confinement.
		if sc := o.container(t).SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault ||
			sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("%s: security context %+v: want the RuntimeDefault seccomp profile and a read-only root", name, sc)
		}
		var scc bool
		for _, r := range o.cr.Rules {
			if slices.Contains(r.APIGroups, "security.openshift.io") {
				scc = slices.Equal(r.Resources, []string{"securitycontextconstraints"}) && slices.Equal(r.ResourceNames, []string{"privileged"}) && slices.Equal(r.Verbs, []string{"use"})
				if !scc {
					t.Errorf("%s: SCC rule %+v, want use of privileged only", name, r)
				}
			}
		}
		if scc != c.want.scc {
			t.Errorf("%s: ClusterRole may use the privileged SCC: %v, want %v", name, scc, c.want.scc)
		}
		if got := o.ds.Spec.Template.Labels["k8s-app"]; got != "istio-cni-node" {
			t.Errorf("%s: pod label k8s-app=%q, want istio-cni-node (istiod's node untaint controller looks for it)", name, got)
		}
	}
}

func mapValues(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// checkQuota: the quota admits the DaemonSet's priority class in the
// release namespace.
func checkQuota(t *testing.T, name string, rq *corev1.ResourceQuota, class string) {
	t.Helper()
	if rq.Namespace != namespace {
		t.Errorf("%s: ResourceQuota in namespace %q, want %q", name, rq.Namespace, namespace)
	}
	sel := rq.Spec.ScopeSelector
	if sel == nil || len(sel.MatchExpressions) != 1 {
		t.Fatalf("%s: ResourceQuota scope selector %+v, want one expression", name, sel)
	}
	e := sel.MatchExpressions[0]
	if e.ScopeName != corev1.ResourceQuotaScopePriorityClass || e.Operator != corev1.ScopeSelectorOpIn || !slices.Equal(e.Values, []string{class}) {
		t.Errorf("%s: ResourceQuota scope %+v, want PriorityClass In [%s]", name, e, class)
	}
	if _, ok := rq.Spec.Hard[corev1.ResourcePods]; !ok {
		t.Errorf("%s: ResourceQuota has no pods limit", name)
	}
}

// An unknown platform is refused by the schema, naming the ones there are.
func TestUnknownPlatformRefused(t *testing.T) {
	_, err := helm(t, "template", releaseName, chartDir, "--namespace", namespace, "--set", "platform=aks")
	if err == nil {
		t.Fatal("platform=aks rendered")
	}
	for _, want := range append([]string{"platform"}, platforms...) {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not mention %q: %v", want, err)
		}
	}
}
