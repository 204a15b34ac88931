package installer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// Shutdown stops all further repairs. During an upgrade it leaves the
// binary (in every bin dir), the owned conflist and our entry in place.
// Otherwise it removes the owned conflist and our file from every network
// folder (sibling chaining), then our entry from every config in ConfDir (putting back the primary's exact
// bytes, or the original .conf we converted, when the file is still as we
// wrote it; else cutting out only our entry) and then removes the binary
// from every bin dir, in that order
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
	return i.removeLocked(ctx)
}

// Withdraw takes the plugin off the node as Shutdown does for an
// uninstall, and reports whether anything of it was there. Unlike
// Shutdown it leaves the installer usable: an agent standing by behind
// istio-cni withdraws the entry a give-back (or a broken agent) left
// chained, and installs again if the node is switched back to it.
func (i *Installer) Withdraw(ctx context.Context) (bool, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.loadState()
	if !i.anyOursLocked() {
		return false, nil
	}
	return true, i.removeLocked(ctx)
}

// anyOursLocked reports whether the conf dir holds any entry or file of
// ours (the owned conflist, a network folder's file, an entry in a
// conflist) or a bin dir our binary.
func (i *Installer) anyOursLocked() bool {
	if i.isOwnedFile(i.ownedPath()) {
		return true
	}
	ents, _ := os.ReadDir(i.cfg.ConfDir)
	for _, e := range ents {
		p := filepath.Join(i.cfg.ConfDir, e.Name())
		if e.IsDir() {
			if _, ours := i.ourSiblingIn(p); ours {
				return true
			}
			continue
		}
		if filepath.Ext(e.Name()) != ConflistExt {
			continue
		}
		if b, _, err := readLimited(p); err == nil && i.hasOurEntry(b) {
			return true
		}
	}
	for _, dst := range i.bins {
		if _, err := os.Lstat(dst); err == nil {
			return true
		}
	}
	return false
}

// removeLocked is the removal of Shutdown and Withdraw, in their order.
func (i *Installer) removeLocked(ctx context.Context) error {
	var errs []error
	// The owned conflist first: it is a whole copy of ours, to remove,
	// not a primary's file to take our entry out of.
	if err := i.removeOwned("uninstall"); err != nil {
		errs = append(errs, err)
	}
	if err := i.removeSiblings("uninstall"); err != nil {
		errs = append(errs, err)
	}
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
		if p == i.ownedPath() && i.isOwnedFile(p) {
			continue // could not be removed: said above
		}
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
	for _, dst := range i.bins {
		if err := os.Remove(dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove plugin binary: %w", err))
		} else {
			i.log.Info("removed plugin binary", "path", dst)
		}
	}
	for _, d := range append(i.binDirs(), i.cfg.ConfDir) {
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
