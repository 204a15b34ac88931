// Package installer puts the ambient-cni plugin on a node for install-cni
// and keeps it there: it copies the plugin binary into the host's CNI bin
// directory (and every extra one, for a runtime that searches several),
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
// context and call Shutdown with the caller's upgrade decision.
//
// The files follow the phases: installer.go the Installer and its pass,
// binary.go the plugin binary's copy, primary.go finding the primary
// config, chainprimary.go chaining into it (chain.go the pure splicing),
// contested.go a primary that keeps removing our entry, watch.go the
// watch-and-repair loop, ready.go readiness, shutdown.go unchaining and
// removal, state.go the records kept across restarts.
package installer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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

// errClosed is returned by passes after Shutdown.
var errClosed = errors.New("installer shut down")

// Config configures an Installer. BinDir, ConfDir and PluginBinary are
// required; every other field has a default.
type Config struct {
	// BinDir is the host CNI bin directory the plugin binary is copied to.
	BinDir string
	// ExtraBinDirs are more directories the plugin binary is copied to and
	// kept in exactly as in BinDir, for a runtime that searches a list of
	// directories (containerd 2.x bin_dirs, CRI-O plugin_dirs) and runs the
	// first binary of the name it finds: a copy in each directory of the
	// list means whichever it finds is ours, never a stale one left by an
	// older version. Each must be absolute and listed once, BinDir included.
	ExtraBinDirs []string
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
	// Owned makes the installer write a conflist of its own, named
	// OwnedConfName, holding the primary's plugins and our entry last,
	// instead of chaining into the primary's file: named to sort first,
	// it is what the runtime loads, and a primary that rewrites its own
	// file (at every start of its agent, before ours is back after a
	// reboot) cannot drop our entry. It is kept in step with every write
	// of the primary's file, removed when the primary's file goes, and
	// removed at uninstall. When OwnedConfName does not sort before the
	// primary's file (or a configured primary is not the runtime's
	// choice) the installer chains into the primary instead.
	Owned bool
	// Sibling puts our entry in the primary network's folder
	// (<ConfDir>/<network name>/, "zz-<PluginName>.conf") instead of the
	// primary's file: libcni 1.3 and later (containerd 2.1, CRI-O 1.33)
	// runs it after the list's own plugins, and a primary that rewrites
	// its file cannot drop it. Set it only for such a runtime: an older
	// one never runs the plugin from there. A primary that cannot carry
	// it there (a single-plugin .conf, loadOnlyInlinedPlugins, a network
	// name that is no folder name, istio-cni chained in its file) is
	// chained into as without it. Owned wins over it.
	Sibling bool
	// OwnedConfName is the owned conflist's name (a plain .conflist name;
	// default DefaultOwnedConfName). Set it with Owned off too: a file of
	// that name holding our entry is then removed, as left by an owned
	// install before.
	OwnedConfName string
	// OwnedGrace is how long the owned conflist outlives the primary's
	// file: a primary that deletes its config while its agent restarts
	// (Cilium on agent shutdown) writes it again within it, and the
	// runtime never runs a list without our entry meanwhile. Past it the
	// node has no network, as the primary meant. Default
	// DefaultOwnedGrace.
	OwnedGrace time.Duration
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
	// IstioCNIGone, when set, lets a pass that finds istio-cni chained
	// replace its entry with ours in one write instead of refusing
	// (ErrIstioCNIChained), once it returns nil for the run directory of
	// each istio-cni entry (cni_agent_run_dir): it must say that
	// istio-cni's node agent has left the node for good, so that nothing
	// chains istio-cni next to us again (IstioCNIAgentGone). Its error
	// says why not yet, in the refusal.
	IstioCNIGone func(entryRunDir string) error
	// OnReinstall, when set, is called once per reinstall (see
	// Stats.Reinstalls), e.g. a prometheus Counter's Inc. It runs with the
	// Installer's lock held: it must be quick and must not call back.
	OnReinstall func()
	// OnOutcome, when set, is called with what a pass came to when it
	// failed to copy the binary or to chain the config, and once each time
	// the plugin became installed (the first complete pass, and every pass
	// that repaired the binary or the entry): what istio-cni counts as
	// istio_cni_installs_total. It runs with the Installer's lock held: it
	// must be quick and must not call back.
	OnOutcome func(Outcome)
	// Logger receives structured logs; nil discards them.
	Logger *slog.Logger
}

// Outcome is what an install pass came to (Config.OnOutcome).
type Outcome string

const (
	// OutcomeInstalled: the binary is in place and the config chained,
	// after a pass that wrote either, or the first pass.
	OutcomeInstalled Outcome = "installed"
	// OutcomeCopyFailed: the plugin binary could not be copied.
	OutcomeCopyFailed Outcome = "copy-failed"
	// OutcomeConfigFailed: the primary config could not be found, read or
	// chained (istio-cni chained in it included).
	OutcomeConfigFailed Outcome = "config-failed"
)

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
	// bins are the installed binary's paths, one per bin dir: BinDir's
	// first, then ExtraBinDirs' in their order.
	bins []string
	// copies remembers which copies were last proven identical to ours.
	copies copyStamps

	mu          sync.Mutex // serializes passes and Shutdown
	closed      bool
	limiter     rewriteLimit
	records     map[string]*record
	installed   bool // first complete install done
	waiting     bool // "waiting for primary config" already logged
	tempsCleant bool
	stateLoaded bool
	lastErr     string // last pass error logged at Warn
	// ownRefused is why owning was last found impossible (logged once).
	ownRefused string
	// siblingRefused is why sibling chaining was last found impossible
	// (logged once).
	siblingRefused string
	// converted is what publishConverted last published.
	converted atomic.Pointer[map[string]bool]
	// primaryGone is when a pass first found no primary config while the
	// owned conflist was there; zero otherwise.
	primaryGone time.Time
	// reported is set once OutcomeInstalled was reported, with the count
	// of writes it was reported for: a later pass reports again only
	// after writing.
	reported       bool
	reportedWrites uint64
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

// New checks cfg and returns an Installer. It touches nothing on disk
// except to check that the plugin binary exists.
func New(cfg Config) (*Installer, error) {
	if cfg.BinDir == "" || cfg.ConfDir == "" || cfg.PluginBinary == "" {
		return nil, errors.New("installer: BinDir, ConfDir and PluginBinary are required")
	}
	cfg.BinDir, cfg.ConfDir = filepath.Clean(cfg.BinDir), filepath.Clean(cfg.ConfDir)
	binDirs, err := checkBinDirs(cfg.BinDir, cfg.ExtraBinDirs)
	if err != nil {
		return nil, err
	}
	cfg.ExtraBinDirs = binDirs[1:]
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
	if cfg.OwnedGrace <= 0 {
		cfg.OwnedGrace = DefaultOwnedGrace
	}
	if cfg.Owned && cfg.OwnedConfName == "" {
		cfg.OwnedConfName = DefaultOwnedConfName
	}
	if n := cfg.OwnedConfName; n != "" {
		if !plainName(n) || filepath.Ext(n) != ConflistExt {
			return nil, fmt.Errorf("installer: owned config name %q must be a plain .conflist file name", n)
		}
		if n == cfg.PrimaryConfName {
			return nil, fmt.Errorf("installer: owned config name %q names the primary config", n)
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
	bins := make([]string, len(binDirs))
	for n, d := range binDirs {
		bins[n] = filepath.Join(d, cfg.PluginName)
	}
	return &Installer{
		cfg:     cfg,
		log:     log.With("component", "installer"),
		entry:   entry,
		bins:    bins,
		copies:  copyStamps{m: map[string]stamp{}},
		limiter: newRewriteLimit(cfg.MaxRewritesPerSecond, cfg.RewriteBurst),
		records: map[string]*record{},
	}, nil
}

// checkBinDirs returns BinDir and the extra bin dirs, cleaned, refusing an
// empty or relative extra dir and any dir listed twice: a duplicate would
// be copied to and removed twice, and says the list is not what its
// writer meant.
func checkBinDirs(binDir string, extra []string) ([]string, error) {
	dirs := []string{binDir}
	for _, d := range extra {
		if d == "" {
			return nil, errors.New("installer: an extra bin dir is empty")
		}
		if !filepath.IsAbs(d) {
			return nil, fmt.Errorf("installer: extra bin dir %q is not an absolute path", d)
		}
		d = filepath.Clean(d)
		if slices.Contains(dirs, d) {
			return nil, fmt.Errorf("installer: bin dir %s is listed twice", d)
		}
		dirs = append(dirs, d)
	}
	return dirs, nil
}

// binDirs are BinDir and ExtraBinDirs.
func (i *Installer) binDirs() []string {
	return append([]string{i.cfg.BinDir}, i.cfg.ExtraBinDirs...)
}

func plainName(s string) bool {
	return s != "." && s != ".." && !strings.ContainsRune(s, '/') && s != ""
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

// pass brings binary and config to the desired state. force skips the
// rewrite limit. retry > 0 asks to be called again after that long.
func (i *Installer) pass(force bool) (retry time.Duration, err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.closed {
		return 0, errClosed
	}
	defer i.publishConverted()
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
		for _, d := range append(i.binDirs(), i.cfg.ConfDir) {
			if n, err := atomicfile.RemoveStaleTemps(d); err == nil && n > 0 {
				i.log.Info("removed stale temporary files", "dir", d, "count", n)
			}
		}
		i.tempsCleant = true
	}
	if retry, err = i.ensureBinary(force); err != nil || retry > 0 {
		if err != nil {
			i.outcome(OutcomeCopyFailed)
		}
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
		return i.primaryMissing(time.Now()), err
	}
	i.primaryGone = time.Time{}
	if err != nil {
		i.outcome(OutcomeConfigFailed)
		return 0, err
	}
	if i.waiting {
		i.log.Info("primary CNI config found", "file", path)
		i.waiting = false
	}
	retry, err = i.ensureConfig(path, force)
	if err == nil && retry == 0 {
		// Our entry is in place for the primary: istio-cni's copy of it,
		// which the runtime loaded until now, may go.
		err = i.removeIstioCopies(path)
	}
	switch writes := i.configWrites.Load() + i.binaryCopies.Load(); {
	case err != nil:
		i.outcome(OutcomeConfigFailed)
	case retry == 0 && i.installed && (!i.reported || writes != i.reportedWrites):
		i.reported, i.reportedWrites = true, writes
		i.outcome(OutcomeInstalled)
	}
	return retry, err
}

// ensureConfig puts our entry where the runtime will run it: in the owned
// conflist when owning is on and can work, else in the primary network's
// folder when sibling chaining is on and can work, else chained into the
// primary (and any owned conflist of ours removed, since the runtime would
// either not load it or load it in place of the primary's current config;
// and our entry in a folder, once the primary's list holds it).
func (i *Installer) ensureConfig(path string, force bool) (time.Duration, error) {
	own, why, err := i.canOwn(path)
	if err != nil {
		return 0, err
	}
	if own {
		i.ownRefused = ""
		return i.ensureOwned(path, force)
	}
	if why != "" && why != i.ownRefused {
		i.log.Warn("not writing an owned CNI config; chaining into the primary's instead", "reason", why)
		i.ownRefused = why
	}
	if err := i.removeOwned("chaining into the primary's config instead"); err != nil {
		return 0, err
	}
	dir, why, err := i.canSibling(path)
	if err != nil {
		return 0, err
	}
	if dir != "" {
		i.siblingRefused = ""
		return i.ensureSibling(path, dir, force)
	}
	if why != "" && why != i.siblingRefused {
		i.log.Warn("not chaining in the primary network's folder; chaining into the primary's config instead", "reason", why)
		i.siblingRefused = why
	}
	retry, err := i.ensureChained(path, force)
	if err != nil || retry > 0 {
		return retry, err
	}
	// Only now that our entry is in the primary's list: the folder's may go.
	return 0, i.removeSiblings("chained into the primary's config instead")
}

// outcome reports what a pass came to (Config.OnOutcome).
func (i *Installer) outcome(o Outcome) {
	if i.cfg.OnOutcome != nil {
		i.cfg.OnOutcome(o)
	}
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
		i.log.Info("plugin installed", "binaries", i.bins, "config", path)
	}
}
