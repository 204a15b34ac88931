package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// IstiodTool is the tools-cache directory hack/kube-tools.sh builds from
// Istio's source: pilot-discovery, the CRDs of Istio's base chart
// (crd-all.gen.yaml) and istiod's chart (istio-discovery), of the minor
// the tests run (kubeenv.IstioTool).
func IstiodTool() string { return kubeenv.IstioTool("istiod") }

// IstiodRelease is the helm release name istiod's chart is rendered with,
// as Istio's ambient install names it.
const IstiodRelease = "istiod"

// IstiodOptions tune StartIstiod.
type IstiodOptions struct {
	// Untaint turns on istiod's node-untaint controller, as the chart's
	// taint.enabled does (PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS).
	Untaint bool
}

// Istiod is Istio's control plane (pilot-discovery) run as a host process
// the way its chart runs it for ambient, against the node's API server:
// the chart is rendered with profile=ambient and istiod gets the
// rendered container's arguments and environment, the RBAC of its
// ServiceAccount, and the mesh config. It makes its own self-signed CA.
// Every listener is on loopback; nothing reaches off the machine.
type Istiod struct {
	// Dir is istiod's working directory (its ./etc/istio/config holds the
	// rendered mesh config) and holds its log, istiod.log.
	Dir string
	// HTTPPort serves /ready and the debug endpoints (the chart's 8080).
	HTTPPort int

	proc *childproc.Proc
	n    *Node
}

// IstiodDir returns the built IstiodTool directory, or an error naming
// the command that builds it. AMBIENT_TOOL_ISTIOD (AMBIENT_TOOL_ISTIOD_1_29
// for a minor) overrides it.
func IstiodDir(repo string) (string, error) {
	d, err := toolPath(repo, IstiodTool())
	if err != nil {
		return "", fmt.Errorf("istiod not built (%v); build it with hack/kube-tools.sh %s", err, IstiodTool())
	}
	return d, nil
}

// istiodRender is what StartIstiod takes from the rendered chart.
type istiodRender struct {
	container corev1.Container
	// serviceAccount is the pod's; roles are the RBAC roles the chart binds
	// to it, as a YAML stream for kubeenv's ServiceAccountConfig.
	serviceAccount string
	roles          []byte
	// mesh holds the data of the chart's "istio" ConfigMap (mesh,
	// meshNetworks), which the Deployment mounts at /etc/istio/config.
	mesh map[string]string
}

// StartIstiod applies Istio's CRDs, renders istiod's chart, starts
// pilot-discovery and waits until it is ready. Stop it with Stop; the
// node's Down kills it if its owner forgot.
func (n *Node) StartIstiod(ctx context.Context, o IstiodOptions) (*Istiod, error) {
	tool, err := IstiodDir(n.Tools.Repo)
	if err != nil {
		return nil, err
	}
	i := &Istiod{Dir: filepath.Join(n.Dir, "istiod")}
	if err := os.MkdirAll(filepath.Join(i.Dir, "etc", "istio", "config"), 0o755); err != nil {
		return nil, err
	}
	crds, err := os.ReadFile(filepath.Join(tool, "crd-all.gen.yaml"))
	if err != nil {
		return nil, fmt.Errorf("istio CRDs: %w", err)
	}
	if err := n.applyCRDs(ctx, crds); err != nil {
		return nil, err
	}
	r, err := n.renderIstiod(ctx, filepath.Join(tool, "istio-discovery"), o)
	if err != nil {
		return nil, err
	}
	for k, v := range r.mesh {
		if err := os.WriteFile(filepath.Join(i.Dir, "etc", "istio", "config", k), []byte(v), 0o644); err != nil {
			return nil, err
		}
	}
	cfg, err := n.Kube.ServiceAccountConfig(ctx, ReleaseNamespace, r.serviceAccount, r.roles)
	if err != nil {
		return nil, fmt.Errorf("istiod's ServiceAccount %s/%s with the chart's RBAC: %w", ReleaseNamespace, r.serviceAccount, err)
	}
	kubeconfig := filepath.Join(i.Dir, "kubeconfig")
	if err := kubeenv.WriteKubeconfig(cfg, kubeconfig); err != nil {
		return nil, err
	}
	podName := "istiod-" + randHex(10)
	env, err := istiodEnv(r.container.Env, podName, r.serviceAccount)
	if err != nil {
		return nil, err
	}
	// The chart points KUBECONFIG at a remote-cluster secret that is
	// normally absent, so istiod falls back to in-cluster credentials:
	// here the ServiceAccount's token on the loopback API server.
	env = append(env, "KUBECONFIG="+kubeconfig)
	ports, err := freePorts(5)
	if err != nil {
		return nil, err
	}
	i.HTTPPort = ports[0]
	args := append(append([]string(nil), r.container.Args...),
		// The chart's ports, each on loopback (a later flag wins).
		"--httpAddr=127.0.0.1:"+strconv.Itoa(ports[0]),
		"--grpcAddr=127.0.0.1:"+strconv.Itoa(ports[1]),
		"--secureGRPCAddr=127.0.0.1:"+strconv.Itoa(ports[2]),
		"--httpsAddr=127.0.0.1:"+strconv.Itoa(ports[3]),
		"--monitoringAddr=127.0.0.1:"+strconv.Itoa(ports[4]),
	)
	n.logf("   istiod %s (pilot-discovery %s) as %s/%s, debug on 127.0.0.1:%d", kubeenv.IstioVersion(tool), strings.Join(r.container.Args, " "), ReleaseNamespace, podName, i.HTTPPort)
	p, err := childproc.StartIn(i.Dir, "istiod", filepath.Join(tool, "pilot-discovery"), args, env, filepath.Join(i.Dir, "istiod.log"))
	if err != nil {
		return nil, err
	}
	// Among the node's daemons while it runs: a wait fails at once when
	// istiod dies.
	i.proc, i.n = p, n
	n.procs = append(n.procs, p)
	start := time.Now()
	err = n.poll(ctx, "istiod ready", n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := httpGet(ctx, fmt.Sprintf("http://127.0.0.1:%d/ready", i.HTTPPort))
		return err == nil, err
	})
	if err != nil {
		_ = i.Stop()
		return nil, fmt.Errorf("%w; istiod log tail:\n%s", err, p.LogTail(30))
	}
	n.logf("   istiod ready in %v", time.Since(start).Round(100*time.Millisecond))
	return i, nil
}

// Stop stops istiod. A nil Istiod is left alone.
func (i *Istiod) Stop() error {
	if i == nil {
		return nil
	}
	i.n.procs = slices.DeleteFunc(i.n.procs, func(p *childproc.Proc) bool { return p == i.proc })
	return i.proc.Stop(15 * time.Second)
}

// LogTail returns the last lines of istiod's log.
func (i *Istiod) LogTail(lines int) string { return i.proc.LogTail(lines) }

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// applyCRDs applies a CRD manifest and waits until every CRD is
// established (served), as helm's install of the base chart does.
func (n *Node) applyCRDs(ctx context.Context, manifest []byte) error {
	objs, err := n.Kube.Apply(ctx, manifest, kubeenv.ApplyOptions{})
	if err != nil {
		return fmt.Errorf("apply istio CRDs: %w", err)
	}
	return n.poll(ctx, "istio CRDs established", n.opts.Wait, func(ctx context.Context) (bool, error) {
		for _, o := range objs {
			crd, err := n.Kube.Dynamic.Resource(crdResource).Get(ctx, o.GetName(), metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if !established(crd) {
				return false, fmt.Errorf("CRD %s not established yet", o.GetName())
			}
		}
		return true, nil
	})
}

func established(crd *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// renderIstiod renders istiod's chart with helm template, as `helm
// install istiod ... --set profile=ambient` would install it, and takes
// the discovery container, its ServiceAccount's roles and the mesh config.
func (n *Node) renderIstiod(ctx context.Context, chart string, o IstiodOptions) (*istiodRender, error) {
	args := []string{"template", IstiodRelease, chart, "--namespace", ReleaseNamespace, "--set", "profile=ambient"}
	if o.Untaint {
		args = append(args, "--set", "taint.enabled=true")
		// Before Istio 1.30 taint.enabled gave istiod only the RBAC; its
		// users set the controller's switch in env as well.
		if dep, err := os.ReadFile(filepath.Join(chart, "templates", "deployment.yaml")); err == nil && !bytes.Contains(dep, []byte("PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS")) {
			args = append(args, "--set-string", "env.PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS=true")
		}
	}
	out, err := n.Helm(ctx, args...)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(n.Dir, "istiod", "rendered.yaml"), []byte(out), 0o644); err != nil {
		return nil, err
	}
	return parseIstiodRender([]byte(out))
}

// parseIstiodRender takes what StartIstiod needs from istiod's rendered
// chart.
func parseIstiodRender(manifest []byte) (*istiodRender, error) {
	objs, err := kubeenv.ParseObjects(manifest)
	if err != nil {
		return nil, err
	}
	r := &istiodRender{}
	var dep *appsv1.Deployment
	for _, o := range objs {
		switch o.GetKind() {
		case "Deployment":
			if dep != nil {
				return nil, fmt.Errorf("istiod's chart renders more than one Deployment (%s, %s)", dep.Name, o.GetName())
			}
			dep = &appsv1.Deployment{}
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, dep); err != nil {
				return nil, fmt.Errorf("decode Deployment %s: %w", o.GetName(), err)
			}
		case "ConfigMap":
			if o.GetName() == "istio" {
				data, _, _ := unstructured.NestedStringMap(o.Object, "data")
				r.mesh = data
			}
		}
	}
	if dep == nil {
		return nil, errors.New("istiod's chart renders no Deployment")
	}
	if _, ok := r.mesh["mesh"]; !ok {
		return nil, errors.New("istiod's chart renders no ConfigMap istio with a mesh config")
	}
	r.serviceAccount = dep.Spec.Template.Spec.ServiceAccountName
	for _, c := range dep.Spec.Template.Spec.Containers {
		if c.Name == "discovery" {
			r.container = c
		}
	}
	if r.container.Name == "" {
		return nil, fmt.Errorf("the chart's Deployment %s has no discovery container", dep.Name)
	}
	if r.roles, err = boundRoles(objs, dep.Namespace, r.serviceAccount); err != nil {
		return nil, err
	}
	return r, nil
}

// boundRoles returns the ClusterRoles and Roles the manifest's bindings
// grant the ServiceAccount namespace/name, as a YAML stream (each Role
// without its namespace, for kubeenv's ServiceAccountConfig).
func boundRoles(objs []*unstructured.Unstructured, namespace, name string) ([]byte, error) {
	bound := map[string]bool{} // kind/name
	for _, o := range objs {
		if o.GetKind() != "ClusterRoleBinding" && o.GetKind() != "RoleBinding" {
			continue
		}
		subjects, _, _ := unstructured.NestedSlice(o.Object, "subjects")
		for _, s := range subjects {
			m, _ := s.(map[string]any)
			ns, _ := m["namespace"].(string)
			if ns == "" {
				ns = o.GetNamespace()
			}
			if m["kind"] == "ServiceAccount" && m["name"] == name && (ns == namespace || ns == "") {
				kind, _, _ := unstructured.NestedString(o.Object, "roleRef", "kind")
				role, _, _ := unstructured.NestedString(o.Object, "roleRef", "name")
				bound[kind+"/"+role] = true
			}
		}
	}
	var sel bytes.Buffer
	for _, o := range objs {
		if (o.GetKind() == "ClusterRole" || o.GetKind() == "Role") && bound[o.GetKind()+"/"+o.GetName()] {
			b, err := yaml.Marshal(o.Object)
			if err != nil {
				return nil, err
			}
			sel.WriteString("---\n")
			sel.Write(b)
		}
	}
	return kubeenv.ExtractRoles(sel.Bytes())
}

// istiodEnv turns the rendered container's environment into the
// process's: plain values as they are, the pod fields the Downward API
// would give. A resource field (GOMAXPROCS from a CPU limit) is left out:
// the chart sets no limit, so the runtime's default is what a pod gets.
func istiodEnv(vars []corev1.EnvVar, podName, serviceAccount string) ([]string, error) {
	var env []string
	for _, v := range vars {
		switch {
		case v.Name == "KUBECONFIG":
			// Set by StartIstiod.
		case v.ValueFrom == nil:
			env = append(env, v.Name+"="+v.Value)
		case v.ValueFrom.FieldRef != nil:
			var val string
			switch v.ValueFrom.FieldRef.FieldPath {
			case "metadata.name":
				val = podName
			case "metadata.namespace":
				val = ReleaseNamespace
			case "spec.serviceAccountName":
				val = serviceAccount
			default:
				return nil, fmt.Errorf("istiod env %s: field %s not provided", v.Name, v.ValueFrom.FieldRef.FieldPath)
			}
			env = append(env, v.Name+"="+val)
		case v.ValueFrom.ResourceFieldRef != nil:
		default:
			return nil, fmt.Errorf("istiod env %s: unsupported source", v.Name)
		}
	}
	return env, nil
}

// IstiodWorkload is one workload of istiod's ambient index, as
// /debug/ambientz lists it (protobuf JSON of istio.workload.Workload).
type IstiodWorkload struct {
	UID            string `json:"uid"`
	Name           string `json:"name"`
	Namespace      string `json:"namespace"`
	Node           string `json:"node"`
	Status         string `json:"status"`
	TunnelProtocol string `json:"tunnelProtocol"`
}

// HBONE reports whether istiod sends ztunnel this workload as reachable
// through the HBONE tunnel: for a pod, because its
// ambient.istio.io/redirection annotation is "enabled".
func (w *IstiodWorkload) HBONE() bool { return w != nil && w.TunnelProtocol == "HBONE" }

// Workloads returns istiod's ambient index: /debug/ambientz on its debug
// port, which serves loopback callers unauthenticated.
func (i *Istiod) Workloads(ctx context.Context) ([]IstiodWorkload, error) {
	b, err := httpGet(ctx, fmt.Sprintf("http://127.0.0.1:%d/debug/ambientz", i.HTTPPort))
	if err != nil {
		return nil, err
	}
	var res struct {
		Workloads []IstiodWorkload `json:"workloads"`
	}
	if err := json.Unmarshal(b, &res); err != nil {
		return nil, fmt.Errorf("decode /debug/ambientz: %w", err)
	}
	return res.Workloads, nil
}

// Workload returns istiod's workload of a pod, nil if istiod lists none.
func (i *Istiod) Workload(ctx context.Context, namespace, name string) (*IstiodWorkload, error) {
	wls, err := i.Workloads(ctx)
	if err != nil {
		return nil, err
	}
	for k := range wls {
		if wls[k].Namespace == namespace && wls[k].Name == name {
			return &wls[k], nil
		}
	}
	return nil, nil
}

// View says in a word what istiod makes of a pod: "HBONE", "no tunnel"
// (a workload ztunnel reaches in plain text) or "not listed".
func (w *IstiodWorkload) View() string {
	switch {
	case w == nil:
		return "not listed"
	case w.HBONE():
		return "HBONE"
	default:
		return "no tunnel"
	}
}

// ViewOf is the table's word for istiod's view of a pod (View), or what
// kept istiod from answering.
func (i *Istiod) ViewOf(ctx context.Context, namespace, name string) string {
	w, err := i.Workload(ctx, namespace, name)
	if err != nil {
		return "error: " + err.Error()
	}
	return w.View()
}
