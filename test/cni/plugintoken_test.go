package cni

import (
	"context"
	"errors"
	"io"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestPluginTokenLifetimeGranted: install-cni's default lifetime for the
// plugin's token (a year) is what a real kube-apiserver with default
// flags grants, in full, to a Node-bound TokenRequest made under the
// agent's shipped RBAC; the rotator renews it within a day. The token
// is refused once its Node object is deleted: a node taken out of the
// cluster keeps no year-long credential.
func TestPluginTokenLifetimeGranted(t *testing.T) {
	env := kubeenv.Start(t)
	ctx := context.Background()
	const sysNS, sa, node = "istio-system", "ambient-cni-plugin", "node-token"
	env.CreateNamespace(t, sysNS, nil)
	pluginCfg, _ := env.ServiceAccountClient(t, sysNS, sa, pluginRBAC(t))
	agentCfg, _ := env.ServiceAccountClient(t, sysNS, "ambient-cni", kubeenv.ShippedRBAC(t))
	created, err := env.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Client.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{}) })
	agent, err := kubeclient.NewForConfig(agentCfg)
	if err != nil {
		t.Fatal(err)
	}
	defaults, err := installcni.Parse([]string{"--node-name=" + node}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(env.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	r := &plugincred.Rotator{
		Path: t.TempDir() + "/plugin-credential.json",
		Base: plugincred.File{Server: env.Config.Host, CA: string(ca), NodeName: node,
			Policy: plugincred.Policy{ExcludedNamespaces: []string{"kube-system"}, DataPlaneNamespaces: []string{sysNS}}},
		Source:   apicalls.PluginTokens{Client: agent, Namespace: sysNS, ServiceAccount: sa, NodeName: node},
		Lifetime: defaults.PluginTokenLifetime,
	}
	asked := time.Now()
	if err := r.WriteOnce(ctx); err != nil {
		t.Fatalf("the agent's shipped RBAC could not get a token of the default lifetime %v: %v", defaults.PluginTokenLifetime, err)
	}
	issued, exp, _ := r.InPlace()
	if defaults.PluginTokenLifetime < 365*24*time.Hour || exp.Sub(asked) < defaults.PluginTokenLifetime-time.Minute {
		t.Fatalf("default lifetime %v; the API server granted %v: want at least a year, in full", defaults.PluginTokenLifetime, exp.Sub(asked))
	}
	f, err := plugincred.Read(r.Path)
	if err != nil {
		t.Fatal(err)
	}
	if _, claimed, err := plugincred.Claims(f.Token); err != nil || claimed.Sub(exp).Abs() > 2*time.Second {
		t.Errorf("token claims expiry %v (%v), the API server answered %v", claimed, err, exp)
	}
	if issued.After(time.Now()) || exp.Sub(issued) < 364*24*time.Hour || plugincred.DefaultRenewAfter > 24*time.Hour {
		t.Errorf("issued %v, expires %v, renewed after %v: want a renewal within a day", issued, exp, plugincred.DefaultRenewAfter)
	}

	// The token reads as the plugin's identity while its Node exists.
	client := func() kubernetes.Interface {
		cfg := rest.AnonymousClientConfig(pluginCfg)
		cfg.BearerToken = f.Token
		c, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}()
	if _, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); err != nil {
		t.Fatalf("the plugin's token: %v", err)
	}
	if err := env.Client.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &created.UID}}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the token refused once its Node is deleted", func() bool {
		_, err := client.CoreV1().Namespaces().Get(ctx, sysNS, metav1.GetOptions{})
		var se *apierrors.StatusError
		return apierrors.IsUnauthorized(err) || (errors.As(err, &se) && se.ErrStatus.Code == 401)
	})
}
