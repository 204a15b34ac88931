package installer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// withExtraBinDirs adds n extra bin dirs beside the env's bin dir, as a
// runtime with a search list (containerd 2.x bin_dirs) has them.
func (e *env) withExtraBinDirs(t testing.TB, n int) []string {
	t.Helper()
	root := filepath.Dir(filepath.Dir(filepath.Dir(e.bin)))
	var dirs []string
	for k := range n {
		d := filepath.Join(root, "usr", "libexec", fmt.Sprintf("cni-%d", k))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, d)
	}
	return dirs
}

// copyOK reports whether dir holds an exact executable copy of our binary.
func (e *env) copyOK(dir string) func() error {
	return func() error {
		p := filepath.Join(dir, testType)
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		if fi.Mode().Perm() != 0o755 {
			return fmt.Errorf("%s: mode %v", p, fi.Mode().Perm())
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if !bytes.Equal(b, e.srcBytes) {
			return fmt.Errorf("%s: content differs", p)
		}
		return nil
	}
}

// tampered is our binary with its last byte changed: the same size, so
// only the content tells it apart.
func (e *env) tampered() []byte {
	b := bytes.Clone(e.srcBytes)
	b[len(b)-1] ^= 0xff
	return b
}

func TestExtraBinDirsInstalledAndReady(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	extra := e.withExtraBinDirs(t, 2)
	// A stale binary of the same size in an extra dir, as an older
	// version left it: it must be replaced, or the runtime may run it.
	stale := filepath.Join(extra[0], testType)
	if err := os.WriteFile(stale, e.tampered(), 0o755); err != nil {
		t.Fatal(err)
	}
	i := e.installer(t, func(c *Config) { c.ExtraBinDirs = extra })
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, d := range append([]string{e.bin}, extra...) {
		if err := e.copyOK(d)(); err != nil {
			t.Error(err)
		}
	}
	if st := i.Stats(); st.BinaryCopies != 3 {
		t.Errorf("copies %d, want one per dir", st.BinaryCopies)
	}
	if err := i.Check(); err != nil {
		t.Fatalf("not ready after install: %v", err)
	}

	// One copy missing: not ready, and the reason names it.
	if err := os.Remove(filepath.Join(extra[1], testType)); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err == nil || !strings.Contains(err.Error(), extra[1]) {
		t.Errorf("Check with a copy missing: %v, want an error naming %s", err, extra[1])
	}
	// One copy tampered with, same size: not ready either.
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err != nil {
		t.Fatalf("not ready after the repair: %v", err)
	}
	if err := os.WriteFile(stale, e.tampered(), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err == nil || !strings.Contains(err.Error(), extra[0]) {
		t.Errorf("Check with a tampered copy: %v, want an error naming %s", err, extra[0])
	}
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err != nil {
		t.Errorf("not ready after the repair: %v", err)
	}
	// A pass with everything in place copies nothing.
	before := i.Stats().BinaryCopies
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if after := i.Stats().BinaryCopies; after != before {
		t.Errorf("a pass with every copy in place copied %d times", after-before)
	}
}

func TestRunRepairsEveryBinDir(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	extra := e.withExtraBinDirs(t, 1)
	i := e.installer(t, func(c *Config) { c.ExtraBinDirs = extra })
	run(t, i)
	waitFor(t, "initial install", i.Check)

	t.Run("extra copy tampered", func(t *testing.T) {
		if err := os.WriteFile(filepath.Join(extra[0], testType), e.tampered(), 0o755); err != nil {
			t.Fatal(err)
		}
		d := waitFor(t, "extra copy restored", e.copyOK(extra[0]))
		t.Logf("restored %v after a same-size overwrite", d)
	})
	t.Run("extra copy deleted", func(t *testing.T) {
		if err := os.Remove(filepath.Join(extra[0], testType)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "extra copy restored", e.copyOK(extra[0]))
	})
	t.Run("first copy deleted", func(t *testing.T) {
		if err := os.Remove(filepath.Join(e.bin, testType)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "first copy restored", e.copyOK(e.bin))
	})
	t.Run("extra dir removed", func(t *testing.T) {
		// The installer repairs the folder as RemoveAll empties it (the
		// copy's removal is an event), which can leave it not empty for
		// RemoveAll's last step: as an operator would, remove it again
		// until it is gone. Each repair it undid is one more copy.
		waitFor(t, "extra dir removed", func() error { return os.RemoveAll(extra[0]) })
		waitFor(t, "extra dir and copy restored", e.copyOK(extra[0]))
	})
	waitFor(t, "ready again", i.Check)
	waitFor(t, "reinstall count", func() error {
		if st := i.Stats(); st.BinaryCopies < 6 || st.Reinstalls < 4 {
			return fmt.Errorf("want 2 first copies and at least 4 repairs: %+v", st)
		}
		return nil
	})
	// Once stamped, the copies stay quiet: no repair without a change.
	// The count goes up just before its log line, so the last line may
	// still be on its way.
	copies := int(i.Stats().BinaryCopies)
	waitFor(t, "every copy logged", func() error {
		if got := e.logs.count("installed plugin binary"); got < copies {
			return fmt.Errorf("%d of %d copies logged", got, copies)
		}
		return nil
	})
	if got, st := e.logs.count("installed plugin binary"), i.Stats(); got != copies || int(st.BinaryCopies) != copies {
		t.Errorf("%d copies logged, %d counted, want %d: a repair without a change", got, st.BinaryCopies, copies)
	}
}

// A bin dir that cannot be written fails the pass, and the config is not
// chained (a runtime searching that dir would not find our binary), but
// the other dirs get their copies.
func TestUnwritableExtraBinDirFailsThePass(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	extra := e.withExtraBinDirs(t, 2)
	blocked := filepath.Join(extra[0], "blocked")
	// A file where a directory must be: MkdirAll fails, even for root.
	if err := os.WriteFile(blocked, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var outcomes []Outcome
	i := e.installer(t, func(c *Config) {
		c.ExtraBinDirs = []string{blocked, extra[1]}
		c.OnOutcome = func(o Outcome) { outcomes = append(outcomes, o) }
	})
	err := i.Install(context.Background())
	if err == nil || !strings.Contains(err.Error(), blocked) {
		t.Fatalf("Install: %v, want an error naming %s", err, blocked)
	}
	for _, d := range []string{e.bin, extra[1]} {
		if err := e.copyOK(d)(); err != nil {
			t.Error(err)
		}
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Errorf("config chained while a copy is missing:\n%s", got)
	}
	if len(outcomes) != 1 || outcomes[0] != OutcomeCopyFailed {
		t.Errorf("outcomes %v, want one %s", outcomes, OutcomeCopyFailed)
	}
	if i.Ready() {
		t.Error("ready with a copy missing")
	}
}

func TestShutdownRemovesEveryCopy(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	extra := e.withExtraBinDirs(t, 2)
	i := e.installer(t, func(c *Config) { c.ExtraBinDirs = extra })
	run(t, i)
	waitFor(t, "install", i.Check)
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Errorf("config after shutdown:\n%s", got)
	}
	for _, d := range append([]string{e.bin}, extra...) {
		if _, err := os.Stat(filepath.Join(d, testType)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: binary left after uninstall: %v", d, err)
		}
		// The directories are the runtime's: they stay.
		if _, err := os.Stat(d); err != nil {
			t.Errorf("bin dir removed: %v", err)
		}
	}
}

func TestUpgradeShutdownKeepsEveryCopy(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	extra := e.withExtraBinDirs(t, 2)
	i := e.installer(t, func(c *Config) { c.ExtraBinDirs = extra })
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	chained := e.read(t, "10-bridge.conflist")
	if err := i.Shutdown(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	if e.read(t, "10-bridge.conflist") != chained {
		t.Error("config changed during upgrade shutdown")
	}
	for _, d := range append([]string{e.bin}, extra...) {
		if err := e.copyOK(d)(); err != nil {
			t.Error(err)
		}
	}
	// The next agent, with the same dirs, finds everything in place.
	next := e.installer(t, func(c *Config) { c.ExtraBinDirs = extra })
	if err := next.Check(); err != nil {
		t.Errorf("next agent not ready on what the upgrade left: %v", err)
	}
}

func TestNewRejectsBadExtraBinDirs(t *testing.T) {
	e := newEnv(t)
	for name, c := range map[string]struct {
		dirs []string
		want string
	}{
		"empty":              {[]string{""}, "empty"},
		"relative":           {[]string{"usr/libexec/cni"}, "not an absolute path"},
		"same as bin dir":    {[]string{e.bin}, "listed twice"},
		"bin dir, unclean":   {[]string{e.bin + "/./"}, "listed twice"},
		"duplicate extra":    {[]string{"/usr/libexec/cni", "/usr/libexec/cni/"}, "listed twice"},
		"empty after others": {[]string{"/usr/libexec/cni", ""}, "empty"},
	} {
		_, err := New(Config{BinDir: e.bin, ConfDir: e.conf, PluginBinary: e.src, ExtraBinDirs: c.dirs})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: New: %v, want an error saying %q", name, err, c.want)
		}
	}
}
