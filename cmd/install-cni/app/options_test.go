package app

import (
	"bytes"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

func env(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestDefaults(t *testing.T) {
	c, err := Parse([]string{"--node-name=n1"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	type defaults struct {
		ZDSSocket          string
		ZtunnelWait        time.Duration
		ProbeSNATv4        netip.Addr
		ExcludedNamespaces []string
		PluginType         string
		DNSCapture         bool
		RulesBackend       string
	}
	got := defaults{c.ZDSSocket, c.ZtunnelWait, c.ProbeSNATv4, c.ExcludedNamespaces, c.PluginType, c.DNSCapture, c.RulesBackend.String()}
	want := defaults{"/var/run/ztunnel/ztunnel.sock", 5 * time.Second, netip.MustParseAddr("169.254.7.127"), []string{"kube-system"}, "ambient-cni", true, "auto"}
	if diff := cmp.Diff(want, got, cmpopts.EquateComparable(netip.Addr{})); diff != "" {
		t.Fatalf("defaults wrong (-want +got):\n%s", diff)
	}
}

func TestEnvThenFlags(t *testing.T) {
	e := env(map[string]string{
		"AMBIENT_NODE_NAME":           "from-env",
		"AMBIENT_EXCLUDED_NAMESPACES": "a, b,,c",
		"AMBIENT_DNS_CAPTURE":         "true",
		"AMBIENT_ZTUNNEL_WAIT":        "2s",
	})
	c, err := Parse([]string{"--ztunnel-wait=3s"}, e, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	type precedence struct {
		NodeName           string
		ExcludedNamespaces []string
		DNSCapture         bool
		ZtunnelWait        time.Duration
	}
	got := precedence{c.NodeName, c.ExcludedNamespaces, c.DNSCapture, c.ZtunnelWait}
	if diff := cmp.Diff(precedence{"from-env", []string{"a", "b", "c"}, true, 3 * time.Second}, got); diff != "" {
		t.Fatalf("env/flag precedence wrong (-want +got):\n%s", diff)
	}
}

// TestIPv6Setting: IPv6 is captured by default, as with Istio's
// ambient.ipv6; Istio's variable AMBIENT_IPV6 and --ipv6 turn it off.
func TestIPv6Setting(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want bool
	}{
		{nil, nil, true},
		{nil, map[string]string{"AMBIENT_IPV6": "false"}, false},
		{[]string{"--ipv6=false"}, nil, false},
		{[]string{"--ipv6=true"}, map[string]string{"AMBIENT_IPV6": "false"}, true},
	} {
		c, err := Parse(append([]string{"--node-name=n"}, tc.args...), env(tc.env), io.Discard)
		if err != nil {
			t.Fatalf("%v %v: %v", tc.args, tc.env, err)
		}
		if c.IPv6 != tc.want {
			t.Errorf("%v %v: IPv6 = %v, want %v", tc.args, tc.env, c.IPv6, tc.want)
		}
	}
}

// TestRulesBackendAlias: the backend is set by --rules-backend or its old
// name --iptables-backend, and by their environment variables; the new
// names win.
func TestRulesBackendAlias(t *testing.T) {
	cases := []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--rules-backend=nftables"}, nil, "nftables"},
		{[]string{"--iptables-backend=legacy"}, nil, "legacy"},
		{nil, map[string]string{"AMBIENT_IPTABLES_BACKEND": "nft"}, "nft"},
		{nil, map[string]string{"AMBIENT_RULES_BACKEND": "iptables", "AMBIENT_IPTABLES_BACKEND": "nft"}, "iptables"},
		{[]string{"--iptables-backend=nft"}, map[string]string{"AMBIENT_RULES_BACKEND": "nftables"}, "nft"},
	}
	for _, tc := range cases {
		c, err := Parse(append([]string{"--node-name=n"}, tc.args...), env(tc.env), io.Discard)
		if err != nil {
			t.Errorf("%v %v: %v", tc.args, tc.env, err)
			continue
		}
		if got := c.RulesBackend.String(); got != tc.want {
			t.Errorf("%v %v: backend %s, want %s", tc.args, tc.env, got, tc.want)
		}
	}
}

func TestRejectsBadInput(t *testing.T) {
	cases := map[string]struct {
		args []string
		env  map[string]string
		want string
	}{
		"no node":                      {nil, nil, "node name is required"},
		"bad duration env":             {nil, map[string]string{"AMBIENT_NODE_NAME": "n", "AMBIENT_ZTUNNEL_WAIT": "soon"}, "AMBIENT_ZTUNNEL_WAIT"},
		"negative duration":            {[]string{"--node-name=n", "--ztunnel-wait=-1s"}, nil, "positive"},
		"timeout below wait":           {[]string{"--node-name=n", "--plugin-timeout=2s", "--ztunnel-wait=3s"}, nil, "must exceed"},
		"v6 as v4":                     {[]string{"--node-name=n", "--probe-snat-ipv4=fd00::1"}, nil, "IPv4"},
		"bad bool":                     {[]string{"--node-name=n", "--dns-capture=yes please"}, nil, "true or false"},
		"bad backend":                  {[]string{"--node-name=n", "--rules-backend=ebtables"}, nil, "nftables, iptables, nft or legacy"},
		"bad backend (old)":            {[]string{"--node-name=n", "--iptables-backend=ebtables"}, nil, "nftables, iptables, nft or legacy"},
		"bad backend env":              {nil, map[string]string{"AMBIENT_NODE_NAME": "n", "AMBIENT_IPTABLES_BACKEND": "ebtables"}, "AMBIENT_IPTABLES_BACKEND"},
		"relative socket":              {[]string{"--node-name=n", "--agent-socket=agent.sock"}, nil, "absolute"},
		"relative netns dir":           {[]string{"--node-name=n", "--netns-dirs=/run/netns,netns"}, nil, "not absolute"},
		"relative host conf dir":       {[]string{"--node-name=n", "--cni-host-conf-dir=etc/cni/net.d"}, nil, "not a clean absolute path"},
		"unclean host conf dir":        {[]string{"--node-name=n", "--cni-host-conf-dir=/etc/cni/../net.d"}, nil, "not a clean absolute path"},
		"unknown flag":                 {[]string{"--node-name=n", "--frobnicate"}, nil, "frobnicate"},
		"stray argument":               {[]string{"--node-name=n", "extra"}, nil, "unexpected"},
		"bad log level":                {[]string{"--node-name=n", "--log-level=loud"}, nil, "debug, info"},
		"bad selector env":             {nil, map[string]string{"AMBIENT_NODE_NAME": "n", "AMBIENT_ENABLEMENT_SELECTOR": "- podSelector: {matchExpression: []}"}, "AMBIENT_ENABLEMENT_SELECTOR"},
		"empty selector":               {[]string{"--node-name=n", "--enablement-selector= "}, nil, "empty"},
		"relative extra bin dir":       {[]string{"--node-name=n", "--cni-extra-bin-dirs=/host/usr/libexec/cni,opt/cni/bin"}, nil, `"opt/cni/bin" is not an absolute path`},
		"extra bin dir twice":          {[]string{"--node-name=n", "--cni-extra-bin-dirs=/host/a,/host/a/"}, nil, "/host/a is listed twice"},
		"extra bin dir is the bin dir": {[]string{"--node-name=n", "--cni-bin-dir=/host/opt/cni/bin", "--cni-extra-bin-dirs=/host/opt/cni/bin/"}, nil, "lists cni-bin-dir /host/opt/cni/bin again"},
		"empty extra bin dir":          {[]string{"--node-name=n", "--cni-extra-bin-dirs=/host/a,,/host/b"}, nil, "empty entry"},
		"trailing comma env":           {nil, map[string]string{"AMBIENT_NODE_NAME": "n", "AMBIENT_CNI_EXTRA_BIN_DIRS": "/host/a,"}, "AMBIENT_CNI_EXTRA_BIN_DIRS"},
	}
	for name, c := range cases {
		_, err := Parse(c.args, env(c.env), io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want it to mention %q", name, err, c.want)
		}
	}
}

// TestExtraBinDirs: none by default; a list from the environment or a flag
// (the flag winning), cleaned; an empty flag clears the environment's.
func TestExtraBinDirs(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want []string
	}{
		{nil, nil, nil},
		{nil, map[string]string{"AMBIENT_CNI_EXTRA_BIN_DIRS": "/host/usr/libexec/cni, /host/opt/cni/bin2/"}, []string{"/host/usr/libexec/cni", "/host/opt/cni/bin2"}},
		{[]string{"--cni-extra-bin-dirs=/host/b"}, map[string]string{"AMBIENT_CNI_EXTRA_BIN_DIRS": "/host/a"}, []string{"/host/b"}},
		{[]string{"--cni-extra-bin-dirs="}, map[string]string{"AMBIENT_CNI_EXTRA_BIN_DIRS": "/host/a"}, nil},
	} {
		e := map[string]string{"AMBIENT_NODE_NAME": "n"}
		for k, v := range tc.env {
			e[k] = v
		}
		c, err := Parse(tc.args, env(e), io.Discard)
		if err != nil {
			t.Fatalf("%v %v: %v", tc.args, tc.env, err)
		}
		if diff := cmp.Diff(tc.want, c.CNIExtraBinDirs); diff != "" {
			t.Errorf("%v %v: extra bin dirs (-want +got):\n%s", tc.args, tc.env, diff)
		}
	}
}

// The annotation writes have a budget of their own, below the client's
// (the kubelet's 50/100 by default), and a budget that would take the
// client's whole limit is refused.
func TestAnnotationLimits(t *testing.T) {
	c, err := Parse([]string{"--node-name=n1"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.AnnotationQPS != 50 || c.AnnotationBurst != 100 {
		t.Errorf("default annotation limits %v/%d, want the kubelet's 50/100", c.AnnotationQPS, c.AnnotationBurst)
	}
	c, err = Parse([]string{"--node-name=n1", "--annotation-burst=20"}, env(map[string]string{"AMBIENT_ANNOTATION_QPS": "10"}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.AnnotationQPS != 10 || c.AnnotationBurst != 20 {
		t.Errorf("annotation limits %v/%d, want 10/20", c.AnnotationQPS, c.AnnotationBurst)
	}
	for _, args := range [][]string{
		{"--annotation-qps=80"},
		{"--annotation-burst=160"},
		{"--kube-client-qps=40", "--annotation-qps=45"},
		{"--annotation-qps=0"},
	} {
		if _, err := Parse(append([]string{"--node-name=n1"}, args...), env(nil), io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
	// A client limit lowered below the defaults (a setting older releases
	// accepted) takes the default annotation budget down with it: an
	// upgrade must not stop the agent.
	c, err = Parse([]string{"--node-name=n1", "--kube-client-qps=40", "--kube-client-burst=80"}, env(nil), io.Discard)
	if err != nil {
		t.Fatalf("a lowered client limit with the default annotation budget: %v", err)
	}
	if c.AnnotationQPS != 25 || c.AnnotationBurst != 50 {
		t.Errorf("annotation limits %v/%d under a 40/80 client, want 25/50", c.AnnotationQPS, c.AnnotationBurst)
	}
}

// TestDocsUpToDate keeps docs/install-cni.md in step with the settings
// table; regenerate with UPDATE_DOCS=1 go test ./cmd/install-cni/app.
func TestDocsUpToDate(t *testing.T) {
	const path = "../../../docs/install-cni.md"
	const begin, end = "<!-- BEGIN GENERATED OPTIONS -->\n", "<!-- END GENERATED OPTIONS -->\n"
	doc, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	i, j := bytes.Index(doc, []byte(begin)), bytes.Index(doc, []byte(end))
	if i < 0 || j < i {
		t.Fatalf("%s lacks the generated-options markers", path)
	}
	var table bytes.Buffer
	if err := WriteMarkdown(&table); err != nil {
		t.Fatal(err)
	}
	want := append(append(append([]byte{}, doc[:i+len(begin)]...), table.Bytes()...), doc[j:]...)
	if !bytes.Equal(doc, want) {
		if os.Getenv("UPDATE_DOCS") == "1" {
			if err := os.WriteFile(path, want, 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
		t.Fatalf("%s is out of date; run UPDATE_DOCS=1 go test ./cmd/install-cni/app", path)
	}
}

// The client-side rate limit is a setting with a default fit for a node
// agent (Istio's CNI agent uses QPS 80, burst 160; client-go's own 5/10
// capped the agent at 5 pods/s), and it reaches the client config.
func TestKubeClientLimits(t *testing.T) {
	c, err := Parse([]string{"--node-name=n1"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.KubeClientQPS < 80 || c.KubeClientBurst < 160 {
		t.Errorf("default client limits %v/%d, want at least Istio's 80/160", c.KubeClientQPS, c.KubeClientBurst)
	}
	c, err = Parse([]string{"--node-name=n1", "--kube-client-burst=7", "--annotation-qps=1", "--annotation-burst=2"}, env(map[string]string{"AMBIENT_KUBE_CLIENT_QPS": "2.5"}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	base := &rest.Config{Host: "https://127.0.0.1:6443", QPS: 500, Burst: 1000, RateLimiter: flowcontrol.NewFakeAlwaysRateLimiter()}
	rc := c.KubeClientConfig(base)
	if rc.QPS != 2.5 || rc.Burst != 7 || rc.RateLimiter != nil || rc.UserAgent != "ambient-cni/n1" || rc.Host != base.Host ||
		rc.ContentType != "application/vnd.kubernetes.protobuf" {
		t.Errorf("client config %+v", rc)
	}
	if base.QPS != 500 || base.UserAgent != "" {
		t.Errorf("base config changed: %+v", base)
	}
	for _, bad := range []map[string]string{
		{"AMBIENT_KUBE_CLIENT_QPS": "0"}, {"AMBIENT_KUBE_CLIENT_QPS": "-1"}, {"AMBIENT_KUBE_CLIENT_QPS": "NaN"},
		{"AMBIENT_KUBE_CLIENT_QPS": "Inf"}, {"AMBIENT_KUBE_CLIENT_QPS": "1e40"}, {"AMBIENT_KUBE_CLIENT_QPS": "fast"},
		{"AMBIENT_KUBE_CLIENT_BURST": "0"}, {"AMBIENT_KUBE_CLIENT_BURST": "1.5"}, {"AMBIENT_KUBE_CLIENT_BURST": "-3"},
	} {
		if _, err := Parse([]string{"--node-name=n1"}, env(bad), io.Discard); err == nil || !strings.Contains(err.Error(), "positive") {
			t.Errorf("%v: err = %v, want a refusal", bad, err)
		}
	}
}

// The data-plane labels exempt pods only in the agent's own namespace
// unless the setting names others.
func TestDataPlaneNamespaces(t *testing.T) {
	c, err := Parse([]string{"--node-name=n1", "--pod-namespace=istio-system"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.EnablementPolicy().DataPlaneNamespaces; !slices.Equal(got, []string{"istio-system"}) {
		t.Errorf("default data-plane namespaces %v, want the agent's own", got)
	}
	c, err = Parse([]string{"--node-name=n1", "--pod-namespace=istio-system"}, env(map[string]string{"AMBIENT_DATA_PLANE_NAMESPACES": "istio-system,ztunnel"}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.EnablementPolicy().DataPlaneNamespaces; !slices.Equal(got, []string{"istio-system", "ztunnel"}) {
		t.Errorf("data-plane namespaces %v, want the configured ones", got)
	}
}

// Istio's namespace is the control plane's wherever the agent is installed
// (GKE installs often use kube-system): istiod, ztunnel and the gateways
// never wait on the agent; an explicit list replaces the default.
func TestControlPlaneNamespaces(t *testing.T) {
	c, err := Parse([]string{"--node-name=n1", "--pod-namespace=kube-system"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.ControlPlane(); !slices.Equal(got, []string{"istio-system", "kube-system"}) {
		t.Errorf("control-plane namespaces of an agent in kube-system %v, want istio-system and kube-system", got)
	}
	c, err = Parse([]string{"--node-name=n1", "--pod-namespace=mesh"}, env(map[string]string{"AMBIENT_CONTROL_PLANE_NAMESPACES": "openshift-*"}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.ControlPlane(); !slices.Equal(got, []string{"mesh", "openshift-*"}) {
		t.Errorf("control-plane namespaces %v, want the configured ones and the agent's own", got)
	}
}

// The selector setting reaches the policy; without it the policy decides
// as Istio's default list does.
func TestEnablementSelector(t *testing.T) {
	meshNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"mesh": "yes"}}}
	ambientNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}}
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "shop"}}
	c, err := Parse([]string{"--node-name=n1"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !c.EnablementPolicy().Decide(p, ambientNS).Enroll || c.EnablementPolicy().Decide(p, meshNS).Enroll {
		t.Error("the default selectors do not decide as Istio's default list")
	}
	c, err = Parse([]string{"--node-name=n1"}, env(map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "- namespaceSelector:\n    matchLabels: {mesh: \"yes\"}\n"}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.EnablementPolicy().Decide(p, ambientNS).Enroll || !c.EnablementPolicy().Decide(p, meshNS).Enroll {
		t.Error("the configured selectors are not the policy's")
	}
}

// The first log line's settings are the effective values: defaults,
// environment, flags (flags win), and the annotation budget as validate
// lowered it; one key per setting.
func TestSettingsAttr(t *testing.T) {
	args := []string{"--node-name=n1", "--log-level=debug", "--kube-client-qps=8", "--iptables-backend=nft"}
	e := env(map[string]string{"AMBIENT_LOG_LEVEL": "warn", "AMBIENT_PLUGIN_TIMEOUT": "40s"})
	c, err := Parse(args, e, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, a := range c.SettingsAttr(args, e).Value.Group() {
		got[a.Key] = a.Value.String()
	}
	if len(got) != len(options()) {
		t.Errorf("%d settings logged, want %d (one per option)", len(got), len(options()))
	}
	for k, want := range map[string]string{"node-name": "n1", "log-level": "debug", "plugin-timeout": "40s", "kube-client-qps": "8", "annotation-qps": "5", "dns-capture": "true", "kubeconfig": "", "rules-backend": "nft"} {
		if got[k] != want {
			t.Errorf("settings[%s] = %q, want %q", k, got[k], want)
		}
	}
}

// The log format is text by default (as istio-cni's), json on request,
// and nothing else.
func TestLogFormat(t *testing.T) {
	for _, c := range []struct {
		args   []string
		want   string
		prefix string
	}{{nil, "text", "time="}, {[]string{"--log-format=json"}, "json", "{"}} {
		cfg, err := Parse(append([]string{"--node-name=n"}, c.args...), env(nil), io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.LogFormat != c.want {
			t.Errorf("%v: log format %q, want %q", c.args, cfg.LogFormat, c.want)
		}
		var b bytes.Buffer
		slog.New(NewLogHandler(cfg.LogFormat, &b, nil)).Info("hello", "k", "v")
		if !strings.HasPrefix(b.String(), c.prefix) {
			t.Errorf("%s line %q, want it to start with %q", c.want, b.String(), c.prefix)
		}
	}
	if _, err := Parse([]string{"--node-name=n", "--log-format=xml"}, env(nil), io.Discard); err == nil {
		t.Error("--log-format=xml accepted")
	}
}

// The plugin's token lasts a year by default, as istio-cni's plugin token
// (its agent's projected token, which the API server extends to a year):
// plain pods keep starting on the API server's word through a node that
// was off, or an agent that cannot start, for that long less a day (the
// renewal interval). A day (the old default) turned a weekend with the
// node off into plain pods waiting without bound.
func TestPluginTokenLifetime(t *testing.T) {
	c, err := Parse([]string{"--node-name=n1"}, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.PluginTokenLifetime < 365*24*time.Hour {
		t.Errorf("default plugin token lifetime %v, want at least a year", c.PluginTokenLifetime)
	}
	for v, ok := range map[string]bool{"8760h": true, "17520h": true, "10m": true, "9m": false, "17521h": false, "forever": false} {
		c, err := Parse([]string{"--node-name=n1", "--plugin-token-lifetime=" + v}, env(nil), io.Discard)
		if (err == nil) != ok {
			t.Errorf("--plugin-token-lifetime=%s: %v, want accepted %v", v, err, ok)
		} else if ok {
			if d, _ := time.ParseDuration(v); c.PluginTokenLifetime != d {
				t.Errorf("--plugin-token-lifetime=%s: %v", v, c.PluginTokenLifetime)
			}
		}
	}
}
