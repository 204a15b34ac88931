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

// An owned conflist is a file of our own in the conf dir, named to sort
// before the primary's, holding the primary's list with our entry last.
// The runtime loads the lexically first config, so it runs ours; a
// primary that rewrites its own file (as its agent does at every start,
// before ours is back after a reboot) cannot drop our entry. The price:
// the runtime runs our copy of the primary's plugins, so the copy must
// follow every write of the primary's file, and a copy left behind while
// no agent of ours runs keeps the primary's previous config in force.
// docs/reliability.md ("The reboot race") weighs the two.

// DefaultOwnedConfName is the owned conflist's default name: after
// Multus's 00-multus.conf (Multus stays the runtime's choice) and before
// every primary's usual name (05-cilium, 10-calico, 10-flannel, ...).
const DefaultOwnedConfName = "02-ambient-cni.conflist"

// ownedConfMode is the owned conflist's mode whatever the primary's: the
// file is ours and only the runtime, as root, reads it (the CIS Kubernetes
// benchmark asks 0600 of CNI files; istio-cni writes its own conflist so).
const ownedConfMode = 0o600

// DefaultOwnedGrace is Config.OwnedGrace's default: longer than a
// primary's agent takes to restart and write its config again.
const DefaultOwnedGrace = 2 * time.Minute

// primaryMissing handles a pass that found no primary config: the owned
// conflist stays for OwnedGrace (a primary restarting writes its config
// again meanwhile, and the runtime keeps running our entry), then goes
// (the primary took its network away; our copy must not keep it). It
// returns when to look again.
func (i *Installer) primaryMissing(now time.Time) time.Duration {
	if !i.isOwnedFile(i.ownedPath()) {
		i.primaryGone = time.Time{}
		return 0
	}
	if i.primaryGone.IsZero() {
		i.primaryGone = now
		i.log.Info("the primary CNI config is gone; keeping the owned config for a while", "grace", i.cfg.OwnedGrace)
	}
	if left := i.cfg.OwnedGrace - now.Sub(i.primaryGone); left > 0 {
		return left
	}
	if err := i.removeOwned("the primary CNI config is gone for " + i.cfg.OwnedGrace.String()); err != nil {
		i.log.Warn("cannot remove the owned config", "err", err)
		return time.Second
	}
	i.primaryGone = time.Time{}
	return 0
}

// ownedPath is the owned conflist's path, "" when none is configured.
func (i *Installer) ownedPath() string {
	if i.cfg.OwnedConfName == "" {
		return ""
	}
	return filepath.Join(i.cfg.ConfDir, i.cfg.OwnedConfName)
}

// isOwnedFile reports whether path is the owned conflist and holds our
// entry: only then is it ours to skip, rewrite or remove. A file of that
// name without our entry is someone else's and is treated as any config.
func (i *Installer) isOwnedFile(path string) bool {
	if path == "" || path != i.ownedPath() {
		return false
	}
	b, _, err := readLimited(path)
	return err == nil && i.hasOurEntry(b)
}

// canOwn says whether an owned conflist would be the runtime's choice in
// place of primary: only when primary is itself the runtime's choice (the
// first file that loads, ours aside) and the owned name sorts before it.
// Owning never changes which network the runtime uses, only adds our
// plugin to it. The reason is "" when it can.
func (i *Installer) canOwn(primary string) (bool, string, error) {
	if !i.cfg.Owned {
		return false, "", nil
	}
	name := filepath.Base(primary)
	if i.cfg.PrimaryConfName != "" {
		first, err := i.firstLoadable()
		if err != nil {
			return false, "", err
		}
		if first != primary {
			return false, fmt.Sprintf("the configured primary %s is not the runtime's choice (%s is): a file of ours before both would change the network the runtime uses", name, filepath.Base(first)), nil
		}
	}
	if i.cfg.OwnedConfName >= name {
		return false, fmt.Sprintf("%s does not sort before the primary's %s, so the runtime would not load it (name one that does: ownedConfName)", i.cfg.OwnedConfName, name), nil
	}
	return true, "", nil
}

// firstLoadable is the runtime's choice: the lexically first config that
// loads, the owned conflist aside.
func (i *Installer) firstLoadable() (string, error) {
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil {
		return "", fmt.Errorf("read CNI conf dir: %w", err)
	}
	for _, e := range ents {
		p := filepath.Join(i.cfg.ConfDir, e.Name())
		if e.IsDir() || !isConfigName(e.Name()) || i.isOwnedFile(p) {
			continue
		}
		if loadable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w in %s", ErrNoPrimaryConfig, i.cfg.ConfDir)
}

// ownedContent is what the owned conflist must hold for the primary's
// bytes cur: the primary's list (a single config converted as the
// runtime would) with our entry last, the istio-cni entry gone after a
// takeover.
func (i *Installer) ownedContent(cur []byte, name string) ([]byte, bool, error) {
	base, takeover, err := i.takeOver(cur, name)
	if err != nil {
		return nil, false, err
	}
	out, _, err := ChainInto(base, name, i.entry, i.cfg.PluginName)
	return out, takeover, err
}

// ensureOwned writes the owned conflist from the primary at path, when it
// is not already exactly that. The primary's file is not touched.
func (i *Installer) ensureOwned(path string, force bool) (time.Duration, error) {
	cur, fi, err := readLimited(path)
	if err != nil {
		return 0, fmt.Errorf("read primary config: %w", err)
	}
	out, takeover, err := i.ownedContent(cur, filepath.Base(path))
	if err != nil {
		return 0, fmt.Errorf("owned config from %s: %w", path, err)
	}
	target := i.ownedPath()
	had, _, rerr := readLimited(target)
	switch {
	case rerr == nil && !i.hasOurEntry(had):
		return 0, fmt.Errorf("%s exists and is not ours; refusing to overwrite it (name another: ownedConfName)", target)
	case rerr != nil && !errors.Is(rerr, fs.ErrNotExist):
		return 0, fmt.Errorf("read owned config: %w", rerr)
	case rerr == nil && bytes.Equal(had, out):
		// Right already, but an older version copied the primary's mode.
		if err := tighten(target, ownedConfMode); err != nil {
			return 0, err
		}
		i.markInstalled(target)
		return 0, nil
	}
	if !force {
		if wait := i.limiter.take(time.Now()); wait > 0 {
			i.throttled.Add(1)
			return wait, nil
		}
	}
	// Vetoes the rename if the primary wrote again since we read: the
	// next pass copies its newer content.
	guard := func() error {
		now, _, err := readLimited(path)
		if err != nil || !bytes.Equal(now, cur) {
			return atomicfile.ErrChanged
		}
		return nil
	}
	if err := atomicfile.WriteFile(target, out, atomicfile.Options{Mode: ownedConfMode, Owner: atomicfile.OwnerOf(fi), Guard: guard}); err != nil {
		if errors.Is(err, atomicfile.ErrChanged) {
			return i.cfg.Debounce, nil
		}
		return 0, fmt.Errorf("write %s: %w", target, err)
	}
	if old := i.records[target]; old != nil && i.installed && rerr != nil {
		// Our file was taken away (an exclusive primary renames every
		// other config): the same fight as an entry taken out.
		i.noteRemoval(target, time.Now())
	}
	i.records[target] = &record{written: out, origPath: target}
	i.noteWritten(target, takeover, "owned config written without its entry",
		"wrote owned CNI config from the primary's", "file", target, "primary", path)
	return 0, nil
}

// removeOwned removes the owned conflist if it is there and ours: when
// the primary's config is gone for good (the node has no network, as the
// primary meant), when owning is off, or when the owned name cannot sort
// first.
// Left in place it would run a copy of a config the primary took back.
func (i *Installer) removeOwned(why string) error {
	p := i.ownedPath()
	if !i.isOwnedFile(p) {
		return nil
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove owned config: %w", err)
	}
	delete(i.records, p)
	i.log.Info("removed owned CNI config", "file", p, "why", why)
	return nil
}

// checkOwned says why the owned conflist is not the runtime's choice or
// not in step with the primary at primary; nil when it is both.
func (i *Installer) checkOwned(primary string) error {
	target := i.ownedPath()
	b, _, err := readLimited(target)
	if err != nil {
		return fmt.Errorf("owned config: %w", err)
	}
	if err := loadable(target); err != nil {
		return fmt.Errorf("owned config %s does not load: %w", target, err)
	}
	cur, _, err := readLimited(primary)
	if err != nil {
		return fmt.Errorf("read primary config: %w", err)
	}
	base := cur
	if i.cfg.IstioCNIGone != nil {
		// After a takeover the copy holds no istio-cni entry; whether the
		// takeover may happen is the pass's to decide, not Check's.
		if info, err := inspectList(b, i.cfg.PluginName); err == nil && info.nIstio == 0 && filepath.Ext(primary) == ConflistExt {
			if u, err := Unchain(cur, IstioCNIType); err == nil {
				base = u
			}
		}
	}
	want, _, err := ChainInto(base, filepath.Base(primary), i.entry, i.cfg.PluginName)
	if err != nil {
		return fmt.Errorf("primary config %s: %w", primary, err)
	}
	if !bytes.Equal(b, want) {
		return fmt.Errorf("owned config %s is not in step with the primary's %s yet", target, primary)
	}
	return i.contestedNow(time.Now())
}
