package installer

import (
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Ready reports whether the plugin is usable right now: see Check.
func (i *Installer) Ready() bool { return i.Check() == nil }

// Check looks at the disk now and says why the plugin is not installed:
// the binary must be in BinDir and every extra bin dir, executable and
// identical to ours (by content, or by the stamp of the version last
// proven so: a stat per copy), and the primary config must end with our
// entry (with Config.Sibling, where it can work, our file must be in the
// primary network's folder instead; with Config.Owned, the owned conflist must be the runtime's
// choice and hold exactly the primary's list with our entry last). A primary that keeps removing
// the entry (ErrPrimaryContested) fails it too, until it has left the
// entry alone for a minute: chained one moment, it is not the next. nil
// means ready.
func (i *Installer) Check() error {
	if _, err := os.Stat(i.cfg.PluginBinary); err != nil {
		return fmt.Errorf("plugin binary source: %w", err)
	}
	for _, dst := range i.bins {
		if _, err := os.Stat(dst); err != nil {
			return fmt.Errorf("plugin binary not installed: %w", err)
		}
		ours, err := i.copies.isOurs(i.cfg.PluginBinary, dst)
		if err != nil {
			return fmt.Errorf("plugin binary %s: %w", dst, err)
		}
		if !ours {
			return fmt.Errorf("plugin binary %s is not our executable", dst)
		}
	}
	path, err := i.findPrimary()
	if err != nil {
		return err
	}
	own, _, err := i.canOwn(path)
	if err != nil {
		return err
	}
	if own {
		return i.checkOwned(path)
	}
	if i.isOwnedFile(i.ownedPath()) {
		return fmt.Errorf("owned config %s is still there while chaining into %s", i.ownedPath(), path)
	}
	if dir, _, err := i.canSibling(path); err != nil {
		return err
	} else if dir != "" {
		return i.checkSibling(dir)
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
