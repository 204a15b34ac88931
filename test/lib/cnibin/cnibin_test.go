package cnibin

import (
	"encoding/json"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
)

func TestPluginsAnswerVersion(t *testing.T) {
	paths := Paths(t)
	for _, name := range append(slices.Clone(ReferencePlugins), PluginName) {
		var bin string
		for _, d := range paths {
			if _, err := os.Stat(filepath.Join(d, name)); err == nil {
				bin = filepath.Join(d, name)
			}
		}
		if bin == "" {
			t.Fatalf("%s not built into %v", name, paths)
		}
		cmd := exec.Command(bin)
		cmd.Env = []string{"CNI_COMMAND=VERSION"}
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s VERSION: %v", name, err)
		}
		var v struct {
			Supported []string `json:"supportedVersions"`
		}
		if err := json.Unmarshal(out, &v); err != nil || !slices.Contains(v.Supported, "1.0.0") {
			t.Errorf("%s VERSION = %s (%v)", name, out, err)
		}
	}
	if Plugin(t) != filepath.Join(paths[1], PluginName) {
		t.Errorf("Plugin() = %s", Plugin(t))
	}
}

func TestConflist(t *testing.T) {
	b := Conflist(Network{Bridge: "cni0", Subnet: netip.MustParsePrefix("10.88.0.0/16"), Subnet6: netip.MustParsePrefix("fd00:88::/64"),
		DataDir: "/tmp/x", Plugin: map[string]any{"agentSocket": "/run/a.sock"}})
	var c struct {
		CNIVersion string           `json:"cniVersion"`
		Plugins    []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	if c.CNIVersion != "1.0.0" || len(c.Plugins) != 2 || c.Plugins[0]["type"] != "bridge" || c.Plugins[1]["type"] != PluginName ||
		c.Plugins[1]["agentSocket"] != "/run/a.sock" {
		t.Errorf("conflist %s", b)
	}
}
