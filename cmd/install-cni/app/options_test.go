package app

import (
	"bytes"
	"io"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
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
		IPTablesBackend    string
	}
	got := defaults{c.ZDSSocket, c.ZtunnelWait, c.ProbeSNATv4, c.ExcludedNamespaces, c.PluginType, c.DNSCapture, c.IPTablesBackend}
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

func TestRejectsBadInput(t *testing.T) {
	cases := map[string]struct {
		args []string
		env  map[string]string
		want string
	}{
		"no node":            {nil, nil, "node name is required"},
		"bad duration env":   {nil, map[string]string{"AMBIENT_NODE_NAME": "n", "AMBIENT_ZTUNNEL_WAIT": "soon"}, "AMBIENT_ZTUNNEL_WAIT"},
		"negative duration":  {[]string{"--node-name=n", "--ztunnel-wait=-1s"}, nil, "positive"},
		"timeout below wait": {[]string{"--node-name=n", "--plugin-timeout=2s", "--ztunnel-wait=3s"}, nil, "must exceed"},
		"v6 as v4":           {[]string{"--node-name=n", "--probe-snat-ipv4=fd00::1"}, nil, "IPv4"},
		"bad bool":           {[]string{"--node-name=n", "--dns-capture=yes please"}, nil, "true or false"},
		"bad backend":        {[]string{"--node-name=n", "--iptables-backend=ebtables"}, nil, "nftables, iptables, nft or legacy"},
		"relative socket":    {[]string{"--node-name=n", "--agent-socket=agent.sock"}, nil, "absolute"},
		"relative netns dir": {[]string{"--node-name=n", "--netns-dirs=/run/netns,netns"}, nil, "not absolute"},
		"unknown flag":       {[]string{"--node-name=n", "--frobnicate"}, nil, "frobnicate"},
		"stray argument":     {[]string{"--node-name=n", "extra"}, nil, "unexpected"},
		"bad log level":      {[]string{"--node-name=n", "--log-level=loud"}, nil, "debug, info"},
	}
	for name, c := range cases {
		_, err := Parse(c.args, env(c.env), io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want it to mention %q", name, err, c.want)
		}
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
