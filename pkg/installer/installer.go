// Package installer puts the ambient-cni plugin on a node for install-cni
// and keeps it there: it copies the plugin binary into the host's CNI bin directory,
// chains the plugin as the last entry of the primary CNI's configuration
// list, restores both whenever the primary CNI (or anyone) rewrites or
// removes them, and takes them away again on a real uninstall.
//
// The config editing (ChainInto, Unchain) is pure and splices bytes, so
// every byte the primary CNI wrote survives; the Installer is the thin
// side-effecting shell around it (atomic writes, fsnotify, a rewrite rate
// limit).
//
// The primary config is the lexically first .conf/.conflist/.json in the
// conf dir that libcni loads (or a configured name). Files that do not load
// are skipped, as libcni-based tools do; containerd's go-cni instead stops
// at such a file and has no network at all, so chaining into the next one
// is harmless there. A file that does not load but was written within the
// last second is taken for a primary mid-write, not skipped
// (ErrConfigInFlux), so a non-atomic writer never sends us to the wrong
// file. A single-plugin .conf is converted into a .conflist only when the
// list stays the runtime's first file; a primary that keeps removing our
// entry (an exclusive one) fails Check with ErrPrimaryContested.
//
// Wiring: New, then Run in a goroutine owned by main; Ready/Check for
// /readyz; Stats or Config.OnReinstall for metrics; on SIGTERM cancel Run's
// context and call ShutdownChecked (or Shutdown).
package installer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/fsnotify/fsnotify"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// Defaults for Config.
const (
	// DefaultPluginName is the plugin's binary name and its config "type".
	DefaultPluginName = "ambient-cni"
	// DefaultBinDir is where runtimes look for CNI plugin binaries.
	DefaultBinDir = "/opt/cni/bin"
	// DefaultConfDir is where runtimes look for CNI configs.
	DefaultConfDir = "/etc/cni/net.d"
	// DefaultMaxRewritesPerSecond is the sustained rewrite rate allowed.
	DefaultMaxRewritesPerSecond = 2
	// DefaultRewriteBurst is how many rewrites may happen back to back.
	DefaultRewriteBurst = 5
	// DefaultDebounce coalesces the burst of events one primary write makes.
	DefaultDebounce = 50 * time.Millisecond
	// DefaultResyncInterval is the safety-net full check when no event comes.
	DefaultResyncInterval = 30 * time.Second
)

// ErrNoPrimaryConfig means the conf dir holds no config the runtime would
// load (or the configured file is missing), so there is nothing to chain
// into yet.
var ErrNoPrimaryConfig = errors.New("no primary CNI config")

// errClosed is returned by passes after Shutdown.
var errClosed = errors.New("installer shut down")

// ErrConfigInFlux means a config file that would come first does not load but
// was written just now: most likely the primary CNI is halfway through a
// non-atomic write. Choosing the next file (or "no config") would chain
// into the wrong place and flap the logs, so the pass waits instead.
var ErrConfigInFlux = errors.New("CNI config is being written")

// settleTime is how long after its last write an unloadable config is
// taken for broken rather than half-written.
const settleTime = time.Second

// ErrPrimaryContested means the primary CNI keeps taking our entry out of
// its config (an exclusive primary, such as Cilium with cni.exclusive):
// the installer puts it back each time, but every pod that starts in
// between skips the plugin.
var ErrPrimaryContested = errors.New("the primary CNI keeps removing the plugin's config entry")

// A primary that takes our entry out contestedRemovals times within
// contestedWindow is fighting us, not restarting: Check fails until a
// whole window passes without a removal.
const (
	contestedRemovals = 3
	contestedWindow   = time.Minute
)

// Config configures an Installer. BinDir, ConfDir and PluginBinary are
// required; every other field has a default.
type Config struct {
	// BinDir is the host CNI bin directory the plugin binary is copied to.
	BinDir string
	// ConfDir is the host CNI config directory holding the primary config.
	ConfDir string
	// PluginBinary is the path of the plugin binary to install (in our image).
	PluginBinary string
	// PluginName is the installed binary's file name and the "type" of our
	// config entry. Default DefaultPluginName.
	PluginName string
	// PrimaryConfName, when set, names the file in ConfDir to chain into
	// instead of the lexically first valid config.
	PrimaryConfName string
	// PluginConfig is our plugin's config object (socket path, timeout, log
	// level, excluded namespaces, ...). "type" is added when absent.
	PluginConfig json.RawMessage
	// MaxRewritesPerSecond bounds sustained rewrites of configs and the
	// binary. Default DefaultMaxRewritesPerSecond.
	MaxRewritesPerSecond float64
	// RewriteBurst is how many rewrites may happen back to back before the
	// rate applies. Default DefaultRewriteBurst.
	RewriteBurst int
	// Debounce is how long Run waits after an event before acting, so one
	// write-and-rename by the primary costs one pass. Default DefaultDebounce.
	Debounce time.Duration
	// ResyncInterval is how often Run checks everything without an event,
	// in case one was missed. Default DefaultResyncInterval.
	ResyncInterval time.Duration
	// StateFile, when set, is where the installer keeps the original bytes
	// of the configs it edited, so that an uninstall after an agent restart
	// (an upgrade) still restores them exactly. Put it in a root-only
	// directory that survives container restarts (a host path).
	StateFile string
	// OnRefused, when set, is called when a pass refuses to chain because
	// istio-cni is already chained (ErrIstioCNIChained), once per file and
	// cause until the refusal ends, and when the primary CNI is found
	// removing our entry again and again (ErrPrimaryContested), once per
	// such episode: e.g. to record an Event. It runs with the Installer's
	// lock held: it must be quick and must not call back.
	OnRefused func(err error)
	// OnReinstall, when set, is called once per reinstall (see
	// Stats.Reinstalls), e.g. a prometheus Counter's Inc. It runs with the
	// Installer's lock held: it must be quick and must not call back.
	OnReinstall func()
	// Logger receives structured logs; nil discards them.
	Logger *slog.Logger
}

// Stats are the Installer's counters, all monotonic, for metrics.
type Stats struct {
	// ConfigWrites counts writes of a CNI config file (chaining).
	ConfigWrites uint64
	// BinaryCopies counts copies of the plugin binary.
	BinaryCopies uint64
	// Reinstalls counts config writes and binary copies made after the
	// first complete install: each is a repair of something removed or
	// rewritten underneath us.
	Reinstalls uint64
	// Throttled counts passes that had to wait for the rewrite limit.
	Throttled uint64
	// Errors counts passes that failed.
	Errors uint64
}

// Installer installs and guards the plugin on one node. Its methods are
// safe for concurrent use.
type Installer struct {
	cfg   Config
	log   *slog.Logger
	entry []byte // our normalized plugin entry
	dst   string // installed binary path

	mu          sync.Mutex // serializes passes and Shutdown
	closed      bool
	limiter     rewriteLimit
	records     map[string]*record
	binStamp    stamp
	installed   bool // first complete install done
	waiting     bool // "waiting for primary config" already logged
	tempsCleant bool
	stateLoaded bool
	lastErr     string // last pass error logged at Warn
	// removals are when a pass found our entry gone from a config we had
	// chained (the last contestedRemovals of them); contested is set
	// while they say the primary is fighting us. contestMu guards both, so
	// Check never waits for a pass.
	contestMu sync.Mutex
	removals  []time.Time
	contested error

	// testHookBinaryCopied, when set, runs right after a copy of the
	// binary landed, to let a test play a writer racing the installer.
	testHookBinaryCopied func()

	configWrites, binaryCopies, reinstalls, throttled, errs atomic.Uint64
}

// record remembers what we replaced in one config file, so Shutdown can
// put the primary's exact bytes back.
type record struct {
	written   []byte      // what we wrote to the file
	origPath  string      // the primary's file (differs after a .conf conversion)
	orig      []byte      // its bytes, nil when they already held our entry
	origMode  fs.FileMode // its mode
	origOwner *atomicfile.Owner
}

// stamp identifies one version of the installed binary cheaply, so a pass
// does not re-read megabytes when nothing touched the file.
type stamp struct {
	ok         bool
	ino        uint64
	size       int64
	mtim, ctim syscall.Timespec
	mode       fs.FileMode
}

// stampSettle is how long a file must have been left alone before its
// stamp is trusted. A write in the same timestamp tick as the stat that
// made a stamp can leave size, times and inode as they were ("racily
// clean", as git calls it); one that comes this much later cannot.
const stampSettle = time.Second

// trustedStamp is fi's stamp when the file last changed well before
// checked (a time taken before fi), else no stamp, so the next pass
// compares the content again.
func trustedStamp(fi fs.FileInfo, checked time.Time) stamp {
	s := stampOf(fi)
	if !s.ok || !time.Unix(s.ctim.Unix()).Before(checked.Add(-stampSettle)) {
		return stamp{}
	}
	return s
}

func stampOf(fi fs.FileInfo) stamp {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return stamp{}
	}
	return stamp{ok: true, ino: st.Ino, size: fi.Size(), mtim: st.Mtim, ctim: st.Ctim, mode: fi.Mode()}
}

// New checks cfg and returns an Installer. It touches nothing on disk
// except to check that the plugin binary exists.
func New(cfg Config) (*Installer, error) {
	if cfg.BinDir == "" || cfg.ConfDir == "" || cfg.PluginBinary == "" {
		return nil, errors.New("installer: BinDir, ConfDir and PluginBinary are required")
	}
	cfg.BinDir, cfg.ConfDir = filepath.Clean(cfg.BinDir), filepath.Clean(cfg.ConfDir)
	if cfg.StateFile != "" {
		cfg.StateFile = filepath.Clean(cfg.StateFile)
	}
	if cfg.PluginName == "" {
		cfg.PluginName = DefaultPluginName
	}
	if !plainName(cfg.PluginName) {
		return nil, fmt.Errorf("installer: plugin name %q must be a plain file name", cfg.PluginName)
	}
	if cfg.PrimaryConfName != "" {
		if !plainName(cfg.PrimaryConfName) || !isConfigName(cfg.PrimaryConfName) {
			return nil, fmt.Errorf("installer: primary config name %q must be a plain .conf, .conflist or .json file name", cfg.PrimaryConfName)
		}
	}
	fi, err := os.Stat(cfg.PluginBinary)
	if err != nil {
		return nil, fmt.Errorf("installer: plugin binary: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("installer: plugin binary %s is not a regular file", cfg.PluginBinary)
	}
	entry, err := normalizeEntry(cfg.PluginConfig, cfg.PluginName)
	if err != nil {
		return nil, fmt.Errorf("installer: plugin config: %w", err)
	}
	if cfg.MaxRewritesPerSecond == 0 {
		cfg.MaxRewritesPerSecond = DefaultMaxRewritesPerSecond
	}
	if cfg.MaxRewritesPerSecond < 0 {
		return nil, errors.New("installer: MaxRewritesPerSecond must be positive")
	}
	if cfg.RewriteBurst <= 0 {
		cfg.RewriteBurst = DefaultRewriteBurst
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = DefaultDebounce
	}
	if cfg.ResyncInterval <= 0 {
		cfg.ResyncInterval = DefaultResyncInterval
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Installer{
		cfg:     cfg,
		log:     log.With("component", "installer"),
		entry:   entry,
		dst:     filepath.Join(cfg.BinDir, cfg.PluginName),
		limiter: newRewriteLimit(cfg.MaxRewritesPerSecond, cfg.RewriteBurst),
		records: map[string]*record{},
	}, nil
}

func plainName(s string) bool {
	return s != "." && s != ".." && !strings.ContainsRune(s, '/') && s != ""
}

// isConfigName reports whether the runtime would consider the file.
func isConfigName(name string) bool {
	switch filepath.Ext(name) {
	case ".conf", ConflistExt, ".json":
		return true
	}
	return false
}

// Stats returns a snapshot of the counters.
func (i *Installer) Stats() Stats {
	return Stats{
		ConfigWrites: i.configWrites.Load(),
		BinaryCopies: i.binaryCopies.Load(),
		Reinstalls:   i.reinstalls.Load(),
		Throttled:    i.throttled.Load(),
		Errors:       i.errs.Load(),
	}
}

// Install makes one pass: copy the binary if it differs, then chain our
// entry into the primary config. It returns ErrNoPrimaryConfig (wrapped)
// when there is no primary config yet. It ignores the rewrite limit: the
// caller asked for exactly one pass.
func (i *Installer) Install(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		retry, err := i.pass(true)
		if err != nil || retry == 0 {
			return err
		}
		// The primary wrote the file while we did: read it again.
		if attempt == 5 {
			return errors.New("installer: CNI config kept changing during install")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retry):
		}
	}
}

// Run installs, then watches the conf dir and the bin dir and repairs our
// binary and entry whenever they go missing or stale, until ctx is done.
// With no primary config it logs once and waits for one to appear. It
// returns nil when ctx is done, or an error if watching cannot start.
func (i *Installer) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("installer: start fsnotify: %w", err)
	}
	defer w.Close()
	watching := i.addWatches(w)

	timer := time.NewTimer(0) // first pass right away
	defer timer.Stop()
	due := time.Now() // when the armed timer fires; zero when idle
	schedule := func(d time.Duration) {
		at := time.Now().Add(d)
		if !due.IsZero() && !at.Before(due) {
			return // an earlier pass is already armed and will see this
		}
		// Go 1.23+ timers: Reset needs no drain and drops a stale fire.
		timer.Reset(d)
		due = at
	}
	resync := time.NewTicker(i.cfg.ResyncInterval)
	defer resync.Stop()
	backoff := time.Duration(0)

	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("installer: fsnotify watcher closed")
			}
			if ev.Name == i.cfg.ConfDir || ev.Name == i.cfg.BinDir {
				// The directory itself went away: its watch is gone with it.
				watching = false
				schedule(i.cfg.Debounce)
				continue
			}
			if i.relevant(ev) {
				schedule(i.cfg.Debounce)
			}
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("installer: fsnotify watcher closed")
			}
			// Usually a queue overflow: events were lost, so look at everything.
			i.log.Warn("fsnotify error; rechecking", "err", err)
			schedule(i.cfg.Debounce)
		case <-resync.C:
			schedule(0)
		case <-timer.C:
			due = time.Time{}
			if !watching {
				watching = i.addWatches(w)
			}
			retry, err := i.pass(false)
			switch {
			case errors.Is(err, errClosed):
				// Shut down: nothing more to guard, but keep Run's contract
				// of returning only when ctx is done.
			case err != nil && !errors.Is(err, ErrNoPrimaryConfig) && !errors.Is(err, ErrConfigInFlux):
				backoff = min(max(2*backoff, 200*time.Millisecond), 10*time.Second)
				schedule(backoff)
			default:
				backoff = 0
			}
			if retry > 0 {
				schedule(retry)
			}
			if !watching {
				schedule(time.Second)
			}
		}
	}
}

// addWatches watches both directories; it reports whether both are watched.
func (i *Installer) addWatches(w *fsnotify.Watcher) bool {
	ok := true
	for _, d := range []string{i.cfg.ConfDir, i.cfg.BinDir} {
		if err := w.Add(d); err != nil {
			i.log.Debug("cannot watch directory yet", "dir", d, "err", err)
			ok = false
		}
	}
	return ok
}

// relevant filters events down to the files we care about.
func (i *Installer) relevant(ev fsnotify.Event) bool {
	dir, base := filepath.Dir(ev.Name), filepath.Base(ev.Name)
	if atomicfile.IsTemp(base) {
		return false
	}
	if dir == i.cfg.BinDir && base == i.cfg.PluginName {
		return true
	}
	// A chmod of a config changes nothing the runtime reads.
	return dir == i.cfg.ConfDir && isConfigName(base) && !ev.Has(fsnotify.Chmod)
}

// pass brings binary and config to the desired state. force skips the
// rewrite limit. retry > 0 asks to be called again after that long.
func (i *Installer) pass(force bool) (retry time.Duration, err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.closed {
		return 0, errClosed
	}
	defer func() {
		if err == nil || errors.Is(err, ErrNoPrimaryConfig) || errors.Is(err, ErrConfigInFlux) {
			i.lastErr = ""
			return
		}
		i.errs.Add(1)
		// A lasting problem (say, a config we refuse to edit) is retried
		// with back-off; say so once, not on every retry.
		if msg := err.Error(); msg != i.lastErr {
			i.log.Warn("install pass failed", "err", err)
			i.lastErr = msg
			if errors.Is(err, ErrIstioCNIChained) && i.cfg.OnRefused != nil {
				i.cfg.OnRefused(err)
			}
		} else {
			i.log.Debug("install pass failed again", "err", err)
		}
	}()
	i.loadState()
	if !i.tempsCleant {
		for _, d := range []string{i.cfg.BinDir, i.cfg.ConfDir} {
			if n, err := atomicfile.RemoveStaleTemps(d); err == nil && n > 0 {
				i.log.Info("removed stale temporary files", "dir", d, "count", n)
			}
		}
		i.tempsCleant = true
	}
	if retry, err = i.ensureBinary(force); err != nil || retry > 0 {
		return retry, err
	}
	path, err := i.findPrimary()
	if errors.Is(err, ErrConfigInFlux) {
		i.log.Debug("config being written; looking again shortly", "err", err)
		return settleTime / 4, err
	}
	if errors.Is(err, ErrNoPrimaryConfig) {
		if !i.waiting {
			i.log.Info("waiting for a primary CNI config", "dir", i.cfg.ConfDir, "name", i.cfg.PrimaryConfName)
			i.waiting = true
		}
		return 0, err
	}
	if err != nil {
		return 0, err
	}
	if i.waiting {
		i.log.Info("primary CNI config found", "file", path)
		i.waiting = false
	}
	return i.ensureChained(path, force)
}

// ensureBinary copies the plugin binary into BinDir unless an identical
// executable copy is already there.
func (i *Installer) ensureBinary(force bool) (time.Duration, error) {
	checked := time.Now() // before the stat: see trustedStamp
	fi, err := os.Stat(i.dst)
	if err == nil && i.binStamp.ok && stampOf(fi) == i.binStamp {
		return 0, nil
	}
	if err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
		same, err := sameContent(i.cfg.PluginBinary, i.dst)
		if err != nil {
			return 0, fmt.Errorf("compare plugin binary: %w", err)
		}
		if same {
			// fi was taken before the content was read, so it describes
			// what was compared or something older: a later change
			// shows as a different stamp.
			i.binStamp = trustedStamp(fi, checked)
			return 0, nil
		}
	}
	if !force {
		if wait := i.limiter.take(time.Now()); wait > 0 {
			i.throttled.Add(1)
			return wait, nil
		}
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return 0, fmt.Errorf("create CNI bin dir: %w", err)
	}
	if err := atomicfile.CopyFile(i.cfg.PluginBinary, i.dst, atomicfile.Options{Mode: 0o755}); err != nil {
		return 0, fmt.Errorf("install plugin binary: %w", err)
	}
	if i.testHookBinaryCopied != nil {
		i.testHookBinaryCopied()
	}
	// No stamp for the copy: a stat now would describe whatever is at the
	// path by then, and a writer may already have overwritten or replaced
	// our copy; stamping that would hide it from every later pass. The
	// pass our own rename triggers compares the content and stamps it.
	i.binStamp = stamp{}
	i.binaryCopies.Add(1)
	if i.installed {
		i.countReinstall()
	}
	i.log.Info("installed plugin binary", "path", i.dst, "reinstall", i.installed)
	return 0, nil
}

// findPrimary returns the config file the runtime uses: the configured
// name, or the lexically first file that loads. After we converted a
// configured .conf, its .conflist stands in for it.
func (i *Installer) findPrimary() (string, error) {
	dir := i.cfg.ConfDir
	if name := i.cfg.PrimaryConfName; name != "" {
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		if ext := filepath.Ext(name); ext != ConflistExt {
			alt := filepath.Join(dir, strings.TrimSuffix(name, ext)+ConflistExt)
			if b, _, err := readLimited(alt); err == nil && i.hasOurEntry(b) {
				return alt, nil
			}
		}
		return "", fmt.Errorf("%w: %s", ErrNoPrimaryConfig, p)
	}
	ents, err := os.ReadDir(dir) // sorted by name, as libcni sorts
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("%w: %s does not exist", ErrNoPrimaryConfig, dir)
		}
		return "", fmt.Errorf("read CNI conf dir: %w", err)
	}
	for _, e := range ents {
		if e.IsDir() || !isConfigName(e.Name()) {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if err := loadable(p); err != nil {
			if fi, serr := os.Stat(p); serr == nil && time.Since(fi.ModTime()) < settleTime {
				return "", fmt.Errorf("%w: %s: %v", ErrConfigInFlux, p, err)
			}
			i.log.Debug("skipping CNI config the runtime would not load", "file", p, "err", err)
			continue
		}
		return p, nil
	}
	return "", fmt.Errorf("%w in %s", ErrNoPrimaryConfig, dir)
}

// loadable reports whether the runtime (libcni) would load the file.
func loadable(path string) error {
	b, _, err := readLimited(path)
	if err != nil {
		return err
	}
	if filepath.Ext(path) != ConflistExt {
		_, err := libcni.NetworkPluginConfFromBytes(b)
		return err
	}
	list, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		return err
	}
	n := len(list.Plugins)
	if !list.LoadOnlyInlinedPlugins {
		more, err := libcni.NetworkPluginConfsFromFiles(filepath.Dir(path), list.Name)
		if err != nil {
			return err
		}
		n += len(more)
	}
	if n == 0 {
		return errors.New("no plugin configs")
	}
	return nil
}

// sortsBetween names a config the runtime would load whose name sorts
// after from and before to: converting from into to would hand the node's
// network to it, since the runtime uses the lexically first config. With
// a configured primary name the order is not ours to keep ("" always).
func (i *Installer) sortsBetween(from, to string) (string, error) {
	if i.cfg.PrimaryConfName != "" {
		return "", nil
	}
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil {
		return "", fmt.Errorf("read CNI conf dir: %w", err)
	}
	for _, e := range ents {
		n := e.Name()
		if e.IsDir() || !isConfigName(n) || n <= from || n >= to {
			continue
		}
		if loadable(filepath.Join(i.cfg.ConfDir, n)) == nil {
			return n, nil
		}
	}
	return "", nil
}

func (i *Installer) hasOurEntry(conflist []byte) bool {
	info, err := inspectList(conflist, i.cfg.PluginName)
	return err == nil && info.nOurs > 0
}

// ensureChained rewrites the primary config so it ends with our entry.
func (i *Installer) ensureChained(path string, force bool) (time.Duration, error) {
	cur, fi, err := readLimited(path)
	if err != nil {
		return 0, fmt.Errorf("read primary config: %w", err)
	}
	name := filepath.Base(path)
	out, newName, err := ChainInto(cur, name, i.entry, i.cfg.PluginName)
	if err != nil {
		return 0, fmt.Errorf("chain into %s: %w", path, err)
	}
	if newName == name && bytes.Equal(out, cur) {
		i.markInstalled(path)
		return 0, nil
	}
	if !force {
		if wait := i.limiter.take(time.Now()); wait > 0 {
			i.throttled.Add(1)
			return wait, nil
		}
	}

	target := path
	converting := newName != name
	if converting {
		target = filepath.Join(filepath.Dir(path), newName)
		if b, _, err := readLimited(target); err == nil && !i.hasOurEntry(b) {
			return 0, fmt.Errorf("converting %s would overwrite %s, which is not ours; refusing", path, target)
		} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return 0, fmt.Errorf("check conversion target: %w", err)
		}
		if between, err := i.sortsBetween(name, newName); err != nil {
			return 0, err
		} else if between != "" {
			return 0, fmt.Errorf("converting %s to %s would make %s, which sorts between the two, the config the runtime uses; refusing (rename one of them, or name the primary config)",
				path, target, filepath.Join(filepath.Dir(path), between))
		}
	} else if lfi, err := os.Lstat(path); err == nil && lfi.Mode()&fs.ModeSymlink != 0 {
		// Keep the primary's symlink; edit the file it points at.
		if target, err = filepath.EvalSymlinks(path); err != nil {
			return 0, fmt.Errorf("resolve %s: %w", path, err)
		}
	}
	// Vetoes the rename if the primary wrote again since we read: its
	// newer content wins and the next pass chains into that.
	guard := func() error {
		now, _, err := readLimited(path)
		if err != nil || !bytes.Equal(now, cur) {
			return atomicfile.ErrChanged
		}
		return nil
	}
	own := atomicfile.OwnerOf(fi)
	if err := atomicfile.WriteFile(target, out, atomicfile.Options{Mode: fi.Mode(), Owner: own, Guard: guard}); err != nil {
		if errors.Is(err, atomicfile.ErrChanged) {
			return i.cfg.Debounce, nil
		}
		return 0, fmt.Errorf("write %s: %w", target, err)
	}
	if converting {
		// Only now that the list is in place may the single config go.
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return 0, fmt.Errorf("remove converted %s: %w", path, err)
		}
	}

	if old := i.records[target]; old != nil && i.installed && !i.hasOurEntry(cur) {
		i.noteRemoval(target, time.Now())
	}
	rec := &record{written: out, origPath: path, origMode: fi.Mode().Perm(), origOwner: own}
	if converting || !i.hasOurEntry(cur) {
		rec.orig = cur
	} else if old := i.records[target]; old != nil && old.orig != nil && sameWithoutOurs(cur, old.written, i.cfg.PluginName) {
		// Only our entry was touched; the primary's original still holds.
		rec.orig, rec.origPath, rec.origMode, rec.origOwner = old.orig, old.origPath, old.origMode, old.origOwner
	}
	i.records[target] = rec
	i.saveState()

	i.configWrites.Add(1)
	if i.installed {
		i.countReinstall()
	}
	i.log.Info("chained plugin into primary CNI config", "file", target, "from", path, "reinstall", i.installed)
	i.markInstalled(target)
	return 0, nil
}

// noteRemoval counts one more time our entry was found gone from a config
// we had chained, and says so once when the removals come too often to be
// restarts of the primary.
func (i *Installer) noteRemoval(path string, now time.Time) {
	i.contestMu.Lock()
	defer i.contestMu.Unlock()
	// A removal a whole window after the last one starts afresh, whether
	// or not a Check has ended the episode yet.
	if n := len(i.removals); n > 0 && now.Sub(i.removals[n-1]) >= contestedWindow {
		i.contested = nil
	}
	ongoing := i.contested != nil
	i.removals = append(i.removals, now)
	if len(i.removals) > contestedRemovals {
		i.removals = i.removals[len(i.removals)-contestedRemovals:]
	}
	if len(i.removals) < contestedRemovals || now.Sub(i.removals[0]) > contestedWindow {
		return
	}
	err := fmt.Errorf("%w: %s lost the %q entry %d times within %v; pods that start before it is back skip ambient-cni "+
		"and are captured only once they run. An exclusive primary does this (Cilium with cni.exclusive=true, its default): "+
		"set it to leave other plugins' entries in its config (Cilium: cni.exclusive=false); ambient-cni keeps putting the entry back meanwhile",
		ErrPrimaryContested, path, i.cfg.PluginName, contestedRemovals, now.Sub(i.removals[0]).Round(time.Millisecond))
	if !ongoing {
		i.log.Warn("primary CNI keeps removing our config entry", "file", path, "err", err)
		if i.cfg.OnRefused != nil {
			i.cfg.OnRefused(err)
		}
	}
	i.contested = err
}

// contestedNow is the contest error while the last removal is less than a
// window old, and ends the episode once it is not.
func (i *Installer) contestedNow(now time.Time) error {
	i.contestMu.Lock()
	defer i.contestMu.Unlock()
	if i.contested == nil {
		return nil
	}
	if n := len(i.removals); n > 0 && now.Sub(i.removals[n-1]) < contestedWindow {
		return i.contested
	}
	i.log.Info("primary CNI has left our config entry alone for a while", "window", contestedWindow)
	i.contested = nil
	return nil
}

func (i *Installer) countReinstall() {
	i.reinstalls.Add(1)
	if i.cfg.OnReinstall != nil {
		i.cfg.OnReinstall()
	}
}

func (i *Installer) markInstalled(path string) {
	if !i.installed {
		i.installed = true
		i.log.Info("plugin installed", "binary", i.dst, "config", path)
	}
}

// sameWithoutOurs reports whether two lists are equal once our entries
// are taken out of both.
func sameWithoutOurs(a, b []byte, pluginType string) bool {
	ua, err1 := Unchain(a, pluginType)
	ub, err2 := Unchain(b, pluginType)
	return err1 == nil && err2 == nil && bytes.Equal(ua, ub)
}

// Ready reports whether the plugin is usable right now: see Check.
func (i *Installer) Ready() bool { return i.Check() == nil }

// Check looks at the disk now and says why the plugin is not installed:
// the binary must be in BinDir, executable and the size of ours, and the
// primary config must end with our entry. A primary that keeps removing
// the entry (ErrPrimaryContested) fails it too, until it has left the
// entry alone for a minute: chained one moment, it is not the next. nil
// means ready.
func (i *Installer) Check() error {
	src, err := os.Stat(i.cfg.PluginBinary)
	if err != nil {
		return fmt.Errorf("plugin binary source: %w", err)
	}
	fi, err := os.Stat(i.dst)
	if err != nil {
		return fmt.Errorf("plugin binary not installed: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 || fi.Size() != src.Size() {
		return fmt.Errorf("plugin binary %s is not our executable", i.dst)
	}
	path, err := i.findPrimary()
	if err != nil {
		return err
	}
	if filepath.Ext(path) != ConflistExt {
		return fmt.Errorf("primary config %s is a single-plugin config, not chained yet", path)
	}
	b, _, err := readLimited(path)
	if err != nil {
		return err
	}
	info, err := inspectList(b, i.cfg.PluginName)
	if err != nil {
		return fmt.Errorf("primary config %s: %w", path, err)
	}
	if info.nIstio > 0 {
		return fmt.Errorf("primary config %s: %w", path, istioCNIError())
	}
	if info.nOurs != 1 || !info.ours[len(info.ours)-1] {
		return fmt.Errorf("primary config %s does not end with exactly one %q entry", path, i.cfg.PluginName)
	}
	if len(info.ours) == 1 {
		return fmt.Errorf("primary config %s: %w", path, ErrNoPrimaryPlugin)
	}
	return i.contestedNow(time.Now())
}

// UpgradeChecker tells whether a shutdown is part of an upgrade: the
// agent's DaemonSet still exists and is not being deleted. Implemented
// outside this package (with client-go).
type UpgradeChecker interface {
	IsUpgrade(ctx context.Context) (bool, error)
}

// IsUpgrade asks c and errs on the side of an upgrade: when c is nil or
// fails, the plugin stays in place (new pods then wait for the next agent
// instead of starting uncaptured) and the reason is logged.
func IsUpgrade(ctx context.Context, c UpgradeChecker, log *slog.Logger) bool {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if c == nil {
		log.Warn("no upgrade checker; leaving the plugin installed")
		return true
	}
	up, err := c.IsUpgrade(ctx)
	if err != nil {
		log.Warn("cannot tell whether this is an upgrade; leaving the plugin installed", "err", err)
		return true
	}
	return up
}

// ShutdownChecked is Shutdown with the upgrade decision made by IsUpgrade.
func (i *Installer) ShutdownChecked(ctx context.Context, c UpgradeChecker) error {
	return i.Shutdown(ctx, IsUpgrade(ctx, c, i.log))
}

// Shutdown stops all further repairs. During an upgrade it leaves the
// binary and our entry in place. Otherwise it removes our entry from every
// config in ConfDir (putting back the primary's exact bytes, or the
// original .conf we converted, when the file is still as we wrote it; else
// cutting out only our entry) and then removes the binary, in that order
// so no config ever names a missing plugin.
func (i *Installer) Shutdown(ctx context.Context, upgrade bool) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.closed = true
	i.loadState()
	if upgrade {
		i.log.Info("upgrade: leaving plugin binary and config entry in place")
		return nil
	}
	var errs []error
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("read CNI conf dir: %w", err))
	}
	for _, e := range ents {
		if err := ctx.Err(); err != nil {
			return errors.Join(append(errs, err)...)
		}
		if e.IsDir() || filepath.Ext(e.Name()) != ConflistExt {
			continue
		}
		p := filepath.Join(i.cfg.ConfDir, e.Name())
		err := i.unchainFile(p)
		// Racing a primary that is writing the same file: try again.
		for try := 0; errors.Is(err, atomicfile.ErrChanged) && try < 3; try++ {
			time.Sleep(i.cfg.Debounce)
			err = i.unchainFile(p)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(i.dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove plugin binary: %w", err))
	} else {
		i.log.Info("removed plugin binary", "path", i.dst)
	}
	for _, d := range []string{i.cfg.BinDir, i.cfg.ConfDir} {
		_, _ = atomicfile.RemoveStaleTemps(d)
	}
	if len(errs) == 0 {
		i.dropState()
	}
	return errors.Join(errs...)
}

// unchainFile takes our entry out of one conflist, if it holds one.
func (i *Installer) unchainFile(path string) error {
	target := path
	if t, err := filepath.EvalSymlinks(path); err == nil {
		target = t
	}
	cur, fi, err := readLimited(path)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	if !i.hasOurEntry(cur) {
		return nil
	}
	guard := func() error {
		now, _, err := readLimited(path)
		if err != nil || !bytes.Equal(now, cur) {
			return fmt.Errorf("%s: %w", path, atomicfile.ErrChanged)
		}
		return nil
	}
	rec := i.records[target]
	if rec == nil {
		rec = i.records[path]
	}
	if rec != nil && rec.orig != nil && bytes.Equal(cur, rec.written) {
		if rec.origPath == path || rec.origPath == target {
			if err := atomicfile.WriteFile(target, rec.orig, atomicfile.Options{Mode: fi.Mode(), Owner: atomicfile.OwnerOf(fi), Guard: guard}); err != nil {
				return fmt.Errorf("restore %s: %w", path, err)
			}
			i.log.Info("restored primary CNI config", "file", path)
			return nil
		}
		// We converted origPath into this list. Put the .conf back unless
		// the primary has written a new one meanwhile; then drop the list.
		if _, err := os.Lstat(rec.origPath); errors.Is(err, fs.ErrNotExist) {
			if err := atomicfile.WriteFile(rec.origPath, rec.orig, atomicfile.Options{Mode: rec.origMode, Owner: rec.origOwner}); err != nil {
				return fmt.Errorf("restore %s: %w", rec.origPath, err)
			}
		}
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("remove converted list %s: %w", path, err)
		}
		i.log.Info("restored primary CNI config", "file", rec.origPath, "removed", path)
		return nil
	}
	// The primary rewrote the file since (or we never saw its original):
	// cut out our entry and keep every other byte it wrote.
	out, err := Unchain(cur, i.cfg.PluginName)
	if err != nil {
		return fmt.Errorf("remove our entry from %s: %w", path, err)
	}
	if err := atomicfile.WriteFile(target, out, atomicfile.Options{Mode: fi.Mode(), Owner: atomicfile.OwnerOf(fi), Guard: guard}); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	i.log.Info("removed our entry from CNI config", "file", path)
	return nil
}
