// Package simnode is the one simulated Kubernetes node of the suites (the
// integration suite, chaos, the benchmark, the sandbox): a real API server
// env (test/lib/kubeenv), a bridge pod network whose primary conflist the
// installer chains the plugin into, the agent's and the plugin's
// ServiceAccounts bound to the shipped RBAC, install-cni's settings from the chart's environment (only
// node-local settings pointed at this node: NodeLocal; anything else a
// suite changes it names in Options.Settings), a ztunnel stand-in on its
// ZDS socket, and a kubelet simulator (test/lib/kubesim) over the chained
// conflist. install-cni runs as its own process (StartAgent), the shipped
// binary; the integration suite instead runs it in-process from Config and
// AgentConfig, to inject faults and read its state.
package simnode

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/runtime"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// The chart is rendered as `make manifests` renders it.
const (
	ChartDir         = "deploy/charts/ambient-cni"
	ReleaseName      = "ambient-cni"
	ReleaseNamespace = "istio-system"
)

// ManifestPath is the chart's rendered output, kept equal to it by
// `make check-manifests` (test/deploy).
const ManifestPath = "deploy/manifests/ambient-cni.yaml"

// Shipped is what the chart's default values make the DaemonSet run.
type Shipped struct {
	// Command and Args of the install-cni container.
	Command, Args []string
	// Env is the container's environment, downward-API fields resolved
	// for a node named "node" and a pod named "pod" (see NodeLocal: the
	// benchmark replaces those).
	Env map[string]string
	// ServiceAccount is the DaemonSet's ServiceAccount (in ReleaseNamespace).
	ServiceAccount string
	// Manifest is the whole rendered chart.
	Manifest []byte
}

// RenderChart runs `helm template` (the tools-cache helm) on the chart in
// repoRoot with its default values and returns the agent container's
// settings.
func RenderChart(ctx context.Context, repoRoot string) (*Shipped, error) {
	helm, err := kubeenv.ToolPath(kubeenv.Helm)
	if err != nil {
		return nil, err
	}
	home, err := os.MkdirTemp("", "bench-helm-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(home)
	cmd := exec.CommandContext(ctx, helm, "template", ReleaseName, ChartDir, "--namespace", ReleaseNamespace)
	cmd.Dir = repoRoot
	// Nothing of the user's helm setup is read or written.
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"),
		"KUBECONFIG="+filepath.Join(home, "no-kubeconfig"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("helm template %s: %w: %s", ChartDir, err, strings.TrimSpace(stderr.String()))
	}
	return ParseShipped(stdout.Bytes())
}

// CommittedChart reads the chart's rendered manifest committed in the
// repository (ManifestPath): the chart's defaults without needing helm.
func CommittedChart() (*Shipped, error) {
	root, err := kubeenv.RepoRoot()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(root, ManifestPath))
	if err != nil {
		return nil, fmt.Errorf("read the shipped manifest: %w", err)
	}
	return ParseShipped(b)
}

// ParseShipped extracts the install-cni container's command, args and
// environment from a rendered chart.
func ParseShipped(manifest []byte) (*Shipped, error) {
	objs, err := kubeenv.ParseObjects(manifest)
	if err != nil {
		return nil, err
	}
	var ds *appsv1.DaemonSet
	for _, o := range objs {
		if o.GetKind() != "DaemonSet" {
			continue
		}
		if ds != nil {
			return nil, errors.New("the chart renders more than one DaemonSet")
		}
		ds = &appsv1.DaemonSet{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, ds); err != nil {
			return nil, fmt.Errorf("decode DaemonSet: %w", err)
		}
	}
	if ds == nil {
		return nil, errors.New("the chart renders no DaemonSet")
	}
	cs := ds.Spec.Template.Spec.Containers
	if len(cs) != 1 {
		return nil, fmt.Errorf("the DaemonSet has %d containers, want 1", len(cs))
	}
	s := &Shipped{
		Command: cs[0].Command, Args: cs[0].Args, Env: map[string]string{},
		ServiceAccount: ds.Spec.Template.Spec.ServiceAccountName, Manifest: manifest,
	}
	for _, e := range cs[0].Env {
		switch {
		case e.ValueFrom == nil:
			s.Env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			switch e.ValueFrom.FieldRef.FieldPath {
			case "spec.nodeName":
				s.Env[e.Name] = "node"
			case "metadata.name":
				s.Env[e.Name] = "pod"
			case "metadata.namespace":
				s.Env[e.Name] = ds.Namespace
			default:
				return nil, fmt.Errorf("env %s: unsupported field %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		default:
			return nil, fmt.Errorf("env %s: unsupported source (secret or config map)", e.Name)
		}
	}
	return s, nil
}

// NodeLocal lists every setting a simulated node gives a value other than
// the chart's, with the reason. They say where things are on this node
// and who the agent is; none tunes behaviour or speed. test/bench's
// TestBenchRunsShipped pins the list, so a tuned node cannot hide a
// production bottleneck. A suite that must differ beyond it says so in
// Options.Settings, with its reason.
var NodeLocal = map[string]string{
	"AMBIENT_NODE_NAME":     "the simulated node's name (downward API in the chart)",
	"AMBIENT_POD_NAME":      "the agent pod's name (downward API in the chart)",
	"AMBIENT_CNI_BIN_DIR":   "the node's CNI directories (host mounts at /host/... in the chart)",
	"AMBIENT_CNI_CONF_DIR":  "the node's CNI directories (host mounts at /host/... in the chart)",
	"AMBIENT_PLUGIN_BINARY": "bin/ambient-cni from make build (the image's copy in the chart)",
	"AMBIENT_AGENT_SOCKET":  "sockets in the node's directory, not the machine's /var/run",
	"AMBIENT_ZDS_SOCKET":    "sockets in the node's directory, not the machine's /var/run",
	"AMBIENT_STATE_DIR":     "the agent's persistent files (uninstall marker) in the node's directory, not the machine's /var/lib",
	"AMBIENT_PROC_ROOT":     "the host's /proc is /proc here (mounted at /host/proc in the chart)",
	"AMBIENT_KUBECONFIG": "the ServiceAccount's token and the loopback API server in a kubeconfig " +
		"(the chart uses in-cluster configuration; neither carries a rate limit)",
}

// Paths says where a simulated node keeps things and who its agent is.
type Paths struct {
	Name, PodName          string
	CNIBinDir, CNIConfDir  string
	PluginBinary           string
	AgentSocket, ZDSSocket string
	StateDir               string
	Kubeconfig             string
}

// AgentEnv is the environment install-cni runs with: the chart's, with the
// NodeLocal settings pointed at p, then settings (install-cni flag names,
// e.g. a rules-backend selector) on top. Nothing of the caller's
// environment but PATH is passed on (see Environ): a GOGC or GODEBUG of
// the shell would change what is measured.
func AgentEnv(s *Shipped, p Paths, settings map[string]string) (map[string]string, error) {
	env := maps.Clone(s.Env)
	set := map[string]string{
		"AMBIENT_NODE_NAME":     p.Name,
		"AMBIENT_POD_NAME":      p.PodName,
		"AMBIENT_CNI_BIN_DIR":   p.CNIBinDir,
		"AMBIENT_CNI_CONF_DIR":  p.CNIConfDir,
		"AMBIENT_PLUGIN_BINARY": p.PluginBinary,
		"AMBIENT_AGENT_SOCKET":  p.AgentSocket,
		"AMBIENT_ZDS_SOCKET":    p.ZDSSocket,
		"AMBIENT_STATE_DIR":     p.StateDir,
		"AMBIENT_PROC_ROOT":     "/proc",
		"AMBIENT_KUBECONFIG":    p.Kubeconfig,
	}
	for k, v := range set {
		if _, ok := NodeLocal[k]; !ok {
			return nil, fmt.Errorf("internal error: %s is not a NodeLocal setting", k)
		}
		env[k] = v
	}
	for flag, v := range settings {
		env[installcni.EnvName(flag)] = v
	}
	return env, nil
}

// Environ renders env for exec, with PATH (iptables and friends are found
// through it, as in the image).
func Environ(env map[string]string) []string {
	out := []string{"PATH=" + os.Getenv("PATH")}
	for _, k := range slices.Sorted(maps.Keys(env)) {
		out = append(out, k+"="+env[k])
	}
	return out
}
