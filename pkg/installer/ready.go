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
