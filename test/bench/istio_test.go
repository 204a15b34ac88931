package bench

import (
	"context"
	"net/url"
	"path/filepath"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// Istio's peer runs with its chart's ambient environment: the ConfigMap
// and the DaemonSet's own entries, the downward-API fields filled as a
// kubelet fills them, and only where-things-are settings added.
func TestIstioChartEnvironment(t *testing.T) {
	kubeenv.RequireTool(t, kubeenv.Helm)
	// The chart of the minor the tests run, from its source: the same
	// files its istio-cni tool directory holds, without waiting for that
	// build.
	minor, err := kubeenv.IstioMinor()
	if err != nil {
		t.Fatal(err)
	}
	src, err := kubeenv.IstioSource(minor)
	if err != nil {
		testnet.Missing(t, err.Error())
	}
	for _, nft := range []bool{false, true} {
		c, err := renderIstioChart(context.Background(), filepath.Join(src, "manifests", "charts", "istio-cni"), nft)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"AMBIENT_ENABLED": "true", "REPAIR_RUN_AS_DAEMON": "true", "CHAINED_CNI_PLUGIN": "true"}
		if nft {
			want["NATIVE_NFTABLES"] = "true"
		} else {
			want["NATIVE_NFTABLES"] = "false"
		}
		for k, v := range want {
			if c.Env[k] != v {
				t.Errorf("nativeNftables=%v: %s=%q, want %q", nft, k, c.Env[k], v)
			}
		}
		if _, ok := c.Env["ALLOW_SWITCH_TO_HOST_NS"]; ok {
			t.Errorf("the host-network DaemonSet sets ALLOW_SWITCH_TO_HOST_NS: %v", c.Env)
		}
		if c.FieldEnv["NODE_NAME"] != "spec.nodeName" || c.ServiceAccount == "" || len(c.RBAC) == 0 {
			t.Errorf("chart %+v", c)
		}
		n := &istioNode{RunDir: "/x/run"}
		for k := range istioNodeLocal(n, &url.URL{Host: "127.0.0.1:6443"}) {
			if v, ok := c.Env[k]; ok {
				t.Errorf("the harness overrides the chart's %s=%q: only where things are may differ", k, v)
			}
		}
	}
}
