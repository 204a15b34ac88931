package integration

import (
	"io"
	"testing"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// harnessSettings are the only install-cni settings a test node sets
// beyond the chart's environment with simnode's NodeLocal settings (where
// things are on the node, who the agent is), each with the reason it
// differs. Tuning settings (client rate limit, timeouts, log level, DNS
// capture, rules backend, ...) are not here: the suite runs them as
// shipped, so a tuned test setup cannot hide a production bottleneck. The
// rules backend runs as shipped too (auto); pkg/rulesbackend's matrix
// covers every backend.
var harnessSettings = map[string]string{
	"pod-namespace": "a namespace per node (simnode sets it), so one node's DaemonSet never makes another's shutdown an upgrade",
	"metrics-addr":  "a free loopback port: several agents run in one test process",
	"ztunnel-wait":  "only TestZtunnelHandoff shortens it, to time the wait without a stand-in",
	// Off as shipped; only TestStartupTaint turns them on, as the chart's
	// startupTaint values do.
	"startup-taint":             "only TestStartupTaint, as startupTaint.enabled",
	"startup-taint-on-shutdown": "only TestStartupTaint, as startupTaint.restoreOnShutdown",
	"enablement-selector":       "only TestEnablementSelectors sets a list of its own, to prove the setting is followed",
	"verify-period":             "only the verifier's tests shorten it, so a tamper is found within a test's wait; TestVerifierShippedPeriod pins the default",
}

// TestHarnessRunsShippedDefaults pins what the suite runs the agent with
// to the shipped defaults: every setting the harness adds to the chart's
// environment is listed above, and the agent's client is rate limited as
// shipped (requireShippedClient checks that on every node the suite
// starts). test/deploy keeps install-cni's defaults equal to the chart's
// default values.
func TestHarnessRunsShippedDefaults(t *testing.T) {
	for _, tuning := range []string{"kube-client-qps", "kube-client-burst", "annotation-qps", "annotation-burst", "plugin-timeout", "log-level", "dns-capture", "rules-backend", "iptables-backend"} {
		if _, ok := harnessSettings[tuning]; ok {
			t.Errorf("the harness may not set %s: it is a tuning setting, run it as shipped", tuning)
		}
	}
	settings := nodeSettings(nodeOptions{ZtunnelWait: time.Second, EnablementSelector: "[]", VerifyPeriod: time.Second})
	settings["pod-namespace"] = "ns"
	for name := range settings {
		if _, ok := harnessSettings[name]; !ok {
			t.Errorf("the harness sets %s, which is not listed in harnessSettings", name)
		}
	}
	cfg := chartConfig(t, settings)
	shipped, err := installcni.Parse([]string{"--node-name=n"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.KubeClientQPS != shipped.KubeClientQPS || cfg.KubeClientBurst != shipped.KubeClientBurst ||
		cfg.PluginTimeout != shipped.PluginTimeout || cfg.DNSCapture != shipped.DNSCapture ||
		cfg.RulesBackend != shipped.RulesBackend || cfg.LogLevel != shipped.LogLevel {
		t.Errorf("harness config %+v differs from the shipped %+v in a tuning setting", cfg, shipped)
	}
}

// chartConfig is install-cni's configuration from the committed chart's
// DaemonSet environment, with settings (install-cni flag names) on top,
// as a simulated node would start it.
func chartConfig(t *testing.T, settings map[string]string) *installcni.Config {
	t.Helper()
	chart, err := simnode.CommittedChart()
	if err != nil {
		t.Fatal(err)
	}
	env, err := simnode.AgentEnv(chart, simnode.Paths{
		Name: "n", PodName: "p", CNIBinDir: "/tmp/x/bin", CNIConfDir: "/tmp/x/net.d", PluginBinary: "/tmp/x/ambient-cni",
		AgentSocket: "/tmp/x/agent.sock", ZDSSocket: "/tmp/x/zt.sock", StateDir: "/tmp/x/state", Kubeconfig: "/tmp/x/kubeconfig",
	}, settings)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := installcni.Parse(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
