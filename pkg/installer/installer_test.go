package installer

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// eventually is the generous bounded wait for asynchronous repairs: the
// speed itself is measured by BenchmarkRestoreLatency, not asserted here.
// A repair copies a 3 MiB binary with fsyncs and may wait out the rewrite
// limit, on a 2-core CI machine that is busy with other tests.
const eventually = time.Minute

// bridgeList is a primary config as a bridge-based CNI would write it.
const bridgeList = `{
  "cniVersion": "1.0.0",
  "name": "containerd-net",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]]}
    },
    {
      "type": "portmap",
      "capabilities": {"portMappings": true}
    }
  ]
}
`

// env is one fake node: a CNI bin dir, a conf dir and our plugin binary.
type env struct {
	bin, conf, src string
	srcBytes       []byte
	logs           *logCapture
}

func newEnv(t testing.TB) *env {
	t.Helper()
	root := t.TempDir()
	e := &env{
		bin:  filepath.Join(root, "opt", "cni", "bin"),
		conf: filepath.Join(root, "etc", "cni", "net.d"),
		src:  filepath.Join(root, "image", "ambient-cni"),
		logs: &logCapture{},
	}
	for _, d := range []string{e.bin, e.conf, filepath.Dir(e.src)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e.srcBytes = make([]byte, 3<<20+17) // binary-sized, not a multiple of the compare buffer
	_, _ = rand.Read(e.srcBytes)
	if err := os.WriteFile(e.src, e.srcBytes, 0o755); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) installer(t testing.TB, mod func(*Config)) *Installer {
	t.Helper()
	cfg := Config{
		BinDir:       e.bin,
		ConfDir:      e.conf,
		PluginBinary: e.src,
		PluginConfig: testEntry,
		Logger:       slog.New(e.logs),
	}
	if mod != nil {
		mod(&cfg)
	}
	i, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return i
}

func (e *env) path(name string) string { return filepath.Join(e.conf, name) }

func (e *env) write(t testing.TB, name, content string, mode fs.FileMode) {
	t.Helper()
	// Like most CNIs: plain truncate-and-write, not atomic.
	if err := os.WriteFile(e.path(name), []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(e.path(name), mode); err != nil {
		t.Fatal(err)
	}
}

func (e *env) read(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(e.path(name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func mustChain(t testing.TB, conf, name string) string {
	t.Helper()
	out, _, err := ChainInto([]byte(conf), name, testEntry, testType)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func waitFor(t testing.TB, what string, cond func() error) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := start.Add(eventually)
	for {
		err := cond()
		if err == nil {
			return time.Since(start)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v\n%s", what, eventually, err, installerStacks())
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// installerStacks shows where the installer's goroutines are (in a pass,
// and at which step, or waiting for an event), so a timeout says why.
func installerStacks() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "installer.(*Installer)") {
			out = append(out, g)
		}
	}
	return "installer goroutines:\n" + strings.Join(out, "\n\n")
}

// run starts i.Run and stops it when the test ends, checking it returned.
func run(t testing.TB, i *Installer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- i.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(eventually):
			t.Error("Run did not return after cancel")
		}
	})
}

// logCapture is a slog handler that keeps messages for assertions.
type logCapture struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logCapture) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCapture) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Message)
	return nil
}
func (l *logCapture) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logCapture) WithGroup(string) slog.Handler      { return l }
func (l *logCapture) count(prefix string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}

func (e *env) binaryOK() error {
	b, err := os.ReadFile(filepath.Join(e.bin, testType))
	if err != nil {
		return err
	}
	if !bytes.Equal(b, e.srcBytes) {
		return errors.New("binary content differs")
	}
	return nil
}

func TestNewRejectsBadConfig(t *testing.T) {
	e := newEnv(t)
	for name, mod := range map[string]func(*Config){
		"no bin dir":      func(c *Config) { c.BinDir = "" },
		"missing binary":  func(c *Config) { c.PluginBinary = filepath.Join(e.bin, "nope") },
		"binary is dir":   func(c *Config) { c.PluginBinary = e.bin },
		"name with slash": func(c *Config) { c.PluginName = "../x" },
		"bad conf name":   func(c *Config) { c.PrimaryConfName = "10-x.yaml" },
		"entry not obj":   func(c *Config) { c.PluginConfig = []byte(`[]`) },
		"entry other typ": func(c *Config) { c.PluginConfig = []byte(`{"type":"bridge"}`) },
		"negative rate":   func(c *Config) { c.MaxRewritesPerSecond = -1 },
	} {
		cfg := Config{BinDir: e.bin, ConfDir: e.conf, PluginBinary: e.src}
		mod(&cfg)
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New accepted it", name)
		}
	}
}

func TestInstallOnce(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o640)
	i := e.installer(t, nil)
	if i.Ready() {
		t.Fatal("ready before install")
	}
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.binaryOK(); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(filepath.Join(e.bin, testType))
	if fi.Mode().Perm() != 0o755 {
		t.Errorf("binary mode %v, want 0755", fi.Mode().Perm())
	}
	if got, want := e.read(t, "10-bridge.conflist"), mustChain(t, bridgeList, "x.conflist"); got != want {
		t.Errorf("config:\n%s\nwant\n%s", got, want)
	}
	fi, _ = os.Stat(e.path("10-bridge.conflist"))
	if fi.Mode().Perm() != 0o640 {
		t.Errorf("config mode %v, want the original 0640", fi.Mode().Perm())
	}
	if err := i.Check(); err != nil {
		t.Fatalf("not ready after install: %v", err)
	}
	st := i.Stats()
	if diff := cmp.Diff(Stats{ConfigWrites: 1, BinaryCopies: 1, Reinstalls: 0}, st, cmpopts.IgnoreFields(Stats{}, "Throttled", "Errors")); diff != "" {
		t.Errorf("stats (-want +got):\n%s", diff)
	}
	// A second pass finds everything in place and writes nothing.
	before, _ := os.Stat(e.path("10-bridge.conflist"))
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(e.path("10-bridge.conflist"))
	if st2 := i.Stats(); st2 != st || !os.SameFile(before, after) {
		t.Errorf("second install rewrote something: %+v", st2)
	}
}

func TestInstallBinaryOnlyWhenDifferent(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	dst := filepath.Join(e.bin, testType)
	if err := os.WriteFile(dst, e.srcBytes, 0o755); err != nil {
		t.Fatal(err)
	}
	before, _ := os.Stat(dst)
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(dst)
	if !os.SameFile(before, after) || i.Stats().BinaryCopies != 0 {
		t.Error("identical binary was copied again")
	}
	// A different binary of the same size is replaced.
	other := bytes.Clone(e.srcBytes)
	other[len(other)-1] ^= 0xff
	if err := os.WriteFile(dst, other, 0o755); err != nil {
		t.Fatal(err)
	}
	i2 := e.installer(t, nil)
	if err := i2.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.binaryOK(); err != nil || i2.Stats().BinaryCopies != 1 {
		t.Errorf("stale binary not replaced: %v", err)
	}
}

// An identical copy anyone may write (a group- or world-writable mode)
// is not ours: it is replaced by a 0755 one.
func TestInstallBinaryLooseModeReplaced(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	dst := filepath.Join(e.bin, testType)
	if err := os.WriteFile(dst, e.srcBytes, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dst, 0o777); err != nil { // past the umask
		t.Fatal(err)
	}
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.binaryOK(); err != nil || i.Stats().BinaryCopies != 1 {
		t.Errorf("a world-writable copy kept: %v, %d copies", err, i.Stats().BinaryCopies)
	}
	fi, err := os.Stat(dst)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o755 {
		t.Errorf("binary mode %04o, want 0755", fi.Mode().Perm())
	}
}

func TestInstallNoPrimary(t *testing.T) {
	e := newEnv(t)
	i := e.installer(t, nil)
	err := i.Install(context.Background())
	if !errors.Is(err, ErrNoPrimaryConfig) {
		t.Fatalf("err %v, want ErrNoPrimaryConfig", err)
	}
	if err := e.binaryOK(); err != nil {
		t.Errorf("binary should be installed ahead of the config: %v", err)
	}
	if i.Ready() {
		t.Error("ready without a config")
	}
}

func TestInstallPicksPrimaryLikeTheRuntime(t *testing.T) {
	e := newEnv(t)
	junk := map[string]string{
		"00-broken.conflist": `{"cniVersion":"1.0.0","name":"x","plugins":[`,
		"01-notype.conf":     `{"cniVersion":"1.0.0","name":"x"}`,
		"02-empty.conflist":  `{"cniVersion":"1.0.0","name":"x","plugins":[]}`,
		"03-notes.txt":       `{"cniVersion":"1.0.0","name":"x","type":"bridge"}`,
	}
	// Written "just now" however long the pass takes to reach them: it
	// copies the 3 MiB plugin first, which on a loaded machine can take
	// longer than settleTime, and junk that old is rightly skipped as
	// settled. A modification time ahead of the clock stays "just now".
	fresh := time.Now().Add(time.Hour)
	for n, c := range junk {
		e.write(t, n, c, 0o644)
		if err := os.Chtimes(e.path(n), fresh, fresh); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(e.path("04-dir.conflist"), 0o755); err != nil {
		t.Fatal(err)
	}
	// A temp file of ours left by a crash: never a candidate, and removed.
	stale := e.path(atomicfile.TempPrefix + "12345" + atomicfile.TempSuffix)
	e.write(t, filepath.Base(stale), bridgeList, 0o600)
	staleBin := filepath.Join(e.bin, atomicfile.TempPrefix+"999"+atomicfile.TempSuffix)
	if err := os.WriteFile(staleBin, []byte("half a binary"), 0o600); err != nil {
		t.Fatal(err)
	}
	e.write(t, "10-real.conflist", bridgeList, 0o644)
	e.write(t, "20-later.conflist", bridgeList, 0o644)

	i := e.installer(t, nil)
	// Freshly written junk first in line looks like a primary mid-write:
	// the installer waits rather than chain into the next file.
	if err := i.Install(context.Background()); !errors.Is(err, ErrConfigInFlux) {
		t.Fatalf("err %v, want ErrConfigInFlux", err)
	}
	if e.read(t, "10-real.conflist") != bridgeList {
		t.Fatal("chained past a config that is being written")
	}
	// Once settled, junk is skipped the way the runtime skips it.
	old := time.Now().Add(-time.Minute)
	for n := range junk {
		if err := os.Chtimes(e.path(n), old, old); err != nil {
			t.Fatal(err)
		}
	}
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-real.conflist"); got != mustChain(t, bridgeList, "x.conflist") {
		t.Errorf("10-real not chained:\n%s", got)
	}
	if got := e.read(t, "20-later.conflist"); got != bridgeList {
		t.Error("a later config was touched")
	}
	for n, c := range junk {
		if got := e.read(t, n); got != c {
			t.Errorf("%s was touched", n)
		}
	}
	for _, p := range []string{stale, staleBin} {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("stale temp file %s not removed", p)
		}
	}
}

func TestInstallConfiguredName(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-first.conflist", bridgeList, 0o644)
	e.write(t, "20-chosen.conflist", bridgeList, 0o644)
	i := e.installer(t, func(c *Config) { c.PrimaryConfName = "20-chosen.conflist" })
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if e.read(t, "10-first.conflist") != bridgeList || e.read(t, "20-chosen.conflist") == bridgeList {
		t.Error("chained into the wrong file")
	}
	if !i.Ready() {
		t.Error("not ready")
	}

	// A configured file that is broken: clear error, file untouched.
	broken := `{"cniVersion":"1.0.0","name":"x","plugins":{"type":"bridge"}}`
	e.write(t, "30-broken.conflist", broken, 0o644)
	i2 := e.installer(t, func(c *Config) { c.PrimaryConfName = "30-broken.conflist" })
	err := i2.Install(context.Background())
	if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "30-broken.conflist") {
		t.Errorf("err %v", err)
	}
	if e.read(t, "30-broken.conflist") != broken {
		t.Error("broken file was modified")
	}
	// A configured file that does not exist yet.
	i3 := e.installer(t, func(c *Config) { c.PrimaryConfName = "40-later.conflist" })
	if err := i3.Install(context.Background()); !errors.Is(err, ErrNoPrimaryConfig) {
		t.Errorf("err %v, want ErrNoPrimaryConfig", err)
	}
}

func TestHostileFilesLeftUntouched(t *testing.T) {
	huge := `{"cniVersion":"1.0.0","name":"x","pad":"` + strings.Repeat("x", MaxConfigSize) + `","plugins":[{"type":"bridge"}]}`
	for name, c := range map[string]string{
		"malformed":     `{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"bridge"}`,
		"plugins-obj":   `{"cniVersion":"1.0.0","name":"x","plugins":{"type":"bridge"}}`,
		"huge":          huge,
		"only-ours":     `{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"ambient-cni"}]}`,
		"old-version":   `{"cniVersion":"0.2.0","name":"x","plugins":[{"type":"bridge"}]}`,
		"plugin-notype": `{"cniVersion":"1.0.0","name":"x","plugins":[{"bridge":"cni0"}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			e.write(t, "10-x.conflist", c, 0o644)
			i := e.installer(t, func(cfg *Config) { cfg.PrimaryConfName = "10-x.conflist" })
			err := i.Install(context.Background())
			if err == nil {
				t.Fatal("Install accepted it")
			}
			t.Logf("error: %v", err)
			if e.read(t, "10-x.conflist") != c {
				t.Error("file was modified")
			}
			if i.Ready() {
				t.Error("ready")
			}
		})
	}
}

func TestConfConversionAndRestore(t *testing.T) {
	e := newEnv(t)
	conf, err := os.ReadFile(filepath.Join("testdata", "chain", "conf-convert", "in.conf"))
	if err != nil {
		t.Fatal(err)
	}
	e.write(t, "10-mynet.conf", string(conf), 0o600)
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.path("10-mynet.conf")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("the .conf is still there after conversion")
	}
	want, _ := os.ReadFile(filepath.Join("testdata", "chain", "conf-convert", "want.conflist"))
	if got := e.read(t, "10-mynet.conflist"); got != string(want) {
		t.Errorf("converted list:\n%s", got)
	}
	fi, _ := os.Stat(e.path("10-mynet.conflist"))
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want the .conf's 0600", fi.Mode().Perm())
	}
	if err := i.Check(); err != nil {
		t.Fatal(err)
	}
	// Idempotent: the next pass does nothing.
	if err := i.Install(context.Background()); err != nil || i.Stats().ConfigWrites != 1 {
		t.Fatalf("second pass: %v %+v", err, i.Stats())
	}

	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-mynet.conf"); got != string(conf) {
		t.Errorf("original .conf not restored byte for byte:\n%s", got)
	}
	fi, _ = os.Stat(e.path("10-mynet.conf"))
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("restored mode %v", fi.Mode().Perm())
	}
	if _, err := os.Stat(e.path("10-mynet.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("our .conflist is still there")
	}
	if _, err := os.Stat(filepath.Join(e.bin, testType)); !errors.Is(err, fs.ErrNotExist) {
		t.Error("binary still there")
	}
}

func TestConversionRefusesToClobber(t *testing.T) {
	e := newEnv(t)
	single := `{"cniVersion":"1.0.0","name":"a","type":"bridge"}`
	e.write(t, "10-a.conf", single, 0o644)
	// Another tool's list under the name we would convert to.
	e.write(t, "10-a.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err == nil || !strings.Contains(err.Error(), "refusing") {
		t.Fatalf("err %v", err)
	}
	if e.read(t, "10-a.conflist") != bridgeList || e.read(t, "10-a.conf") != single {
		t.Error("files changed")
	}
}

func TestShutdownRestoresOriginalBytes(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Errorf("not restored byte for byte:\n%s", got)
	}
	if _, err := os.Stat(filepath.Join(e.bin, testType)); !errors.Is(err, fs.ErrNotExist) {
		t.Error("binary still there")
	}
	if i.Ready() {
		t.Error("ready after uninstall")
	}
	// Shut down for good: no pass writes again.
	if err := i.Install(context.Background()); !errors.Is(err, errClosed) {
		t.Errorf("Install after Shutdown: %v", err)
	}
}

func TestShutdownAfterPrimaryEdit(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The primary edits its own part of the chained file, keeping ours.
	edited := strings.Replace(e.read(t, "10-bridge.conflist"), `"cni0"`, `"cni9"`, 1)
	e.write(t, "10-bridge.conflist", edited, 0o644)
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	want := strings.Replace(bridgeList, `"cni0"`, `"cni9"`, 1)
	if got := e.read(t, "10-bridge.conflist"); got != want {
		t.Errorf("got\n%s\nwant the primary's bytes without our entry\n%s", got, want)
	}
}

func TestShutdownRemovesStaleEntriesEverywhere(t *testing.T) {
	e := newEnv(t)
	stale, _ := os.ReadFile(filepath.Join("testdata", "chain", "stale-middle", "in.conflist"))
	e.write(t, "10-calico.conflist", string(stale), 0o644)
	// A later file a previous agent chained into before the primary moved.
	e.write(t, "90-old.conflist", mustChain(t, bridgeList, "x.conflist"), 0o644)
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	want, _ := Unchain(stale, testType)
	if got := e.read(t, "10-calico.conflist"); got != string(want) {
		t.Errorf("10-calico:\n%s", got)
	}
	if got := e.read(t, "90-old.conflist"); got != bridgeList {
		t.Errorf("90-old:\n%s", got)
	}
}

func TestShutdownDuringUpgradeLeavesPlugin(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
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
	if err := e.binaryOK(); err != nil {
		t.Error(err)
	}
	if !i.Ready() {
		t.Error("plugin should stay installed")
	}
}

func TestSymlinkedPrimaryKeepsLink(t *testing.T) {
	e := newEnv(t)
	realDir := filepath.Join(filepath.Dir(e.conf), "real")
	if err := os.MkdirAll(realDir, 0o755); err != nil {
		t.Fatal(err)
	}
	realFile := filepath.Join(realDir, "bridge.conflist")
	if err := os.WriteFile(realFile, []byte(bridgeList), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(realFile, e.path("10-link.conflist")); err != nil {
		t.Fatal(err)
	}
	i := e.installer(t, nil)
	if err := i.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Lstat(e.path("10-link.conflist")); fi.Mode()&fs.ModeSymlink == 0 {
		t.Error("symlink replaced by a file")
	}
	if got, _ := os.ReadFile(realFile); string(got) != mustChain(t, bridgeList, "x.conflist") {
		t.Errorf("target not chained:\n%s", got)
	}
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(realFile); string(got) != bridgeList {
		t.Errorf("target not restored:\n%s", got)
	}
}

func TestStateFileCarriesOriginalsAcrossRestart(t *testing.T) {
	e := newEnv(t)
	state := filepath.Join(t.TempDir(), "private", "installer-state.json")
	conf, err := os.ReadFile(filepath.Join("testdata", "chain", "conf-convert", "in.conf"))
	if err != nil {
		t.Fatal(err)
	}
	e.write(t, "10-mynet.conf", string(conf), 0o644)
	e.write(t, "20-bridge.conflist", bridgeList, 0o644)

	// The old agent converts and chains, then is upgraded away.
	old := e.installer(t, func(c *Config) { c.StateFile = state })
	if err := old.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(state); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("state file: %v", err)
	}
	if err := old.Shutdown(context.Background(), true); err != nil {
		t.Fatal(err)
	}

	// The new agent has a different entry, so it rewrites ours once.
	next := e.installer(t, func(c *Config) {
		c.StateFile = state
		c.PluginConfig = []byte(`{"socket":"/var/run/ambient-cni/agent.sock","timeout":"10s"}`)
	})
	if err := next.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if next.Stats().ConfigWrites != 1 {
		t.Fatalf("new entry not written: %+v", next.Stats())
	}
	if err := next.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-mynet.conf"); got != string(conf) {
		t.Errorf("original .conf not restored after a restart:\n%s", got)
	}
	if _, err := os.Stat(e.path("10-mynet.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("converted list left behind")
	}
	if got := e.read(t, "20-bridge.conflist"); got != bridgeList {
		t.Error("other config changed")
	}
	if _, err := os.Stat(state); !errors.Is(err, fs.ErrNotExist) {
		t.Error("state file not removed after uninstall")
	}
}

func TestStateFileHostile(t *testing.T) {
	e := newEnv(t)
	outside := filepath.Join(t.TempDir(), "victim.conf")
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	chained := mustChain(t, bridgeList, "x.conflist")
	for name, content := range map[string]string{
		"garbage":       "{{{{",
		"wrong version": `{"version":9,"records":[]}`,
		// A record that would make us write outside the conf dir.
		"escape": fmt.Sprintf(`{"version":1,"records":[{"path":%q,"written":%q,"origPath":%q,"orig":%q}]}`,
			e.path("10-bridge.conflist"), base64.StdEncoding.EncodeToString([]byte(chained)),
			outside, base64.StdEncoding.EncodeToString([]byte("pwned"))),
	} {
		t.Run(name, func(t *testing.T) {
			state := filepath.Join(t.TempDir(), "state.json")
			if err := os.WriteFile(state, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
			e.write(t, "10-bridge.conflist", bridgeList, 0o644)
			i := e.installer(t, func(c *Config) { c.StateFile = state })
			if err := i.Install(context.Background()); err != nil {
				t.Fatal(err)
			}
			// Forget this run's own record to force use of the loaded one.
			i.mu.Lock()
			i.records = map[string]*record{}
			i.stateLoaded = false
			i.mu.Unlock()
			if err := os.WriteFile(state, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := i.Shutdown(context.Background(), false); err != nil {
				t.Fatal(err)
			}
			if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
				t.Errorf("config:\n%s", got)
			}
			if _, err := os.Stat(outside); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("wrote outside the conf dir: %v", err)
			}
		})
	}
}
