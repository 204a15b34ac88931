package installer

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

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
	base, takeover, err := i.takeOver(cur, name)
	if err != nil {
		return 0, fmt.Errorf("chain into %s: %w", path, err)
	}
	out, newName, err := ChainInto(base, name, i.entry, i.cfg.PluginName)
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
		if newName == i.cfg.OwnedConfName {
			return 0, fmt.Errorf("converting %s would make %s, the owned config's name; refusing (name another: ownedConfName)", path, target)
		}
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
		// After a takeover the primary's original is the file without
		// istio-cni: an uninstall must not chain back a plugin whose
		// agent is gone.
		rec.orig = base
	} else if old := i.records[target]; old != nil && old.orig != nil && sameWithoutOurs(cur, old.written, i.cfg.PluginName) {
		// Only our entry was touched; the primary's original still holds.
		rec.orig, rec.origPath, rec.origMode, rec.origOwner = old.orig, old.origPath, old.origMode, old.origOwner
	}
	i.records[target] = rec
	i.saveState()

	i.noteWritten(target, takeover, "its entry replaced by ours in one write",
		"chained plugin into primary CNI config", "file", target, "from", path)
	return 0, nil
}

// noteWritten does what follows every write of a config of ours (chained
// into the primary's or owned): the write and reinstall counters, the log
// lines (the istio-cni takeover's, how it was done, first) and the
// installed mark.
func (i *Installer) noteWritten(target string, takeover bool, tookHow, msg string, attrs ...any) {
	i.configWrites.Add(1)
	if i.installed {
		i.countReinstall()
	}
	if takeover {
		i.log.Info("took over from istio-cni: "+tookHow, "file", target)
	}
	i.log.Info(msg, append(attrs, "reinstall", i.installed)...)
	i.markInstalled(target)
}

// sameWithoutOurs reports whether two lists are equal once our entries
// are taken out of both.
func sameWithoutOurs(a, b []byte, pluginType string) bool {
	ua, err1 := Unchain(a, pluginType)
	ub, err2 := Unchain(b, pluginType)
	return err1 == nil && err2 == nil && bytes.Equal(ua, ub)
}
