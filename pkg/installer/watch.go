package installer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// Run installs, then watches the conf dir and the bin dirs and repairs our
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
			if ev.Name == i.cfg.ConfDir || slices.Contains(i.binDirs(), ev.Name) {
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
			if i.cfg.Sibling {
				// The folder a pass may just have made: its file's removal
				// is repaired at once, as the primary's file's.
				i.watchSiblingDirs(w)
			}
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

// addWatches watches the conf dir and every bin dir; it reports whether all
// are watched.
func (i *Installer) addWatches(w *fsnotify.Watcher) bool {
	ok := true
	for _, d := range append([]string{i.cfg.ConfDir}, i.binDirs()...) {
		if err := w.Add(d); err != nil {
			i.log.Debug("cannot watch directory yet", "dir", d, "err", err)
			ok = false
		}
	}
	return ok
}

// watchSiblingDirs watches every network folder holding our file (a
// watch added again is the same watch).
func (i *Installer) watchSiblingDirs(w *fsnotify.Watcher) {
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		dir := filepath.Join(i.cfg.ConfDir, e.Name())
		if _, err := os.Lstat(filepath.Join(dir, i.siblingName())); e.IsDir() && err == nil {
			if err := w.Add(dir); err != nil {
				i.log.Debug("cannot watch the network's folder", "dir", dir, "err", err)
			}
		}
	}
}

// relevant filters events down to the files we care about.
func (i *Installer) relevant(ev fsnotify.Event) bool {
	dir, base := filepath.Dir(ev.Name), filepath.Base(ev.Name)
	if atomicfile.IsTemp(base) {
		return false
	}
	if base == i.cfg.PluginName && slices.Contains(i.binDirs(), dir) {
		return true
	}
	if i.cfg.Sibling {
		if base == i.siblingName() && filepath.Dir(dir) == i.cfg.ConfDir {
			return true // our file in a network's folder
		}
		if dir == i.cfg.ConfDir && !ev.Has(fsnotify.Chmod) && !ev.Has(fsnotify.Write) && !strings.HasPrefix(base, ".") {
			return true // a network's folder made, renamed or removed
		}
	}
	// A chmod of a config changes nothing the runtime reads.
	return dir == i.cfg.ConfDir && isConfigName(base) && !ev.Has(fsnotify.Chmod)
}
