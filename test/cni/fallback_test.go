package cni

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/plugin"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// pluginRBAC is the plugin's own ClusterRole and Role from the shipped
// manifest.
func pluginRBAC(t *testing.T) []byte {
	t.Helper()
	root, err := kubeenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := os.ReadFile(filepath.Join(root, kubeenv.RBACPath))
	if err != nil {
		t.Fatal(err)
	}
	out, err := kubeenv.ExtractPluginRoles(manifest)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Count(string(out), "name: ambient-cni-plugin\n") != 2 {
		t.Fatalf("want the ClusterRole and the Role ambient-cni-plugin in the shipped manifest, got:\n%s", out)
	}
	return out
}

// buildFallback builds the fallback binary as make build does, into dir.
func buildFallback(t *testing.T, dir string) {
	t.Helper()
	root, _ := kubeenv.RepoRoot()
	cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(dir, "ambient-cni-fallback"), "./cmd/ambient-cni-fallback")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the fallback binary: %v\n%s", err, out)
	}
}

const prevResult = `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"address":"10.1.0.5/24","interface":0}]}`

// addWithoutAgent runs the plugin's ADD for ns/name with no agent on the
// node: nil (the pod starts) or its CNI error.
func addWithoutAgent(t *testing.T, run, state string, pod *corev1.Pod) error {
	t.Helper()
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s","type":"ambient-cni","agentSocket":%q,"stateDir":%q,"controlPlaneNamespaces":["istio-system","openshift-*"],"prevResult":%s}`,
		filepath.Join(run, "agent.sock"), state, prevResult)
	var out, logs bytes.Buffer
	err := plugin.New(&out, &logs).Add(&plugin.CmdArgs{ContainerID: "sb-" + pod.Name, Netns: "/var/run/netns/x", IfName: "eth0",
		Args:      fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_UID=%s", pod.Namespace, pod.Name, pod.UID),
		StdinData: []byte(conf)})
	t.Logf("%s/%s: %v\n%s", pod.Namespace, pod.Name, err, logs.String())
	return err
}

func wantStarts(t *testing.T, err error, what string) {
	t.Helper()
	if err != nil {
		t.Errorf("%s: %v, want it to start", what, err)
	}
}

// wantWaitForAgent: the wait points at the agent, not at a DaemonSet
// that left.
func wantWaitForAgent(t *testing.T, err error, what string) {
	t.Helper()
	if err == nil || strings.Contains(err.Error(), "agent's DaemonSet") || !strings.Contains(err.Error(), "check that the ambient-cni node agent is running") {
		t.Errorf("%s: %v, want a wait for the agent that names no DaemonSet", what, err)
	}
}

// agentDaemonSet is a DaemonSet in the agent's place, targeting every node.
func agentDaemonSet(ns, name string) *appsv1.DaemonSet {
	labels := map[string]string{"app.kubernetes.io/name": name}
	return &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "agent"}}},
			},
		},
	}
}

// olderChartCredential writes, into a node directory of its own, the
// credential an older chart's plugin role gives: get on pods and
// namespaces only. It returns the run and state directories.
func olderChartCredential(t *testing.T, env *kubeenv.Env, ns, node, ds string, ca []byte) (string, string) {
	t.Helper()
	const sa = "older-chart-plugin"
	env.ServiceAccountClient(t, ns, sa, []byte(`apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: older-chart-plugin
rules:
  - apiGroups: [""]
    resources: ["pods", "namespaces"]
    verbs: ["get"]
`))
	admin, err := kubeclient.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	run, state, err := writeCredential(t, env, admin, ns, sa, node, ds, ca)
	if err != nil {
		t.Fatal(err)
	}
	buildFallback(t, state)
	return run, state
}

// writeCredential writes, into a node directory of its own under a test
// temp dir, the plugin credential the agent would: a node-bound token of
// ServiceAccount ns/sa obtained through client, the node's policy with ns
// as its data-plane namespace, and the agent's DaemonSet ns/ds. It
// returns the run and state directories.
func writeCredential(t *testing.T, env *kubeenv.Env, client *kubeclient.Client, ns, sa, node, ds string, ca []byte) (string, string, error) {
	root := t.TempDir()
	run, state := filepath.Join(root, "run"), filepath.Join(root, "state")
	rot := &plugincred.Rotator{
		Path: nodefiles.ForSocket(filepath.Join(run, "agent.sock")).WithStateDir(state).PluginCredential(),
		Base: plugincred.File{Server: env.Config.Host, CA: string(ca), NodeName: node,
			Policy:    plugincred.Policy{ExcludedNamespaces: []string{"kube-system"}, DataPlaneNamespaces: []string{ns}},
			DaemonSet: &plugincred.ObjectRef{Namespace: ns, Name: ds}},
		Source:   apicalls.PluginTokens{Client: client, Namespace: ns, ServiceAccount: sa, NodeName: node},
		Lifetime: 3600e9,
	}
	return run, state, rot.WriteOnce(context.Background())
}

func wantWaits(t *testing.T, err error, what string) {
	t.Helper()
	var te *types.Error
	if !errors.As(err, &te) || te.Code != types.ErrTryAgainLater {
		t.Errorf("%s: %v, want code 11", what, err)
	}
}

// TestFallbackAgainstAPIServer: with no agent on the node, the plugin asks
// a real kube-apiserver, through the real fallback binary, with a token the
// agent's own shipped RBAC obtained from the TokenRequest API for the
// plugin's ServiceAccount (whose shipped role only gets pods and
// namespaces), bound to the node (a Node-bound TokenRequest, which the
// API server accepts); and decides as the agent would. With the API
// server stopped the plugin falls back to what it can vouch for.
func TestFallbackAgainstAPIServer(t *testing.T) {
	env := kubeenv.Start(t)
	ctx := context.Background()
	const sysNS, node, agentDS = "istio-system", "node-fallback", "ambient-cni"
	// The plugin's identity as shipped, and the agent's.
	env.CreateNamespace(t, sysNS, nil)
	env.ServiceAccountClient(t, sysNS, "ambient-cni-plugin", pluginRBAC(t))
	agentCfg, _ := env.ServiceAccountClient(t, sysNS, "ambient-cni", kubeenv.ShippedRBAC(t))
	if _, err := env.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	agentClient, err := kubeclient.NewForConfig(agentCfg)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(env.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	run, state, err := writeCredential(t, env, agentClient, sysNS, "ambient-cni-plugin", node, agentDS, ca)
	if err != nil {
		t.Fatalf("the agent's shipped RBAC could not get the plugin a node-bound token: %v", err)
	}
	buildFallback(t, state)

	amb := map[string]string{"istio.io/dataplane-mode": "ambient"}
	env.CreateNamespace(t, "fb-shop", amb)
	env.CreateNamespace(t, "fb-plain", nil)
	env.CreateNamespace(t, "fb-fresh", nil)
	mk := func(ns, name string, labels map[string]string) *corev1.Pod {
		p, err := env.Client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
			Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "app"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	nsEnabled := mk("fb-shop", "web", nil)
	podLabelled := mk("fb-plain", "labelled", amb)
	plain := mk("fb-plain", "app", nil)
	fresh := mk("fb-fresh", "web", nil)
	istiod := mk(sysNS, "istiod", nil)
	// A namespace labelled during the outage.
	if _, err := env.Client.CoreV1().Namespaces().Update(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "fb-fresh", Labels: amb}}, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	// The agent's DaemonSet, still running on the node: the agent is only
	// away, and the waits say to look for it.
	ds := agentDaemonSet(sysNS, agentDS)
	if _, err := env.Client.AppsV1().DaemonSets(sysNS).Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*corev1.Pod{nsEnabled, podLabelled, fresh} {
		err := addWithoutAgent(t, run, state, p)
		wantWaits(t, err, p.Namespace+"/"+p.Name)
		wantWaitForAgent(t, err, p.Namespace+"/"+p.Name)
	}
	wantStarts(t, addWithoutAgent(t, run, state, plain), "plain pod")
	wantStarts(t, addWithoutAgent(t, run, state, istiod), "istio-system pod")

	t.Run("DaemonSet left the node while down", func(t *testing.T) {
		oldRun, oldState := olderChartCredential(t, env, sysNS, node, agentDS, ca)
		// Moved away by its nodeSelector, then deleted: either way no
		// agent will return, and the wait says so, and what ends it; the
		// pod still waits (fail closed), a plain pod still starts.
		ds.Spec.Template.Spec.NodeSelector = map[string]string{"ambient-cni.test/agent": "elsewhere"}
		if _, err := env.Client.AppsV1().DaemonSets(sysNS).Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name, want string
			change     func()
		}{
			{"node not selected", "the agent's DaemonSet istio-system/ambient-cni no longer runs on node node-fallback (its nodeSelector does not match the node's labels)", func() {}},
			{"deleted", "the agent's DaemonSet istio-system/ambient-cni is deleted", func() {
				if err := env.Client.AppsV1().DaemonSets(sysNS).Delete(ctx, agentDS, metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
			}},
		} {
			c.change()
			for _, p := range []*corev1.Pod{nsEnabled, podLabelled, fresh} {
				what := c.name + ": " + p.Namespace + "/" + p.Name
				err := addWithoutAgent(t, run, state, p)
				wantWaits(t, err, what)
				if err == nil || !strings.HasPrefix(err.Error(), "ambient-cni: "+c.want+".") ||
					!strings.Contains(err.Error(), "Put the node back in the DaemonSet's scope") || !strings.Contains(err.Error(), filepath.Join(state, "uninstalling")) {
					t.Errorf("%s: %v, want it to say first that %s, then the remedy", what, err, c.want)
				}
				// An older chart's plugin role cannot read the DaemonSet or
				// the node: the wait reads as before, no harder.
				err = addWithoutAgent(t, oldRun, oldState, p)
				wantWaits(t, err, "older chart, "+what)
				wantWaitForAgent(t, err, "older chart, "+what)
			}
			wantStarts(t, addWithoutAgent(t, run, state, plain), c.name+": plain pod")
			wantStarts(t, addWithoutAgent(t, oldRun, oldState, plain), c.name+": older chart, plain pod")
		}
	})

	// The API server down too: no snapshot here, so only the control plane
	// starts.
	env.StopAPIServer()
	wantWaits(t, addWithoutAgent(t, run, state, plain), "plain pod, API server down, no snapshot")
	wantStarts(t, addWithoutAgent(t, run, state, istiod), "istio-system pod, API server down")
	wantWaits(t, addWithoutAgent(t, run, state, podLabelled), "pod-label-enabled pod, API server down")
	if err := env.StartAPIServer(ctx, 60e9); err != nil {
		t.Fatal(err)
	}
	wantStarts(t, addWithoutAgent(t, run, state, plain), "plain pod, API server back")
}
