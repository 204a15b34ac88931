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
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/kubeadapter"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/plugin"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// pluginRBAC is the plugin's own ClusterRole from the shipped manifest.
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
	var out []byte
	for doc := range strings.SplitSeq(string(manifest), "\n---\n") {
		if strings.Contains(doc, "kind: ClusterRole\n") && strings.Contains(doc, "name: ambient-cni-plugin\n") {
			out = append(out, []byte("---\n"+doc+"\n")...)
		}
	}
	if out == nil {
		t.Fatal("no ClusterRole ambient-cni-plugin in the shipped manifest")
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
	const sysNS, node = "istio-system", "node-fallback"
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
	root := t.TempDir()
	run, state := filepath.Join(root, "run"), filepath.Join(root, "state")
	rot := &plugincred.Rotator{
		Path: nodefiles.ForSocket(filepath.Join(run, "agent.sock")).WithStateDir(state).PluginCredential(),
		Base: plugincred.File{Server: env.Config.Host, CA: string(ca), NodeName: node,
			Policy: plugincred.Policy{ExcludedNamespaces: []string{"kube-system"}, DataPlaneNamespaces: []string{sysNS}}},
		Source:   kubeadapter.PluginTokens{Client: agentClient, Namespace: sysNS, ServiceAccount: "ambient-cni-plugin", NodeName: node},
		Lifetime: 3600e9,
	}
	if err := rot.WriteOnce(ctx); err != nil {
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

	wantWaits(t, addWithoutAgent(t, run, state, nsEnabled), "namespace-enabled pod")
	wantWaits(t, addWithoutAgent(t, run, state, podLabelled), "pod-label-enabled pod")
	wantWaits(t, addWithoutAgent(t, run, state, fresh), "pod of a namespace labelled during the outage")
	wantStarts(t, addWithoutAgent(t, run, state, plain), "plain pod")
	wantStarts(t, addWithoutAgent(t, run, state, istiod), "istio-system pod")

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
