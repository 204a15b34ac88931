package e2e

import (
	"io"
	"strings"
	"testing"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
)

// harnessSettings are the only install-cni settings a test node sets, each
// with the reason it differs from the shipped default. Tuning settings
// (client rate limit, timeouts, log level, DNS capture, rules backend, ...)
// are not here: the suite runs them as shipped, so a tuned test setup
// cannot hide a production bottleneck. The rules backend runs as shipped
// too (auto); pkg/rulesbackend's matrix covers every backend.
var harnessSettings = map[string]string{
	"node-name":     "identity of the simulated node (the downward API in the chart)",
	"pod-name":      "identity of the agent's pod (the downward API in the chart)",
	"pod-namespace": "identity of the agent's pod (the downward API in the chart)",
	"cni-bin-dir":   "the test node's CNI directories (host mounts in the chart)",
	"cni-conf-dir":  "the test node's CNI directories (host mounts in the chart)",
	"plugin-binary": "the plugin built as make build builds it (the image's copy in the chart)",
	"agent-socket":  "a private directory per node, so parallel nodes never share a socket",
	"zds-socket":    "a private directory per node, so parallel nodes never share a socket",
	"health-addr":   "a free loopback port: several agents run in one test process",
	"metrics-addr":  "a free loopback port: several agents run in one test process",
	"ztunnel-wait":  "only TestZtunnelHandoff shortens it, to time the wait without a stand-in",
	// Off as shipped; only TestStartupTaint turns them on, as the chart's
	// startupTaint values do.
	"startup-taint":             "only TestStartupTaint, as startupTaint.enabled",
	"startup-taint-on-shutdown": "only TestStartupTaint, as startupTaint.restoreOnShutdown",
}

// TestHarnessRunsShippedDefaults pins what the suite runs the agent with
// to the shipped defaults: every flag the harness passes is a node-local
// setting listed above, nothing comes from the environment, and the
// agent's client is rate limited as shipped (requireShippedClient checks
// that on every node the suite starts). test/deploy keeps install-cni's
// defaults equal to the chart's default values.
func TestHarnessRunsShippedDefaults(t *testing.T) {
	for _, tuning := range []string{"kube-client-qps", "kube-client-burst", "plugin-timeout", "log-level", "dns-capture", "rules-backend", "iptables-backend"} {
		if _, ok := harnessSettings[tuning]; ok {
			t.Errorf("the harness may not set %s: it is a tuning setting, run it as shipped", tuning)
		}
	}
	args := agentArgs(agentSetup{
		node: "n", pod: "p", namespace: "ns", dir: "/tmp/x", binDir: "/tmp/x/bin", confDir: "/tmp/x/net.d",
		plugin: "/tmp/x/ambient-cni",
	}, nodeOptions{ZtunnelWait: time.Second})
	for _, a := range args {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if _, ok := harnessSettings[name]; !ok {
			t.Errorf("the harness sets %s, which is not a node-local setting in harnessSettings", a)
		}
	}
	cfg, err := installcni.Parse(args, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
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
