//go:build realnode

package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// kubectlOperator is the user the plugin runs as: only the RBAC
// docs/troubleshooting.md (kubectl ambient-cni) documents, nothing else.
const kubectlOperator = "ambient-cni-operator"

// kubectl runs the real kubectl with the plugin on PATH as the operator.
type kubectl struct {
	bin, pathDir, kubeconfig string
}

func (k kubectl) run(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, k.bin, args...)
	cmd.Env = append(os.Environ(), "PATH="+k.pathDir+":"+os.Getenv("PATH"), "KUBECONFIG="+k.kubeconfig)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

// The kubectl plugin, run by the real kubectl as an operator with only the
// documented RBAC, finds each pod's node agent and explains a captured
// pod, an uncaptured pod and a failing pod (a sidecar pod injected for
// istio-cni, stuck in its istio-validation init container), with -o json
// too, and reports the node's status.
func (e *e2e) testKubectlPlugin(t *testing.T) {
	ctx := context.Background()
	n := e.n
	if n.Tools.Kubectl == "" {
		t.Fatalf("kubectl is not built: hack/kube-tools.sh kubectl")
	}
	dir := t.TempDir()
	// Built as make build and make release build it (static,
	// -trimpath, stripped): what ships, and the build cache the image's
	// binaries filled moments before (without -trimpath every package,
	// client-go's included, compiled again: two minutes of a cold CI).
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", filepath.Join(dir, "kubectl-ambient_cni"), "./cmd/kubectl-ambient_cni")
	build.Dir = n.Tools.Repo
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the plugin: %v\n%s", err, out)
	}

	mesh, plain := "kc-mesh", "kc-plain"
	e.namespace(t, mesh, true)
	e.namespace(t, plain, false)
	k := kubectl{bin: n.Tools.Kubectl, pathDir: dir, kubeconfig: e.operatorKubeconfig(t, dir, mesh, plain)}

	captured := e.start(t, mesh, "web", AppOptions{})
	e.mustCaptured(t, captured)
	e.start(t, plain, "web", AppOptions{})
	sidecar := n.AppPod(mesh, "sidecar", AppOptions{})
	sidecar.Annotations = map[string]string{ambient.SidecarStatusAnnotation: `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}
	sidecar.Spec.InitContainers = []corev1.Container{{
		Name: ambient.IstioValidationInitContainer, Image: n.Images.App, ImagePullPolicy: corev1.PullNever, Args: []string{"serve"},
	}}
	if _, err := n.Client.CoreV1().Pods(mesh).Create(ctx, sidecar, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		zero := int64(0)
		for _, p := range [][2]string{{mesh, "web"}, {plain, "web"}, {mesh, "sidecar"}} {
			_ = n.Client.CoreV1().Pods(p[0]).Delete(ctx, p[1], metav1.DeleteOptions{GracePeriodSeconds: &zero})
		}
		for _, p := range [][2]string{{mesh, "web"}, {plain, "web"}, {mesh, "sidecar"}} {
			if err := n.WaitPodGone(ctx, p[0], p[1]); err != nil {
				t.Error(err)
			}
		}
	})
	// Stuck in istio-validation, as on a node without istio-cni.
	if err := n.Poll(ctx, "sidecar pod in its istio-validation init container", func(ctx context.Context) (bool, error) {
		p, err := n.Client.CoreV1().Pods(mesh).Get(ctx, "sidecar", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		ok := p.Status.PodIP != "" && len(p.Status.InitContainerStatuses) == 1 && p.Status.InitContainerStatuses[0].State.Running != nil
		return ok, nil
	}); err != nil {
		t.Fatal(err)
	}

	if out, err := k.run(ctx, "plugin", "list"); err != nil || !strings.Contains(out, "kubectl-ambient_cni") {
		t.Errorf("kubectl plugin list does not find the plugin: %v\n%s", err, out)
	}
	agents, err := n.AgentPods(ctx)
	if err != nil || len(agents) != 1 {
		t.Fatalf("agent pods: %d %v", len(agents), err)
	}
	agent := ReleaseNamespace + "/" + agents[0].Name

	// explain polls: the agent's pod cache may lag the API server by moments.
	explain := func(pod string, want ...string) string {
		t.Helper()
		var out string
		err := n.Poll(ctx, "kubectl ambient-cni explain "+pod, func(ctx context.Context) (bool, error) {
			var err error
			out, err = k.run(ctx, "ambient-cni", "explain", pod)
			if err != nil {
				return false, err
			}
			for _, w := range want {
				if !strings.Contains(out, w) {
					return false, fmt.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			return true, nil
		})
		if err != nil {
			t.Error(err)
		}
		t.Logf("kubectl ambient-cni explain %s:\n%s", pod, out)
		return out
	}
	explain(mesh+"/web",
		"Pod:      kc-mesh/web (Running) on node "+n.Name+"\n",
		"Agent:    "+agent+"\n",
		"Verdict:  captured (namespace labelled ambient)\n",
		"Status:   OK\n",
		"  agent       holds it: enabled, ztunnel acknowledged, captured at its start (CNI ADD)",
		"verified clean just now\n",
		"  annotation  ambient.istio.io/redirection: enabled\n",
		"  - nothing: the pod is in the mesh\n")
	explain(plain+"/web",
		"Verdict:  not captured: neither pod nor namespace labelled ambient\n",
		"Status:   OK\n",
		"  agent       does not hold it\n",
		"`kubectl label namespace kc-plain istio.io/dataplane-mode=ambient`")
	explain(mesh+"/sidecar",
		"Pod:      kc-mesh/sidecar (Pending) on node "+n.Name+"\n",
		"Verdict:  not captured: sidecar-injected pod\n",
		"Status:   NEEDS ATTENTION\n",
		"  - the pod was injected for istio-cni's sidecar mode",
		"run this sidecar pod where istio-cni runs")

	out, err := k.run(ctx, "ambient-cni", "explain", "sidecar", "-n", mesh, "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		Agent  struct{ Node, Namespace, Pod string }
		Report struct {
			Pod, Verdict string
			OK           bool
			Problems     []string
		}
	}
	if err := json.Unmarshal([]byte(out), &answer); err != nil {
		t.Fatalf("-o json: %v\n%s", err, out)
	}
	if answer.Agent.Node != n.Name || answer.Agent.Namespace+"/"+answer.Agent.Pod != agent ||
		answer.Report.Pod != mesh+"/sidecar" || answer.Report.OK || len(answer.Report.Problems) == 0 {
		t.Errorf("-o json: %+v", answer)
	}

	out, err = k.run(ctx, "ambient-cni", "status", n.Name)
	t.Logf("kubectl ambient-cni status %s:\n%s", n.Name, out)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"Node:     " + n.Name + "\n", "Agent:    " + agent + "\n", "Ready:    yes\n", "Ztunnel:  1 connected\n", "  - kubectl ambient-cni explain kc-mesh/sidecar\n"} {
		if !strings.Contains(out, w) {
			t.Errorf("status lacks %q", w)
		}
	}

	// pods/exec: the WebSocket upgrade is authorised as get and, on this
	// API server, as create too; when it is refused the plugin falls back
	// to SPDY, as kubectl exec does, which needs create alone. So create
	// alone still answers (through the fallback), and get alone or neither
	// is refused. The API server names the verb only for get: the
	// upgrade's second check, create, comes back with no reason.
	for _, c := range []struct {
		verbs   []string
		refused []string // nil: the plugin answers
	}{
		{[]string{"create"}, nil},
		{[]string{"get"}, []string{"is forbidden"}},
		{nil, []string{"pods/exec", "forbidden"}},
	} {
		role, err := n.Client.RbacV1().Roles(ReleaseNamespace).Get(ctx, kubectlOperator, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		role.Rules[1].Verbs = c.verbs
		if c.verbs == nil {
			role.Rules = role.Rules[:1]
		}
		if _, err := n.Client.RbacV1().Roles(ReleaseNamespace).Update(ctx, role, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		if c.refused == nil {
			// The role only lost a verb, so the answer must keep coming:
			// each try answers (no wait for RBAC to settle).
			for range 3 {
				if out, err := k.run(ctx, "ambient-cni", "explain", mesh+"/web"); err != nil || !strings.Contains(out, "Verdict:  captured") {
					t.Errorf("pods/exec verbs %v: the plugin does not answer through the SPDY fallback: %v\n%s", c.verbs, err, out)
				}
			}
			continue
		}
		var last error
		if err := n.Poll(ctx, fmt.Sprintf("plugin refused with pods/exec verbs %v", c.verbs), func(ctx context.Context) (bool, error) {
			_, last = k.run(ctx, "ambient-cni", "explain", mesh+"/web")
			if last == nil {
				return false, nil
			}
			for _, m := range c.refused {
				if !strings.Contains(last.Error(), m) {
					return false, nil
				}
			}
			return true, nil
		}); err != nil {
			t.Errorf("%v (last: %v)", err, last)
		}
	}
}

// operatorKubeconfig writes a kubeconfig of a user with exactly the RBAC
// docs/troubleshooting.md (kubectl ambient-cni) documents: get pods in the
// pods' namespaces, list pods and get and create pods/exec in the agent's
// namespace.
func (e *e2e) operatorKubeconfig(t *testing.T, dir string, podNamespaces ...string) string {
	t.Helper()
	ctx := context.Background()
	rbac := e.n.Client.RbacV1()
	user := []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: kubectlOperator}}
	bind := func(ns string, rules []rbacv1.PolicyRule) {
		meta := metav1.ObjectMeta{Name: kubectlOperator, Namespace: ns}
		if _, err := rbac.Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: meta, Rules: rules}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := rbac.RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: meta, Subjects: user,
			RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: kubectlOperator}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = rbac.RoleBindings(ns).Delete(ctx, kubectlOperator, metav1.DeleteOptions{})
			_ = rbac.Roles(ns).Delete(ctx, kubectlOperator, metav1.DeleteOptions{})
		})
	}
	bind(ReleaseNamespace, []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"list"}},
		{APIGroups: []string{""}, Resources: []string{"pods/exec"}, Verbs: []string{"get", "create"}},
	})
	for _, ns := range podNamespaces {
		bind(ns, []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}}})
	}
	cfg, err := e.n.Kube.UserConfig(kubectlOperator)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "operator.kubeconfig")
	if err := kubeenv.WriteKubeconfig(cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}
