package installer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// Sibling chaining. libcni 1.3 (containerd 2.1 and later, CRI-O 1.33 and
// later) runs, after a .conflist's own plugins, every *.conf in the folder
// named for the list's network, <conf dir>/<network name>/, unless the list
// sets loadOnlyInlinedPlugins. Our entry there is in the chain the runtime
// runs without a byte of the primary's file being ours, so a primary that
// rewrites its file (its agent does at every start, after a reboot before
// ours is back) cannot drop it. Neither runtime watches that folder: the
// installer makes the runtime load its config again (reloadRuntime).
//
// Moving between the primary's file and the folder adds the new place
// before it empties the old one: for a moment the runtime may run the
// plugin twice (a repeated ADD, which the agent answers as the first),
// never not at all.

// siblingPrefix sorts our file after the others of the folder: the plugin
// goes last in the chain, as istio-cni's entry does in a list.
const siblingPrefix = "zz-"

// reloadName is the file whose removal makes the runtime reload its CNI
// config: containerd reloads on any write, rename or removal in the conf
// dir (not on a creation), of any file. A temp name, so that no runtime
// loads it and the installer's own watch ignores it.
const reloadName = atomicfile.TempPrefix + "reload" + atomicfile.TempSuffix

// siblingName is our file's name in a network's folder.
func (i *Installer) siblingName() string { return siblingPrefix + i.cfg.PluginName + ".conf" }

// siblingContent is our file in a network's folder: our entry, one line.
func (i *Installer) siblingContent() []byte { return append(bytes.Clone(i.entry), '\n') }

// siblingNetwork reads what sibling chaining needs from a conflist: the
// network's name, which names the folder. why says why the list cannot
// carry our entry in its folder ("" when it can).
func siblingNetwork(conf []byte) (network, why string) {
	// Exact keys, as libcni reads them (a map): a struct would also take
	// "NAME" for "name", and our folder would not be the one it reads.
	var l map[string]json.RawMessage
	if err := json.Unmarshal(conf, &l); err != nil {
		return "", fmt.Sprintf("the primary's list does not parse: %v", err)
	}
	var name string
	if err := json.Unmarshal(l["name"], &name); err != nil || !plainName(name) || strings.HasPrefix(name, ".") || len(name) > 255 {
		return "", "the primary's network name is not a plain folder name"
	}
	inline := l["loadOnlyInlinedPlugins"]
	switch v := strings.ToLower(strings.Trim(string(bytes.TrimSpace(inline)), `"`)); v {
	case "", "false", "null":
	case "true":
		return "", "the primary's list sets loadOnlyInlinedPlugins"
	default:
		return "", fmt.Sprintf("the primary's list sets loadOnlyInlinedPlugins to %s, which libcni refuses", v)
	}
	return name, ""
}

// canSibling says whether our entry goes into the folder of the primary
// at path: the folder's path, or why not ("" and the reason; both empty
// with sibling chaining off).
func (i *Installer) canSibling(path string) (dir, why string, err error) {
	if !i.cfg.Sibling {
		return "", "", nil
	}
	if filepath.Ext(path) != ConflistExt {
		// The runtime reads a .conf alone; chained, it becomes a list.
		return "", "the primary config is a single-plugin config, which libcni runs without its folder", nil
	}
	if i.isConverted(path) {
		// A list we made of the primary's .conf: back in the folder, an
		// uninstall would restore the .conf, and the next start convert it.
		return "", "the primary's list is one the installer converted from a single-plugin config", nil
	}
	b, _, err := readLimited(path)
	if err != nil {
		return "", "", fmt.Errorf("read primary config: %w", err)
	}
	if info, err := inspectList(b, i.cfg.PluginName); err == nil && info.nIstio > 0 {
		// Taken over in the primary's file, in one write; the next pass
		// moves our entry to the folder.
		return "", "istio-cni is chained in the primary's file", nil
	}
	network, why := siblingNetwork(b)
	if why != "" {
		return "", why, nil
	}
	dir = filepath.Join(i.cfg.ConfDir, network)
	if fi, err := os.Lstat(dir); err == nil && !fi.IsDir() {
		return "", fmt.Sprintf("%s is not a folder", dir), nil
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", "", fmt.Errorf("check %s: %w", dir, err)
	}
	return dir, "", nil
}

// ensureSibling puts our entry in dir, the primary's network folder, and
// then takes it out of the primary's own file (path), where an earlier
// chained install put it.
func (i *Installer) ensureSibling(path, dir string, force bool) (time.Duration, error) {
	p := filepath.Join(dir, i.siblingName())
	want := i.siblingContent()
	cur, _, err := readLimited(p)
	wrote := false
	if err != nil || !bytes.Equal(cur, want) {
		if !force {
			if wait := i.limiter.take(time.Now()); wait > 0 {
				i.throttled.Add(1)
				return wait, nil
			}
		}
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return 0, fmt.Errorf("make the primary network's folder: %w", err)
		}
		if err := atomicfile.WriteFile(p, want, atomicfile.Options{Mode: 0o600}); err != nil {
			return 0, fmt.Errorf("write %s: %w", p, err)
		}
		wrote = true
	}
	primary, _, err := readLimited(path)
	if err != nil {
		return 0, fmt.Errorf("read primary config: %w", err)
	}
	if i.hasOurEntry(primary) {
		// The primary's write makes the runtime reload, and it finds our
		// entry in the folder.
		if err := i.unchainFile(path); err != nil {
			if errors.Is(err, atomicfile.ErrChanged) {
				return i.cfg.Debounce, nil
			}
			return 0, err
		}
		delete(i.records, path)
		i.saveState()
		i.log.Info("moved our entry out of the primary's CNI config into its network's folder", "file", path, "entry", p)
	} else if wrote {
		i.reloadRuntime()
	}
	if wrote {
		i.noteWritten(p, false, "", "chained plugin in the primary network's folder", "file", p, "primary", path)
	} else {
		i.markInstalled(p)
	}
	return 0, nil
}

// checkSibling is Check for sibling chaining: our file in dir as we write
// it, and the primary's list without our entry (or with it, for the moment
// a move takes: it is in the chain either way).
func (i *Installer) checkSibling(dir string) error {
	p := filepath.Join(dir, i.siblingName())
	b, _, err := readLimited(p)
	if err != nil {
		return fmt.Errorf("plugin not chained in the primary network's folder: %w", err)
	}
	if !bytes.Equal(b, i.siblingContent()) {
		return fmt.Errorf("%s is not our entry as the installer writes it", p)
	}
	return nil
}

// publishConverted publishes the lists the installer made of a primary's
// single-plugin config, for Check, which reads them without the
// installer's lock (the records are the pass's). Called at the end of
// every pass.
func (i *Installer) publishConverted() {
	m := map[string]bool{}
	for p, r := range i.records {
		if r.origPath != p {
			m[p] = true
		}
	}
	i.converted.Store(&m)
}

// isConverted reports whether the list at path is one the installer made
// of a primary's single-plugin config (as of the last pass).
func (i *Installer) isConverted(path string) bool {
	m := i.converted.Load()
	return m != nil && (*m)[path]
}

// ourSiblingIn returns the path of our file in the network folder dir and
// whether it is there and holds our entry.
func (i *Installer) ourSiblingIn(dir string) (string, bool) {
	p := filepath.Join(dir, i.siblingName())
	b, _, err := readLimited(p)
	if err != nil {
		return p, false
	}
	t, err := pluginTypeOf(bytes.TrimSpace(b))
	return p, err == nil && t == i.cfg.PluginName
}

// removeSiblings removes our file from every network folder of the conf
// dir, and a folder it leaves empty, then makes the runtime reload.
func (i *Installer) removeSiblings(why string) error {
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("read CNI conf dir: %w", err)
	}
	removed := false
	var errs []error
	for _, e := range ents {
		if !e.IsDir() { // a symlink is not followed: the folder is a real one
			continue
		}
		dir := filepath.Join(i.cfg.ConfDir, e.Name())
		p, ours := i.ourSiblingIn(dir)
		if !ours {
			continue // none, or not an entry of ours: leave it
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove %s: %w", p, err))
			continue
		}
		removed = true
		i.log.Info("removed our entry from a network's folder", "file", p, "reason", why)
		_ = os.Remove(dir) // only when empty: another plugin's file keeps it
	}
	if removed {
		i.reloadRuntime()
	}
	return errors.Join(errs...)
}

// reloadRuntime makes the runtime load its CNI config again after a change
// in a network's folder, which it does not watch: a file created and
// removed in the conf dir (containerd ignores the creation and reloads on
// the removal).
func (i *Installer) reloadRuntime() {
	p := filepath.Join(i.cfg.ConfDir, reloadName)
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		i.log.Warn("could not make the runtime reload its CNI config", "err", err)
		return
	}
	if err := os.Remove(p); err != nil {
		i.log.Warn("could not make the runtime reload its CNI config", "err", err)
	}
}
