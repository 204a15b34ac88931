package bench

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

// NodeLocal lists every setting the benchmark gives a value other than
// the chart's, with the reason. They say where things are on this node
// and who the agent is; none tunes behaviour or speed. TestBenchRunsShipped
// pins the list, so a tuned benchmark cannot hide a production bottleneck.
var NodeLocal = map[string]string{
	"AMBIENT_NODE_NAME":     "the benchmark node's name (downward API in the chart)",
	"AMBIENT_POD_NAME":      "the agent pod's name (downward API in the chart)",
	"AMBIENT_CNI_BIN_DIR":   "the node's CNI directories (host mounts at /host/... in the chart)",
	"AMBIENT_CNI_CONF_DIR":  "the node's CNI directories (host mounts at /host/... in the chart)",
	"AMBIENT_PLUGIN_BINARY": "bin/ambient-cni from make build (the image's copy in the chart)",
	"AMBIENT_AGENT_SOCKET":  "sockets in the benchmark's directory, not the machine's /var/run",
	"AMBIENT_ZDS_SOCKET":    "sockets in the benchmark's directory, not the machine's /var/run",
	"AMBIENT_PROC_ROOT":     "the host's /proc is /proc here (mounted at /host/proc in the chart)",
	"AMBIENT_KUBECONFIG": "the ServiceAccount's token and the loopback API server in a kubeconfig " +
		"(the chart uses in-cluster configuration; neither carries a rate limit)",
}

// Node says where the benchmark node keeps things.
type Node struct {
	Name, PodName          string
	CNIBinDir, CNIConfDir  string
	PluginBinary           string
	AgentSocket, ZDSSocket string
	Kubeconfig             string
}

// AgentEnv is the environment install-cni runs with: the chart's, with the
// NodeLocal settings pointed at node and, when backend names one, the
// rules-backend selector set (the benchmark's one parameter). Nothing of
// the caller's environment but PATH is passed on: a GOGC or GODEBUG of the
// shell would change the figures.
func AgentEnv(s *Shipped, node Node, backend Backend) (map[string]string, error) {
	env := maps.Clone(s.Env)
	set := map[string]string{
		"AMBIENT_NODE_NAME":     node.Name,
		"AMBIENT_POD_NAME":      node.PodName,
		"AMBIENT_CNI_BIN_DIR":   node.CNIBinDir,
		"AMBIENT_CNI_CONF_DIR":  node.CNIConfDir,
		"AMBIENT_PLUGIN_BINARY": node.PluginBinary,
		"AMBIENT_AGENT_SOCKET":  node.AgentSocket,
		"AMBIENT_ZDS_SOCKET":    node.ZDSSocket,
		"AMBIENT_PROC_ROOT":     "/proc",
		"AMBIENT_KUBECONFIG":    node.Kubeconfig,
	}
	for k, v := range set {
		if _, ok := NodeLocal[k]; !ok {
			return nil, fmt.Errorf("internal error: %s is not a NodeLocal setting", k)
		}
		env[k] = v
	}
	if backend.Selector != "" {
		env[installcni.EnvName(backend.Selector)] = backend.Value
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
