package plugin

import (
	"encoding/json"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

const prevV1 = `{"cniVersion":"1.0.0","interfaces":[{"name":"cni0","mac":"aa:bb:cc:dd:ee:01"},{"name":"eth0","mac":"aa:bb:cc:dd:ee:02","sandbox":"/var/run/netns/x"}],` +
	`"ips":[{"interface":1,"address":"10.1.0.5/24","gateway":"10.1.0.1"},{"interface":1,"address":"fd00::5/64"},{"interface":0,"address":"10.1.0.1/24"}]}`

func TestParseConfigDefaults(t *testing.T) {
	c, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"k8s","type":"ambient-cni"}`))
	if err != nil {
		t.Fatal(err)
	}
	want := &Config{
		CNIVersion: "1.0.0", Name: "k8s", AgentSocket: "/var/run/ambient-cni/agent.sock", StateDir: "/var/lib/ambient-cni",
		SnapshotFile: "/var/run/ambient-cni/enablement.json", SpoolDir: "/var/run/ambient-cni/pending-del",
		AddSpoolDir: "/var/run/ambient-cni/pending-add", HeartbeatFile: "/var/run/ambient-cni/agent-alive", AgentDownAfter: ambient.DefaultAgentDownAfter,
		Timeout: ambient.DefaultPluginTimeout, LogLevel: slog.LevelWarn, ExcludedNamespaces: []string{"kube-system"},
		AgentUnreachable: ambient.AgentUnreachableSnapshot,
	}
	if diff := cmp.Diff(want, c, cmpopts.IgnoreUnexported(Config{})); diff != "" {
		t.Errorf("defaults wrong (-want +got):\n%s", diff)
	}
}

func TestParseConfigKeys(t *testing.T) {
	in := `{"cniVersion":"0.4.0","name":"k8s","type":"ambient-cni","agentSocket":"/run/a/agent.sock","timeout":"1.5s","logLevel":"debug",` +
		`"excludedNamespaces":[],"statusRequiresAgent":true,"agentUnreachable":"fail-closed","agentDownAfter":"5m","runtimeConfig":{"x":1},"prevResult":` + prevV1 + `}`
	in = strings.Replace(in, `"cniVersion":"1.0.0","interfaces"`, `"cniVersion":"0.4.0","interfaces"`, 1)
	c, err := ParseConfig([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if c.PrevResult == nil {
		t.Fatal("prevResult not parsed")
	}
	want := &Config{
		CNIVersion: "0.4.0", Name: "k8s", AgentSocket: "/run/a/agent.sock", StateDir: "/var/lib/ambient-cni",
		SnapshotFile: "/run/a/enablement.json", SpoolDir: "/run/a/pending-del",
		AddSpoolDir: "/run/a/pending-add", HeartbeatFile: "/run/a/agent-alive", AgentDownAfter: 5 * time.Minute,
		Timeout: 1500 * time.Millisecond, LogLevel: slog.LevelDebug, ExcludedNamespaces: []string{}, StatusRequiresAgent: true,
		AgentUnreachable: ambient.AgentUnreachableFailClosed,
	}
	if diff := cmp.Diff(want, c, cmpopts.IgnoreFields(Config{}, "PrevResult"), cmpopts.IgnoreUnexported(Config{})); diff != "" {
		t.Errorf("keys not honoured (-want +got):\n%s", diff)
	}
	ips, err := c.PrevResult.PodIPs()
	if err != nil || strings.Join(ips, ",") != "10.1.0.5,fd00::5" {
		t.Errorf("podIPs = %v, %v; want the sandbox interface's two addresses only", ips, err)
	}
}

func TestParseConfigRejects(t *testing.T) {
	for name, tc := range map[string]struct {
		in   string
		code uint
	}{
		"not json":                         {`{"cniVersion":`, types.ErrDecodingFailure},
		"array":                            {`[]`, types.ErrDecodingFailure},
		"unknown version":                  {`{"cniVersion":"9.9.9","name":"n"}`, types.ErrIncompatibleCNIVersion},
		"old version":                      {`{"cniVersion":"0.2.0","name":"n"}`, types.ErrIncompatibleCNIVersion},
		"no version":                       {`{"name":"n"}`, types.ErrIncompatibleCNIVersion},
		"relative socket":                  {`{"cniVersion":"1.0.0","agentSocket":"run/a.sock"}`, types.ErrInvalidNetworkConfig},
		"unclean socket":                   {`{"cniVersion":"1.0.0","agentSocket":"/run/../a.sock"}`, types.ErrInvalidNetworkConfig},
		"long socket":                      {`{"cniVersion":"1.0.0","agentSocket":"/` + strings.Repeat("a", 120) + `"}`, types.ErrInvalidNetworkConfig},
		"socket wrong type":                {`{"cniVersion":"1.0.0","agentSocket":7}`, types.ErrDecodingFailure},
		"bad timeout":                      {`{"cniVersion":"1.0.0","timeout":"soon"}`, types.ErrInvalidNetworkConfig},
		"zero timeout":                     {`{"cniVersion":"1.0.0","timeout":"0s"}`, types.ErrInvalidNetworkConfig},
		"negative timeout":                 {`{"cniVersion":"1.0.0","timeout":"-1s"}`, types.ErrInvalidNetworkConfig},
		"huge timeout":                     {`{"cniVersion":"1.0.0","timeout":"1h"}`, types.ErrInvalidNetworkConfig},
		"bad level":                        {`{"cniVersion":"1.0.0","logLevel":"loud"}`, types.ErrInvalidNetworkConfig},
		"bad namespace":                    {`{"cniVersion":"1.0.0","excludedNamespaces":["Kube_System"]}`, types.ErrInvalidNetworkConfig},
		"empty namespace":                  {`{"cniVersion":"1.0.0","excludedNamespaces":[""]}`, types.ErrInvalidNetworkConfig},
		"ns not a list":                    {`{"cniVersion":"1.0.0","excludedNamespaces":"kube-system"}`, types.ErrDecodingFailure},
		"prevResult of an unknown version": {`{"cniVersion":"1.0.0","prevResult":{"cniVersion":"9.9.9","ips":[]}}`, types.ErrIncompatibleCNIVersion},
		"prevResult version not a string":  {`{"cniVersion":"1.0.0","prevResult":{"cniVersion":1,"ips":[]}}`, types.ErrDecodingFailure},
		"bad prevResult":                   {`{"cniVersion":"1.0.0","prevResult":{"ips":[{"address":"nope"}]}}`, types.ErrDecodingFailure},
		"bad agentUnreachable":             {`{"cniVersion":"1.0.0","agentUnreachable":"pass"}`, types.ErrInvalidNetworkConfig},
		"agentUnreachable not a string":    {`{"cniVersion":"1.0.0","agentUnreachable":true}`, types.ErrDecodingFailure},
		"oversized":                        {`{"cniVersion":"1.0.0","pad":"` + strings.Repeat("x", maxConfigBytes) + `"}`, types.ErrInvalidNetworkConfig},
	} {
		_, err := ParseConfig([]byte(tc.in))
		var te *types.Error
		if !errors.As(err, &te) {
			t.Errorf("%s: got %v, want a *types.Error", name, err)
			continue
		}
		if te.Code != tc.code {
			t.Errorf("%s: code %d (%s), want %d", name, te.Code, te.Msg, tc.code)
		}
	}
}

func TestParseK8sArgs(t *testing.T) {
	a, err := ParseK8sArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1;OTHER=x")
	if err != nil {
		t.Fatal(err)
	}
	want := &K8sArgs{CommonArgs: a.CommonArgs, K8S_POD_NAMESPACE: "shop", K8S_POD_NAME: "web-1", K8S_POD_INFRA_CONTAINER_ID: "abc", K8S_POD_UID: "u-1"}
	if diff := cmp.Diff(want, a); diff != "" {
		t.Errorf("args (-want +got):\n%s", diff)
	}
	if err := a.requirePod(); err != nil {
		t.Errorf("requirePod: %v", err)
	}
	// Unknown keys are tolerated even without IgnoreUnknown.
	if _, err := ParseK8sArgs("K8S_POD_NAME=a;FOO=bar"); err != nil {
		t.Errorf("unknown key rejected: %v", err)
	}
	for _, bad := range []string{"K8S_POD_NAME", "K8S_POD_NAME=a=b", ";;", "IgnoreUnknown=maybe"} {
		if _, err := ParseK8sArgs(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	empty, err := ParseK8sArgs("")
	if err != nil {
		t.Fatal(err)
	}
	if err := empty.requirePod(); err == nil || !strings.Contains(err.Error(), "K8S_POD_NAME") {
		t.Errorf("missing args not reported clearly: %v", err)
	}
}

func FuzzParseConfig(f *testing.F) {
	fuzzseed.Add(f, "FuzzParseConfig")
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","prevResult":` + prevV1 + `}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseConfig(b)
		if err != nil {
			var te *types.Error
			if !errors.As(err, &te) {
				t.Fatalf("error is not a CNI error: %v", err)
			}
			return
		}
		if c.Timeout <= 0 || c.Timeout > ambient.MaxPluginTimeout || !filepath.IsAbs(c.AgentSocket) {
			t.Fatalf("accepted invalid config: %+v", c)
		}
		if c.PrevResult != nil {
			// What is printed names the config's version.
			var out struct {
				CNIVersion string `json:"cniVersion"`
			}
			if err := json.Unmarshal(c.PrevResult.out, &out); err != nil || out.CNIVersion != c.CNIVersion {
				t.Fatalf("prevResult printed as %s (%v), not in %s", c.PrevResult.out, err, c.CNIVersion)
			}
			_, _ = c.PrevResult.PodIPs()
		}
	})
}
