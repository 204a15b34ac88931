package plugin

import (
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// TestEntryRoundTrip proves the entry the installer writes from
// ambient.PluginConf is read back by the plugin with every value intact.
func TestEntryRoundTrip(t *testing.T) {
	e := ambient.PluginConf{AgentSocket: "/run/x/agent.sock", StateDir: "/var/lib/x", Timeout: "12s", LogLevel: "debug",
		ExcludedNamespaces: []string{"infra", "kube-system"}, StatusRequiresAgent: true,
		AgentUnreachable: ambient.AgentUnreachableFailClosed, AgentDownAfter: "90s"}
	b, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	m["cniVersion"], m["name"], m["type"] = "1.0.0", "k8s-pod-network", "ambient-cni"
	stdin, _ := json.Marshal(m)
	c, err := ParseConfig(stdin)
	if err != nil {
		t.Fatalf("ParseConfig(entry): %v", err)
	}
	want := &Config{
		CNIVersion: "1.0.0", Name: "k8s-pod-network", AgentSocket: e.AgentSocket, StateDir: e.StateDir,
		SnapshotFile: "/run/x/enablement.json", SpoolDir: "/run/x/pending-del",
		AddSpoolDir: "/run/x/pending-add", HeartbeatFile: "/run/x/agent-alive", AgentDownAfter: 90 * time.Second,
		Timeout: 12 * time.Second, LogLevel: slog.LevelDebug, ExcludedNamespaces: e.ExcludedNamespaces, StatusRequiresAgent: true,
		AgentUnreachable: ambient.AgentUnreachableFailClosed,
	}
	if diff := cmp.Diff(want, c, cmpopts.IgnoreUnexported(Config{})); diff != "" {
		t.Fatalf("entry %s parsed wrong (-want +got):\n%s", b, diff)
	}
}
