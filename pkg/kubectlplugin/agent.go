package kubectlplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	utilexec "k8s.io/client-go/util/exec"
	"k8s.io/streaming/pkg/httpstream"
)

const (
	// AgentSelector selects the agent's pods: the chart's selector label,
	// the same with istioCompat.names (which renames the DaemonSet, not
	// this label).
	AgentSelector = "app.kubernetes.io/name=ambient-cni"
	// AgentContainer is the agent's container in the chart's pod.
	AgentContainer = "install-cni"
	// DefaultAgentNamespace is where the quickstart installs the chart.
	DefaultAgentNamespace = "istio-system"
	// agentCommand runs when the agent's container names no command.
	agentCommand = "install-cni"
	// maxAnswer bounds what is read of an answer (a node report of a
	// few hundred pods is well under it).
	maxAnswer = 64 << 20
)

// Client asks node agents through the API server. It needs get on the
// asked pod, list on pods and get and create on pods/exec in the agent's
// namespace (docs/troubleshooting.md, kubectl ambient-cni).
type Client struct {
	Kube   kubernetes.Interface
	Config *rest.Config
	// AgentNamespace is the chart's release namespace.
	AgentNamespace string
}

// PodNode returns the node a pod is scheduled to.
func (c *Client) PodNode(ctx context.Context, namespace, name string) (string, error) {
	p, err := c.Kube.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("get pod %s/%s: %w", namespace, name, err)
	}
	if p.Spec.NodeName == "" {
		return "", fmt.Errorf("pod %s/%s is not scheduled to a node yet: no node agent to ask (it is captured when it starts on one)", namespace, name)
	}
	return p.Spec.NodeName, nil
}

// AgentPod returns the agent's pod on node: a running one, else any.
func (c *Client) AgentPod(ctx context.Context, node string) (*corev1.Pod, error) {
	list, err := c.Kube.CoreV1().Pods(c.AgentNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: AgentSelector,
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String(),
	})
	if err != nil {
		return nil, fmt.Errorf("list the agent's pods in %s: %w", c.AgentNamespace, err)
	}
	var pick *corev1.Pod
	for i := range list.Items {
		p := &list.Items[i]
		if p.DeletionTimestamp != nil {
			continue
		}
		if pick == nil || (p.Status.Phase == corev1.PodRunning && pick.Status.Phase != corev1.PodRunning) {
			pick = p
		}
	}
	if pick == nil {
		return nil, fmt.Errorf("no ambient-cni agent pod (%s) on node %s in namespace %s: is the chart installed in that namespace (--agent-namespace), and does its DaemonSet run on that node (nodeSelector, tolerations)?", AgentSelector, node, c.AgentNamespace)
	}
	if pick.Status.Phase != corev1.PodRunning {
		return nil, fmt.Errorf("the agent pod %s/%s on node %s is %s, not running: `kubectl -n %s describe pod %s`", pick.Namespace, pick.Name, node, pick.Status.Phase, pick.Namespace, pick.Name)
	}
	return pick, nil
}

// command is the agent's program in its container (the chart's
// image.command), so the plugin runs what the probes run.
func command(p *corev1.Pod) string {
	for _, c := range p.Spec.Containers {
		if c.Name == AgentContainer && len(c.Command) > 0 {
			return c.Command[0]
		}
	}
	return agentCommand
}

// ExitError is a command in the agent's container that ran and exited
// non-zero.
type ExitError struct {
	Code   int
	Stderr string
}

func (e *ExitError) Error() string {
	return fmt.Sprintf("exit %d: %s", e.Code, strings.TrimSpace(e.Stderr))
}

// Exec runs the agent's program with args in the agent's container of p
// (pods/exec: WebSocket, else SPDY, as kubectl exec does) and returns its
// standard output. A run that exits non-zero is an *ExitError.
func (c *Client) Exec(ctx context.Context, p *corev1.Pod, args ...string) ([]byte, error) {
	req := c.Kube.CoreV1().RESTClient().Post().Resource("pods").Namespace(p.Namespace).Name(p.Name).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{
			Container: AgentContainer,
			Command:   append([]string{command(p)}, args...),
			Stdout:    true,
			Stderr:    true,
		}, scheme.ParameterCodec)
	ws, err := remotecommand.NewWebSocketExecutor(c.Config, http.MethodGet, req.URL().String())
	if err != nil {
		return nil, fmt.Errorf("exec in %s/%s: %w", p.Namespace, p.Name, err)
	}
	spdy, err := remotecommand.NewSPDYExecutor(c.Config, http.MethodPost, req.URL())
	if err != nil {
		return nil, fmt.Errorf("exec in %s/%s: %w", p.Namespace, p.Name, err)
	}
	ex, err := remotecommand.NewFallbackExecutor(ws, spdy, func(err error) bool {
		return httpstream.IsUpgradeFailure(err) || httpstream.IsHTTPSProxyError(err)
	})
	if err != nil {
		return nil, fmt.Errorf("exec in %s/%s: %w", p.Namespace, p.Name, err)
	}
	stdout := &limited{max: maxAnswer}
	stderr := &limited{max: 64 << 10}
	err = ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: stdout, Stderr: stderr})
	var exit utilexec.CodeExitError
	switch {
	case errors.As(err, &exit):
		return stdout.Bytes(), &ExitError{Code: exit.Code, Stderr: stderr.String()}
	case err != nil:
		return nil, fmt.Errorf("exec in %s/%s: %w", p.Namespace, p.Name, err)
	case stdout.over:
		return nil, fmt.Errorf("exec in %s/%s: answer over %d bytes", p.Namespace, p.Name, maxAnswer)
	}
	return stdout.Bytes(), nil
}

// limited is a buffer that keeps at most max bytes and notes the rest.
type limited struct {
	bytes.Buffer
	max  int
	over bool
}

func (l *limited) Write(p []byte) (int, error) {
	if room := l.max - l.Len(); len(p) > room {
		l.over = true
		l.Buffer.Write(p[:max(room, 0)])
		return len(p), nil
	}
	return l.Buffer.Write(p)
}

func agentOf(p *corev1.Pod) Agent {
	return Agent{Node: p.Spec.NodeName, Namespace: p.Namespace, Pod: p.Name}
}

// Explain asks the agent of the pod's node to explain the pod.
func (c *Client) Explain(ctx context.Context, namespace, name string) (*PodAnswer, error) {
	node, err := c.PodNode(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	agent, err := c.AgentPod(ctx, node)
	if err != nil {
		return nil, err
	}
	out, err := c.Exec(ctx, agent, "debug", "explain", namespace+"/"+name)
	if err != nil {
		var exit *ExitError
		if errors.As(err, &exit) && strings.Contains(exit.Stderr, "404") {
			return nil, fmt.Errorf("the agent %s/%s on node %s does not know pod %s/%s yet (its pod cache lags the API server by moments; ask again)", agent.Namespace, agent.Name, node, namespace, name)
		}
		return nil, fmt.Errorf("ask the agent %s/%s on node %s: %w", agent.Namespace, agent.Name, node, err)
	}
	if err := checkJSON(out); err != nil {
		return nil, fmt.Errorf("the agent %s/%s answered: %w", agent.Namespace, agent.Name, err)
	}
	return &PodAnswer{Agent: agentOf(agent), Report: out}, nil
}

// Status asks the agent of node for its readiness and its node report.
func (c *Client) Status(ctx context.Context, node string) (*NodeAnswer, error) {
	agent, err := c.AgentPod(ctx, node)
	if err != nil {
		return nil, err
	}
	a := &NodeAnswer{Agent: agentOf(agent), Ready: true}
	ready, err := c.Exec(ctx, agent, "probe", "ready")
	var exit *ExitError
	switch {
	case errors.As(err, &exit):
		a.Ready = false
		a.Readiness = strings.TrimSpace(string(ready) + "\n" + exit.Stderr)
	case err != nil:
		return nil, fmt.Errorf("ask the agent %s/%s on node %s: %w", agent.Namespace, agent.Name, node, err)
	default:
		a.Readiness = strings.TrimSpace(string(ready))
	}
	out, err := c.Exec(ctx, agent, "debug", "explain")
	if err != nil {
		return nil, fmt.Errorf("ask the agent %s/%s on node %s: %w", agent.Namespace, agent.Name, node, err)
	}
	if err := checkJSON(out); err != nil {
		return nil, fmt.Errorf("the agent %s/%s answered: %w", agent.Namespace, agent.Name, err)
	}
	a.Report = out
	return a, nil
}

// checkJSON rejects an answer that is not one JSON object.
func checkJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) == 0 || b[0] != '{' || !json.Valid(b) {
		return fmt.Errorf("not a JSON report: %.200q", b)
	}
	return nil
}
