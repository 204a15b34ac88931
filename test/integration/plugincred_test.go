package integration

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// The agent chains the plugin even without the plugin's own credential:
// unchained, a pod that must be captured would start uncaptured while the
// agent is up; chained without one, only pods the snapshot cannot vouch
// for wait, and only while the agent is away. The missing credential is
// told by the metrics the critical AmbientCNIPluginCredentialExpiring
// alert reads (expiry 0), not by readiness, which would hold a rollout and
// the node's startup taint. Here the API server refuses the token (it is
// bound to the node's Node object, not registered yet): the agent counts
// the failures, chains the plugin and stays ready. Once the Node exists
// the next attempt gets a token of the chart's default lifetime from a
// real kube-apiserver with default flags (a year, granted in full).
func TestChainedWithoutPluginCredential(t *testing.T) {
	n := newNode(t, nodeOptions{PluginCredential: true, NoWaitReady: true})
	conf := filepath.Join(n.confDir, simnode.PrimaryConf)
	chained := func() bool {
		b, err := os.ReadFile(conf)
		return err == nil && bytes.Contains(b, []byte(`"`+cnibin.PluginName+`"`))
	}
	failures := func() float64 { return counterValue(t, n.metrics.PluginCredentialFailures) }
	poll.Until(t, "the agent to count refused token requests", func() bool { return failures() >= 3 })
	poll.Until(t, "the plugin chained without a credential", chained)
	if _, err := os.Stat(n.cfg.Layout().PluginCredential()); err == nil {
		t.Fatal("a credential file exists though no token was issued")
	}
	if r := n.d.Ready(); slices.ContainsFunc(r, func(s string) bool { return strings.Contains(s, "plugin-credential") }) {
		t.Errorf("readiness without a credential: %v, want no plugin-credential check", r)
	}
	if v := gaugeValue(t, n.metrics.PluginCredentialExpiry); v != 0 {
		t.Errorf("expiry metric %v without a credential, want 0", v)
	}

	if _, err := n.env.Client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.env.Client.CoreV1().Nodes().Delete(context.Background(), n.Name, metav1.DeleteOptions{}) })
	start := time.Now()
	var f *plugincred.File
	poll.Until(t, "a credential in place once the Node exists", func() bool {
		var err error
		f, err = plugincred.Read(n.cfg.Layout().PluginCredential())
		return err == nil
	})
	_, exp, err := plugincred.Claims(f.Token)
	if err != nil {
		t.Fatal(err)
	}
	// The chart's default lifetime, granted in full by the API server.
	if got := exp.Sub(start); n.cfg.PluginTokenLifetime < 365*24*time.Hour || got < n.cfg.PluginTokenLifetime-time.Minute {
		t.Errorf("token expires %v from now; the chart asks %v, want at least a year granted", got, n.cfg.PluginTokenLifetime)
	}
	// The expiry the API server answered; the token's own claim is
	// stamped from its own reading of the clock.
	if v := gaugeValue(t, n.metrics.PluginCredentialExpiry); v < float64(exp.Unix()-2) || v > float64(exp.Unix()+2) {
		t.Errorf("expiry metric %v, want the token's %d", v, exp.Unix())
	}
	if v := gaugeValue(t, n.metrics.PluginCredentialIssued); v < float64(start.Add(-time.Minute).Unix()) || v > float64(time.Now().Unix()+1) {
		t.Errorf("issued metric %v, want about %d", v, start.Unix())
	}
	poll.Until(t, "the agent ready", func() bool { return len(n.d.Ready()) == 0 })

	// An uninstall (this node has no DaemonSet) takes the credential
	// away with the agent's other node files: once the plugin is
	// unchained nothing reads it, and an API token has no business on a
	// node the mesh has left.
	n.stopDaemon()
	if _, err := os.Lstat(n.cfg.Layout().PluginCredential()); !os.IsNotExist(err) {
		t.Errorf("the plugin's credential outlived the uninstall: %v", err)
	}
}

func counterValue(t *testing.T, c prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func gaugeValue(t *testing.T, g prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}
