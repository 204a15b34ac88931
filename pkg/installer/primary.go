package installer

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
)

// ErrNoPrimaryConfig means the conf dir holds no config the runtime would
// load (or the configured file is missing), so there is nothing to chain
// into yet.
var ErrNoPrimaryConfig = errors.New("no primary CNI config")

// ErrConfigInFlux means a config file that would come first does not load but
// was written just now: most likely the primary CNI is halfway through a
// non-atomic write. Choosing the next file (or "no config") would chain
// into the wrong place and flap the logs, so the pass waits instead.
var ErrConfigInFlux = errors.New("CNI config is being written")

// settleTime is how long after its last write an unloadable config is
// taken for broken rather than half-written.
const settleTime = time.Second

// isConfigName reports whether the runtime would consider the file.
func isConfigName(name string) bool {
	switch filepath.Ext(name) {
	case ".conf", ConflistExt, ".json":
		return true
	}
	return false
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
		if i.isOwnedFile(p) {
			continue // our copy of the primary's, not a primary
		}
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
