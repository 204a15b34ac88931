package cni

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
)

// runtimeNetwork loads the conf dir as containerd's CRI plugin does (its
// go-cni, with the default of one network): the lexically first of the
// .conf, .conflist and .json files, a list read as a list and a single
// config wrapped into one.
func runtimeNetwork(dir string) (*libcni.NetworkConfigList, string, error) {
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return nil, "", err
	}
	if len(files) == 0 {
		return nil, "", errors.New("no network config")
	}
	sort.Strings(files)
	first := files[0]
	if strings.HasSuffix(first, ".conflist") {
		l, err := libcni.ConfListFromFile(first)
		return l, first, err
	}
	//lint:ignore SA1019 containerd's go-cni loads a .conf with exactly this
	c, err := libcni.ConfFromFile(first)
	if err != nil {
		return nil, first, err
	}
	//lint:ignore SA1019 and wraps it into a list with exactly this
	l, err := libcni.ConfListFromConf(c)
	return l, first, err
}

// runtimeDirs makes a CNI bin dir and conf dir in the node's folder as a
// node has them before an install: the reference plugins in the bin dir,
// not ours (the installer copies it), and no config.
func (n *node) runtimeDirs(t *testing.T) (binDir, confDir string) {
	t.Helper()
	binDir, confDir = filepath.Join(n.dir, "bin"), filepath.Join(n.dir, "net.d")
	for _, d := range []string{binDir, confDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cnibin.InstallInto(t, binDir)
	if err := os.Remove(filepath.Join(binDir, cnibin.PluginName)); err != nil {
		t.Fatal(err)
	}
	return binDir, confDir
}

// runtimeAdd returns an ADD of a sandbox through a network the runtime
// loaded, with the plugins of binDir; the sandbox's DEL runs at cleanup.
func (n *node) runtimeAdd(t *testing.T, binDir string) func(*sandbox, *libcni.NetworkConfigList) error {
	cniCfg := libcni.NewCNIConfigWithCacheDir([]string{binDir}, t.TempDir(), n.rec)
	return func(s *sandbox, l *libcni.NetworkConfigList) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, err := cniCfg.AddNetworkList(ctx, l, s.rt())
		t.Cleanup(func() { _ = cniCfg.DelNetworkList(context.Background(), l, s.rt()) })
		return err
	}
}

// startsUncapturedAfterUninstall adds a new ambient pod through list, the
// runtime's network after an uninstall: it starts, and the agent (still
// holding the one pod captured before) does not capture it.
func (n *node) startsUncapturedAfterUninstall(t *testing.T, add func(*sandbox, *libcni.NetworkConfigList) error, list *libcni.NetworkConfigList) {
	t.Helper()
	later := n.newPod("shop", "later", nil)
	if err := add(later, list); err != nil {
		t.Fatalf("ADD after the uninstall: %v", err)
	}
	if p := n.agent.Pods(); len(p) != 1 {
		t.Errorf("a pod started after the uninstall was captured: %+v", p)
	}
	if n.ourChains(t, later) {
		t.Error("a pod started after the uninstall has capture rules")
	}
}

// TestConfPrimaryThroughTheRuntime: a node whose primary is a
// single-plugin .conf (bridge with host-local). The real installer
// converts it; the network the runtime then loads runs the bridge first
// and our plugin after it, so an ambient pod is captured at its ADD with
// the bridge's result. An uninstall restores the .conf byte for byte, and
// the runtime's network is the bridge alone again: a new ambient pod
// starts, uncaptured.
func TestConfPrimaryThroughTheRuntime(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	ctx := context.Background()
	binDir, confDir := n.runtimeDirs(t)
	// The single-plugin config: the bridge entry of the node's list, with
	// the list's name and version.
	bridge := n.list.Plugins[0].Bytes
	var obj map[string]any
	if err := json.Unmarshal(bridge, &obj); err != nil {
		t.Fatal(err)
	}
	obj["cniVersion"], obj["name"] = n.version, "k8s-pod-network"
	conf, err := json.MarshalIndent(obj, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	conf = append(conf, '\n')
	confPath := filepath.Join(confDir, "10-bridge.conf")
	if err := os.WriteFile(confPath, conf, 0o644); err != nil {
		t.Fatal(err)
	}

	entry, err := json.Marshal(map[string]any{"agentSocket": n.layout.AgentSocket(), "timeout": "20s", "logLevel": "debug"})
	if err != nil {
		t.Fatal(err)
	}
	inst, err := installer.New(installer.Config{
		BinDir: binDir, ConfDir: confDir, PluginBinary: cnibin.Plugin(t), PluginName: cnibin.PluginName,
		PluginConfig: entry, StateFile: filepath.Join(n.dir, "installer-state.json"), Logger: n.agentLog(),
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
	list, file, err := runtimeNetwork(confDir)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(file) != "10-bridge.conflist" {
		t.Fatalf("the runtime loads %s, want the converted 10-bridge.conflist", file)
	}
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	if fmt.Sprint(types) != fmt.Sprint([]string{"bridge", cnibin.PluginName}) {
		t.Fatalf("the runtime's chain is %v, want the bridge, then ours", types)
	}

	add := n.runtimeAdd(t, binDir)
	web := n.newPod("shop", "web", nil)
	if err := add(web, list); err != nil {
		t.Fatalf("ADD through the converted config: %v", err)
	}
	ours, br := n.rec.last(cnibin.PluginName), n.rec.last("bridge")
	if len(ours) == 0 || len(br) == 0 || !sameJSON(t, ours, br) {
		t.Errorf("our plugin did not run after the bridge with its result:\nours:   %s\nbridge: %s", ours, br)
	}
	if p := n.agent.Pods(); len(p) != 1 || p[0].Name != "web" || p[0].SandboxID != web.id {
		t.Fatalf("agent state after the ADD: %+v", p)
	}
	if !n.ourChains(t, web) {
		t.Error("the ambient pod has no capture rules")
	}

	if err := inst.Shutdown(ctx, false); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(confPath); err != nil || string(got) != string(conf) {
		t.Fatalf("the .conf after the uninstall (%v):\n%s\nwant:\n%s", err, got, conf)
	}
	if _, err := os.Stat(filepath.Join(confDir, "10-bridge.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the converted list is still there: %v", err)
	}
	list, file, err = runtimeNetwork(confDir)
	if err != nil || file != confPath || len(list.Plugins) != 1 || list.Plugins[0].Network.Type != "bridge" {
		t.Fatalf("the runtime's network after the uninstall: %s %v", file, err)
	}
	n.startsUncapturedAfterUninstall(t, add, list)
}
