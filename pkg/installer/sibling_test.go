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

	"github.com/containernetworking/cni/libcni"
	"github.com/fsnotify/fsnotify"
)

func siblingOn(c *Config) { c.Sibling = true }

// siblingFile is our file's path in the bridge list's network folder.
func (e *env) siblingFile() string {
	return filepath.Join(e.conf, "containerd-net", siblingPrefix+testType+".conf")
}

// chainOf is the chain the runtime runs (libcni 1.3 loads the folder, as
// containerd 2.1 and later do): the types of the list's plugins, in order.
func (e *env) chainOf(t testing.TB, name string) []string {
	t.Helper()
	l, err := libcni.ConfListFromFile(e.path(name))
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, pl := range l.Plugins {
		types = append(types, pl.Network.Type)
	}
	return types
}

// In the folder, the primary's file untouched: the runtime's chain ends
// with our plugin, the primary's rewrites do not drop it, the file's
// removal is repaired, and an uninstall leaves the conf dir as it was.
func TestSiblingChainsWithoutTouchingThePrimary(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, siblingOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Fatalf("the primary's file changed:\n%s", got)
	}
	if got, want := strings.Join(e.chainOf(t, "10-bridge.conflist"), ","), "bridge,portmap,"+testType; got != want {
		t.Fatalf("the runtime's chain is %s, want %s", got, want)
	}
	if fi, err := os.Stat(e.siblingFile()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("our file: %v, %v (want mode 0600)", fi, err)
	}
	if err := i.Check(); err != nil {
		t.Fatalf("Check after install: %v", err)
	}

	run(t, i)
	// The primary rewrites its file, as its agent does at boot.
	e.write(t, "10-bridge.conflist", strings.Replace(bridgeList, "cni0", "cni1", 1), 0o644)
	waitFor(t, "still in the chain after the primary's rewrite", func() error {
		if got := e.chainOf(t, "10-bridge.conflist"); got[len(got)-1] != testType {
			return fmt.Errorf("chain %v", got)
		}
		return i.Check()
	})
	if strings.Contains(e.read(t, "10-bridge.conflist"), testType) {
		t.Fatal("our entry was written into the primary's file")
	}
	if err := os.Remove(e.siblingFile()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "our file repaired", i.Check)
	// Again until it is gone: the installer repairs it as RemoveAll
	// empties it.
	waitFor(t, "the folder removed", func() error { return os.RemoveAll(filepath.Dir(e.siblingFile())) })
	waitFor(t, "the folder and our file repaired", i.Check)

	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(e.conf)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range ents {
		names = append(names, d.Name())
	}
	if strings.Join(names, ",") != "10-bridge.conflist" {
		t.Fatalf("the conf dir after an uninstall: %v, want only the primary's file", names)
	}
}

// A node chained the old way moves to the folder: the folder's file goes
// in first, then our entry leaves the primary's file, which is exactly as
// the primary wrote it again. Back to chaining (the setting turned off),
// the primary's list takes our entry first, then the folder's goes.
func TestSiblingMovesFromAndBackToThePrimary(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	state := filepath.Join(t.TempDir(), "state.json")
	chained := e.installer(t, func(c *Config) { c.StateFile = state })
	if err := chained.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(e.read(t, "10-bridge.conflist"), testType) {
		t.Fatal("not chained into the primary's file")
	}
	if err := chained.Shutdown(context.Background(), true); err != nil { // an upgrade
		t.Fatal(err)
	}

	i := e.installer(t, func(c *Config) { c.StateFile = state; c.Sibling = true })
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Fatalf("the primary's file after the move:\n%s", got)
	}
	if got := e.chainOf(t, "10-bridge.conflist"); got[len(got)-1] != testType || strings.Count(strings.Join(got, ","), testType) != 1 {
		t.Fatalf("chain after the move: %v", got)
	}
	if err := i.Shutdown(context.Background(), true); err != nil {
		t.Fatal(err)
	}

	back := e.installer(t, func(c *Config) { c.StateFile = state })
	if err := back.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.siblingFile()); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("our file in the folder after chaining back: %v", err)
	}
	if _, err := os.Stat(filepath.Dir(e.siblingFile())); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the emptied folder is still there: %v", err)
	}
	if got := e.chainOf(t, "10-bridge.conflist"); got[len(got)-1] != testType || strings.Count(strings.Join(got, ","), testType) != 1 {
		t.Fatalf("chain after going back: %v", got)
	}
	if err := back.Check(); err != nil {
		t.Fatal(err)
	}
	if err := back.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Fatalf("the primary's file after the uninstall:\n%s", got)
	}
}

// Where the folder cannot carry our entry, the installer chains into the
// primary's file as without the setting, and says why once.
func TestSiblingFallsBackToThePrimary(t *testing.T) {
	cases := map[string]struct{ name, conf, why string }{
		"single-plugin conf": {"10-bridge.conf", `{"cniVersion":"1.0.0","name":"containerd-net","type":"bridge"}`, "single-plugin"},
		"loadOnlyInlinedPlugins": {"10-bridge.conflist",
			strings.Replace(bridgeList, `"name": "containerd-net",`, `"name": "containerd-net", "loadOnlyInlinedPlugins": true,`, 1), "loadOnlyInlinedPlugins"},
		"loadOnlyInlinedPlugins as a string": {"10-bridge.conflist",
			strings.Replace(bridgeList, `"name": "containerd-net",`, `"name": "containerd-net", "loadOnlyInlinedPlugins": "TRUE",`, 1), "loadOnlyInlinedPlugins"},
		"network name with a slash": {"10-bridge.conflist", strings.Replace(bridgeList, `"containerd-net"`, `"../net"`, 1), "not a plain folder name"},
		"network name a dot file":   {"10-bridge.conflist", strings.Replace(bridgeList, `"containerd-net"`, `".net"`, 1), "not a plain folder name"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			e.write(t, c.name, c.conf, 0o644)
			i := e.installer(t, siblingOn)
			if err := i.Install(context.Background()); err != nil {
				t.Fatal(err)
			}
			choice, ours := e.runtimeChoice(t)
			if !ours {
				t.Fatalf("the runtime's choice %s does not run our plugin", choice)
			}
			if !strings.Contains(e.read(t, choice), testType) {
				t.Fatalf("%s: our entry not in the primary's file", choice)
			}
			if got := e.logs.count("not chaining in the primary network's folder"); got != 1 {
				t.Errorf("the fallback said %d times, want once", got)
			}
			if err := i.Check(); err != nil {
				t.Fatal(err)
			}
			ents, _ := os.ReadDir(e.conf)
			for _, d := range ents {
				if d.IsDir() {
					t.Errorf("a folder %s was made", d.Name())
				}
			}
		})
	}
}

// Another plugin's file in the folder stays, runs before ours, and keeps
// the folder at an uninstall; a file of our name that is not our entry is
// replaced (the folder is the runtime's to run, ours to keep right).
func TestSiblingLeavesOthersInTheFolder(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	dir := filepath.Dir(e.siblingFile())
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(dir, "50-tuning.conf")
	if err := os.WriteFile(other, []byte(`{"type":"tuning"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	i := e.installer(t, siblingOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(e.chainOf(t, "10-bridge.conflist"), ","), "bridge,portmap,tuning,"+testType; got != want {
		t.Fatalf("chain %s, want %s", got, want)
	}
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(other); err != nil || string(b) != `{"type":"tuning"}` {
		t.Fatalf("the other plugin's file after an uninstall: %q, %v", b, err)
	}
	if _, err := os.Stat(e.siblingFile()); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("our file after an uninstall: %v", err)
	}
}

// istio-cni chained in the primary's file is taken over there (one write,
// as without the setting; without the takeover the refusal to chain next
// to it stands); once that is done, the next pass moves our entry into the
// folder.
func TestSiblingAfterIstioCNITakeover(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", istioChained, 0o644)
	if err := e.installer(t, siblingOn).Install(context.Background()); !errors.Is(err, ErrIstioCNIChained) {
		t.Fatalf("Install next to istio-cni without the takeover: %v, want ErrIstioCNIChained", err)
	}
	i := e.installer(t, func(c *Config) {
		c.Sibling = true
		c.IstioCNIGone = func(string) error { return nil }
	})
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(e.read(t, "10-bridge.conflist"), "istio-cni") {
		t.Fatal("istio-cni still chained")
	}
	if err := i.Install(context.Background()); err != nil { // the next pass
		t.Fatal(err)
	}
	if strings.Contains(e.read(t, "10-bridge.conflist"), testType) {
		t.Fatal("our entry still in the primary's file after the next pass")
	}
	if got := e.chainOf(t, "10-bridge.conflist"); got[len(got)-1] != testType {
		t.Fatalf("chain %v", got)
	}
}

// The installer makes the runtime reload after a change in the folder:
// containerd reloads on a removal in the conf dir (not on a creation).
func TestSiblingMakesTheRuntimeReload(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Add(e.conf); err != nil {
		t.Fatal(err)
	}
	i := e.installer(t, siblingOn)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	reloads := func() int {
		n := 0
		for {
			select {
			case ev := <-w.Events:
				// What containerd's syncer reloads on.
				if !ev.Has(fsnotify.Create) && !ev.Has(fsnotify.Chmod) {
					n++
				}
			default:
				return n
			}
		}
	}
	waitFor(t, "a reload after the install", func() error {
		if reloads() == 0 {
			return errors.New("no event containerd reloads on")
		}
		return nil
	})
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a reload after the uninstall", func() error {
		if reloads() == 0 {
			return errors.New("no event containerd reloads on")
		}
		return nil
	})
}
