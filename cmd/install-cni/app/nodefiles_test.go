package app

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestUninstallRemovesEveryNodeFile: the uninstall's "node files removed"
// step takes away every file the agent and the plugin keep on the node,
// in the run directory and in the state directory: the plugin's
// credential (an API token) and the fallback binary too, which have no
// reader once the plugin is unchained. What later steps own stays for
// them: the marker (removed last), the node directories' ledger.
func TestUninstallRemovesEveryNodeFile(t *testing.T) {
	a := testApp(t)
	l := a.layout
	for _, d := range []string{l.Dir(), l.StateDir(), l.Records(), l.DelSpool(), l.AddSpool()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	gone := []string{filepath.Join(l.Records(), "x.json"), l.Snapshot(), l.StateSnapshot(), filepath.Join(l.DelSpool(), "x.json"),
		filepath.Join(l.AddSpool(), "x.json"), l.Heartbeat(), l.PluginCredential(), l.FallbackBinary()}
	kept := []string{l.Uninstalling(), l.NodeDirsLedger()}
	for _, p := range slices.Concat(gone, kept) {
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	steps := a.uninstallSteps(t.Context(), newComponents(t.Context(), a.zds, a.log))
	i := slices.IndexFunc(steps, func(s step) bool { return s.name == "node files removed" })
	if i < 0 {
		t.Fatal("no uninstall step removes the node files")
	}
	if err := steps[i].do(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, p := range gone {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s left by the uninstall: %v", p, err)
		}
	}
	for _, p := range []string{l.Records(), l.DelSpool(), l.AddSpool()} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("directory %s left by the uninstall: %v", p, err)
		}
	}
	for _, p := range kept {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s is a later step's, removed with the node files: %v", p, err)
		}
	}
}
