package cni

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
)

// TestSiblingThroughTheRuntime: the real installer with our entry in the
// primary network's folder (cni.chainInNetworkFolder). The network the
// runtime loads (libcni 1.3, as containerd 2.1 and later load it) runs the
// primary's plugins, then ours, without a byte of the primary's file
// changed, also after the primary writes its file again; an ambient pod is
// captured at its ADD with the primary's result. After an uninstall the
// runtime's network is the primary's alone: a new ambient pod starts,
// uncaptured.
func TestSiblingThroughTheRuntime(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	ctx := context.Background()
	binDir, confDir := n.runtimeDirs(t)
	// The primary: the node's list without our entry.
	primary, err := installer.Unchain(n.list.Bytes, cnibin.PluginName)
	if err != nil {
		t.Fatal(err)
	}
	primaryPath := filepath.Join(confDir, "10-primary.conflist")
	if err := os.WriteFile(primaryPath, primary, 0o644); err != nil {
		t.Fatal(err)
	}
	primaryTypes := fmt.Sprint(typesOf(t, primaryPath))

	entry := fmt.Appendf(nil, `{"agentSocket":%q,"timeout":"20s","logLevel":"debug"}`, n.layout.AgentSocket())
	inst, err := installer.New(installer.Config{
		BinDir: binDir, ConfDir: confDir, PluginBinary: cnibin.Plugin(t), PluginName: cnibin.PluginName,
		PluginConfig: entry, Sibling: true, StateFile: filepath.Join(n.dir, "installer-state.json"), Logger: n.agentLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.Install(ctx); err != nil {
		t.Fatal(err)
	}
	if err := inst.Check(); err != nil {
		t.Fatalf("installer not ready: %v", err)
	}
	if got, _ := os.ReadFile(primaryPath); string(got) != string(primary) {
		t.Fatalf("the primary's file changed:\n%s", got)
	}
	list, file, err := runtimeNetwork(confDir)
	if err != nil || file != primaryPath {
		t.Fatalf("the runtime loads %s (%v), want the primary's file", file, err)
	}
	if got, want := fmt.Sprint(typesOfList(list)), primaryTypes[:len(primaryTypes)-1]+" "+cnibin.PluginName+"]"; got != want {
		t.Fatalf("the runtime's chain is %s, want %s", got, want)
	}

	add := n.runtimeAdd(t, binDir)
	web := n.newPod("shop", "web", nil)
	if err := add(web, list); err != nil {
		t.Fatalf("ADD through the primary's network with our entry in its folder: %v", err)
	}
	if p := n.agent.Pods(); len(p) != 1 || p[0].Name != "web" || p[0].SandboxID != web.id {
		t.Fatalf("agent state after the ADD: %+v", p)
	}
	if !n.ourChains(t, web) {
		t.Error("the ambient pod has no capture rules")
	}

	// The primary's agent writes its file again (as at every start): the
	// runtime still runs ours, and nothing needed a repair.
	if err := os.WriteFile(primaryPath, append(primary, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	if list, _, err := runtimeNetwork(confDir); err != nil || typesOfList(list)[len(list.Plugins)-1] != cnibin.PluginName {
		t.Fatalf("after the primary's rewrite: %v, %v", err, list)
	}

	if err := inst.Shutdown(ctx, false); err != nil {
		t.Fatal(err)
	}
	list, _, err = runtimeNetwork(confDir)
	if err != nil || fmt.Sprint(typesOfList(list)) != primaryTypes {
		t.Fatalf("the runtime's network after the uninstall: %v, %v, want %s", err, typesOfList(list), primaryTypes)
	}
	n.startsUncapturedAfterUninstall(t, add, list)
}

func typesOf(t *testing.T, path string) []string {
	t.Helper()
	l, err := libcni.ConfListFromFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return typesOfList(l)
}

func typesOfList(l *libcni.NetworkConfigList) []string {
	if l == nil {
		return nil
	}
	var types []string
	for _, p := range l.Plugins {
		types = append(types, p.Network.Type)
	}
	return types
}
