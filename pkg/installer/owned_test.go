package installer

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
)

// owned is the owned conflist's name in these tests.
const owned = DefaultOwnedConfName

func ownedOn(c *Config) { c.Owned = true }

// runtimeChoice is the config the runtime loads (containerd, CRI-O,
// kubelet's old dockershim alike): the lexically first file that loads.
// It returns the file's name and whether its list runs our plugin.
func (e *env) runtimeChoice(t testing.TB) (string, bool) {
	t.Helper()
	files, err := libcni.ConfFiles(e.conf, []string{".conf", ".conflist", ".json"})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files { // sorted, as the runtime sorts
		if !strings.HasSuffix(f, ConflistExt) {
			if _, err := libcni.NetworkPluginConfFromBytes(mustRead(t, f)); err == nil {
				return filepath.Base(f), false
			}
			continue
		}
		list, err := libcni.ConfListFromFile(f)
		if err != nil || len(list.Plugins) == 0 {
			continue
		}
		ours := false
		for _, p := range list.Plugins {
			ours = ours || p.Network.Type == testType
		}
		return filepath.Base(f), ours
	}
	return "", false
}

func mustRead(t testing.TB, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ownedOK reports whether the owned conflist holds exactly primary's list
// with our entry last, and is what the runtime loads.
func (e *env) ownedOK(t testing.TB, primary string) func() error {
	want := mustChain(t, primary, "x.conflist")
	return func() error {
		b, err := os.ReadFile(e.path(owned))
		if err != nil {
			return err
		}
		if string(b) != want {
			return errors.New("owned config not in step with the primary's yet")
		}
		return nil
	}
}

func TestOwnedLeavesThePrimaryAlone(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o640)
	i := e.installer(t, ownedOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Errorf("the primary's file was edited:\n%s", got)
	}
	if err := e.ownedOK(t, bridgeList)(); err != nil {
		t.Fatal(err)
	}
	// Ours, so closed to group and others whatever the primary's mode:
	// the runtime reads it as root.
	if fi, _ := os.Stat(e.path(owned)); fi.Mode().Perm() != ownedConfMode {
		t.Errorf("owned config mode %04o, want %04o", fi.Mode().Perm(), ownedConfMode)
	}
	if name, ours := e.runtimeChoice(t); name != owned || !ours {
		t.Errorf("the runtime loads %s (ours: %v), want %s with our plugin", name, ours, owned)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check: %v", err)
	}
	// Nothing to do on a second pass.
	writes := i.Stats().ConfigWrites
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := i.Stats().ConfigWrites; got != writes {
		t.Errorf("a pass with nothing changed wrote the config (%d writes, was %d)", got, writes)
	}
}

// An owned conflist an older version left group- and world-readable (it
// copied the primary's mode) is closed on the next pass, even with its
// content already right.
func TestOwnedModeTightened(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	e.write(t, owned, mustChain(t, bridgeList, "x.conflist"), 0o644)
	i := e.installer(t, ownedOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.ownedOK(t, bridgeList)(); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(e.path(owned)); fi.Mode().Perm() != ownedConfMode {
		t.Errorf("owned config mode %04o after a pass, want %04o", fi.Mode().Perm(), ownedConfMode)
	}
}

// The reboot race: while no agent of ours runs, the primary's agent
// writes its config again without our entry (as at every start). The
// runtime still loads the owned conflist, with our plugin; once our agent
// is back the copy takes the primary's new content.
func TestOwnedSurvivesAPrimaryRewriteWhileWeAreDown(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	before := e.installer(t, ownedOn)
	if err := before.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The agent is gone (a reboot): no Shutdown runs.
	rewritten := strings.Replace(bridgeList, `"isGateway": true`, `"isGateway": true, "x-boot": 2`, 1)
	e.write(t, "10-bridge.conflist", rewritten, 0o644)
	if name, ours := e.runtimeChoice(t); name != owned || !ours {
		t.Fatalf("after the primary's rewrite the runtime loads %s (ours: %v), want %s with our plugin", name, ours, owned)
	}
	after := e.installer(t, ownedOn)
	if err := after.Check(); err == nil {
		t.Error("Check passed with the owned config behind the primary's")
	}
	run(t, after)
	waitFor(t, "the owned config in step with the rewritten primary", e.ownedOK(t, rewritten))
	waitFor(t, "ready", after.Check)
	if got := e.read(t, "10-bridge.conflist"); got != rewritten {
		t.Errorf("the primary's file was edited:\n%s", got)
	}
}

func TestOwnedFollowsThePrimary(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, func(c *Config) { c.Owned, c.OwnedGrace = true, 100*time.Millisecond })
	run(t, i)
	waitFor(t, "initial install", i.Check)

	t.Run("the primary changes its config", func(t *testing.T) {
		changed := bridgeList[:len(bridgeList)-2] + ",\n  \"x-new\": 1\n}\n"
		e.write(t, "10-bridge.conflist", changed, 0o644)
		waitFor(t, "copy of the new content", e.ownedOK(t, changed))
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		waitFor(t, "copy of the old content", e.ownedOK(t, bridgeList))
	})
	t.Run("the owned config is removed", func(t *testing.T) {
		if err := os.Remove(e.path(owned)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "owned config back", e.ownedOK(t, bridgeList))
	})
	t.Run("the owned config is edited", func(t *testing.T) {
		e.write(t, owned, mustChain(t, strings.Replace(bridgeList, "cni0", "cni9", 1), "x.conflist"), 0o644)
		waitFor(t, "owned config repaired", e.ownedOK(t, bridgeList))
	})
	t.Run("the primary's config goes and comes back", func(t *testing.T) {
		if err := os.Remove(e.path("10-bridge.conflist")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "owned config removed past the grace", func() error {
			if _, err := os.Stat(e.path(owned)); !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("owned config still there (%v)", err)
			}
			return nil
		})
		if i.Ready() {
			t.Error("ready with no primary config")
		}
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		waitFor(t, "owned config back", e.ownedOK(t, bridgeList))
		waitFor(t, "ready", i.Check)
	})
	t.Run("a config that sorts first appears", func(t *testing.T) {
		// A new primary named before ours: the runtime loads it, so the
		// owned config would be dead weight; we chain into it instead.
		e.write(t, "01-new.conflist", bridgeList, 0o644)
		waitFor(t, "chained into the new primary", e.chainedOK(t, "01-new.conflist", bridgeList))
		waitFor(t, "owned config removed", func() error {
			if _, err := os.Stat(e.path(owned)); !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("owned config still there (%v)", err)
			}
			return nil
		})
		waitFor(t, "ready", i.Check)
	})
}

// A primary that deletes its config while its agent restarts and writes
// it again: the owned config stays meanwhile, so the runtime never loads
// a list without our entry (nor none at all).
func TestOwnedOutlivesAPrimaryRestart(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, func(c *Config) { c.Owned, c.OwnedGrace = true, time.Hour })
	run(t, i)
	waitFor(t, "initial install", i.Check)
	if err := os.Remove(e.path("10-bridge.conflist")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pass that saw the primary gone", func() error {
		if e.logs.count("the primary CNI config is gone") == 0 {
			return errors.New("not seen yet")
		}
		return nil
	})
	if name, ours := e.runtimeChoice(t); name != owned || !ours {
		t.Fatalf("while the primary restarts the runtime loads %q (ours: %v)", name, ours)
	}
	rewritten := strings.Replace(bridgeList, "cni0", "cni1", 1)
	e.write(t, "10-bridge.conflist", rewritten, 0o644)
	waitFor(t, "the copy of the new config", e.ownedOK(t, rewritten))
	waitFor(t, "ready", i.Check)
}

func TestOwnedFallsBackToChaining(t *testing.T) {
	for _, c := range []struct {
		name, primary string
		mod           func(*Config)
	}{
		{"primary sorts first", "01-kube-ovn.conflist", ownedOn},
		{"configured owned name sorts after", "10-bridge.conflist", func(c *Config) { c.Owned, c.OwnedConfName = true, "99-ambient-cni.conflist" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			conf := bridgeList
			if filepath.Ext(c.primary) != ConflistExt {
				conf = bridgeConf
			}
			e.write(t, c.primary, conf, 0o644)
			i := e.installer(t, c.mod)
			if err := i.Install(context.Background()); err != nil {
				t.Fatal(err)
			}
			name, ours := e.runtimeChoice(t)
			if !ours {
				t.Errorf("the runtime loads %s without our plugin", name)
			}
			if err := i.Check(); err != nil {
				t.Errorf("Check: %v", err)
			}
			if e.logs.count("not writing an owned CNI config") != 1 {
				t.Error("the fallback was not logged once")
			}
			ents, _ := os.ReadDir(e.conf)
			if len(ents) != 1 {
				t.Errorf("conf dir holds %d files, want the chained primary only", len(ents))
			}
		})
	}
}

// bridgeConf is a single-plugin primary config.
const bridgeConf = `{
  "cniVersion": "1.0.0",
  "name": "single",
  "type": "bridge",
  "bridge": "cni0"
}
`

func TestOwnedFromASingleConfig(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-single.conf", bridgeConf, 0o644)
	i := e.installer(t, ownedOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-single.conf"); got != bridgeConf {
		t.Errorf("the primary's .conf was edited:\n%s", got)
	}
	if _, err := os.Stat(e.path("10-single.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("the primary was converted in place")
	}
	if err := e.ownedOK(t, mustConvert(t, bridgeConf))(); err != nil {
		t.Error(err)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check: %v", err)
	}
}

func mustConvert(t testing.TB, conf string) string {
	t.Helper()
	b, err := convertConf([]byte(conf), testType)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestOwnedConfiguredPrimaryNotTheRuntimesChoice(t *testing.T) {
	// Multus-like: the runtime loads 00-multus.conf, the configured
	// primary is its delegate. A file of ours before both would take the
	// node off Multus: chain into the configured file instead.
	e := newEnv(t)
	e.write(t, "00-multus.conf", `{"cniVersion":"1.0.0","name":"multus","type":"multus"}`, 0o644)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, func(c *Config) {
		c.Owned, c.OwnedConfName, c.PrimaryConfName = true, "000-ambient-cni.conflist", "10-bridge.conflist"
	})
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.path("000-ambient-cni.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("an owned config was written ahead of Multus's")
	}
	if err := e.chainedOK(t, "10-bridge.conflist", bridgeList)(); err != nil {
		t.Error(err)
	}
}

func TestOwnedRefusesAForeignFileOfItsName(t *testing.T) {
	e := newEnv(t)
	foreign := strings.Replace(bridgeList, "containerd-net", "someone-else", 1)
	e.write(t, "01-other.conflist", foreign, 0o644)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	// Named like theirs: sorts equal to it, so we chain instead and
	// leave their file as it is.
	i := e.installer(t, func(c *Config) { c.Owned, c.OwnedConfName = true, "01-other.conflist" })
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.chainedOK(t, "01-other.conflist", foreign)(); err != nil {
		t.Error(err)
	}
	// A foreign non-config file of our name is refused, not overwritten.
	e2 := newEnv(t)
	e2.write(t, "10-bridge.conflist", bridgeList, 0o644)
	e2.write(t, owned, `{"cniVersion":"1.0.0","name":"other","plugins":[]}`, 0o644)
	old := time.Now().Add(-time.Hour) // not a file being written
	if err := os.Chtimes(e2.path(owned), old, old); err != nil {
		t.Fatal(err)
	}
	i2 := e2.installer(t, ownedOn)
	if err := i2.Install(context.Background()); err == nil || !strings.Contains(err.Error(), "not ours") {
		t.Errorf("Install over a foreign %s: %v, want a refusal", owned, err)
	}
}

// A single-plugin primary whose list would take the owned name is not
// converted over it.
func TestConversionRefusesTheOwnedName(t *testing.T) {
	e := newEnv(t)
	e.write(t, "02-ambient-cni.conf", bridgeConf, 0o644)
	i := e.installer(t, func(c *Config) { c.OwnedConfName = owned })
	if err := i.Install(context.Background()); err == nil || !strings.Contains(err.Error(), "owned config's name") {
		t.Errorf("Install: %v, want a refusal", err)
	}
	if got := e.read(t, "02-ambient-cni.conf"); got != bridgeConf {
		t.Errorf("primary changed:\n%s", got)
	}
}

func TestOwnedShutdown(t *testing.T) {
	t.Run("uninstall removes it", func(t *testing.T) {
		e := newEnv(t)
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		i := e.installer(t, ownedOn)
		if err := i.Install(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := i.Shutdown(context.Background(), false); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(e.path(owned)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("owned config still there (%v)", err)
		}
		if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
			t.Errorf("primary changed:\n%s", got)
		}
		if _, err := os.Stat(filepath.Join(e.bin, testType)); !errors.Is(err, fs.ErrNotExist) {
			t.Error("binary still there")
		}
	})
	t.Run("upgrade keeps it", func(t *testing.T) {
		e := newEnv(t)
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		i := e.installer(t, ownedOn)
		if err := i.Install(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := i.Shutdown(context.Background(), true); err != nil {
			t.Fatal(err)
		}
		if err := e.ownedOK(t, bridgeList)(); err != nil {
			t.Error(err)
		}
	})
}

// Switching modes either way leaves one place for our entry, and an
// uninstall after either gives back the primary's exact bytes.
func TestOwnedModeSwitch(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	chain := func(c *Config) { c.OwnedConfName = owned }
	if err := e.installer(t, chain).Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Chained before, owned now: the copy leaves our entry out of the
	// primary's list it copies, and the primary's file keeps the entry
	// it had (harmless: the runtime loads ours).
	i := e.installer(t, ownedOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.ownedOK(t, bridgeList)(); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check: %v", err)
	}
	// Owned before, chained now: the owned config goes.
	i = e.installer(t, chain)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.path(owned)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("owned config still there after switching to chaining (%v)", err)
	}
	if name, ours := e.runtimeChoice(t); name != "10-bridge.conflist" || !ours {
		t.Errorf("the runtime loads %s (ours: %v)", name, ours)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check: %v", err)
	}
	// And back to owned, then uninstall: nothing of ours is left.
	i = e.installer(t, ownedOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(e.conf)
	if len(ents) != 1 || e.read(t, "10-bridge.conflist") != bridgeList {
		t.Errorf("after uninstall: %d files, primary:\n%s", len(ents), e.read(t, "10-bridge.conflist"))
	}
}

func TestOwnedNameChecked(t *testing.T) {
	e := newEnv(t)
	for name, mod := range map[string]func(*Config){
		"not a conflist": func(c *Config) { c.Owned, c.OwnedConfName = true, "02-x.conf" },
		"with a slash":   func(c *Config) { c.Owned, c.OwnedConfName = true, "a/02-x.conflist" },
		"the primary's":  func(c *Config) { c.Owned, c.OwnedConfName, c.PrimaryConfName = true, "02-x.conflist", "02-x.conflist" },
	} {
		cfg := Config{BinDir: e.bin, ConfDir: e.conf, PluginBinary: e.src}
		mod(&cfg)
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New accepted it", name)
		}
	}
	i := e.installer(t, ownedOn)
	if i.cfg.OwnedConfName != DefaultOwnedConfName {
		t.Errorf("default owned name %q", i.cfg.OwnedConfName)
	}
}
