package installer

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
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
	// copyOf is a config that may be istio-cni's copy of the next one.
	var copyOf *istioCopy
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
		if copyOf != nil {
			if copyOf.of(i, p) {
				return p, nil
			}
			return copyOf.path, nil
		}
		if c := i.istioCopyCandidate(p); c != nil {
			copyOf = c
			continue
		}
		return p, nil
	}
	if copyOf != nil {
		return copyOf.path, nil
	}
	return "", fmt.Errorf("%w in %s", ErrNoPrimaryConfig, dir)
}

// istio-cni's own conflist: with istioOwnedCNIConfig, istio-cni leaves
// the primary's config alone and writes a copy of it with its entry added
// under a name that sorts first (02-istio-cni.conflist by default), which
// the runtime then loads. Taken for the primary, that copy would be
// chained into and kept: a frozen copy of the primary's network, and gone
// (with our entry) whenever anything cleans istio-cni up. So once
// istio-cni's node agent has left the node (the takeover may go ahead),
// the primary is the config the copy was made of, and the copy is removed
// once our entry is in place (removeIstioCopies): until then the runtime
// loads the copy, whose istio-cni entry fails pods without its agent, and
// from then on the primary's, with our entry.

// istioCopy is a loadable conflist istio-cni is chained in while the
// takeover may go ahead, its network's name and its plugin types other
// than istio-cni's and ours.
type istioCopy struct {
	path, name string
	types      []string
}

// istioCopyCandidate returns path as an istioCopy when istio-cni is
// chained in it and its node agent has left the node, else nil.
func (i *Installer) istioCopyCandidate(path string) *istioCopy {
	if filepath.Ext(path) != ConflistExt {
		return nil
	}
	cur, _, err := readLimited(path)
	if err != nil {
		return nil
	}
	if _, took, err := i.takeOver(cur, filepath.Base(path)); err != nil || !took {
		return nil
	}
	name, types, err := i.network(path, cur)
	if err != nil {
		return nil
	}
	return &istioCopy{path: path, name: name, types: types}
}

// of reports whether c is istio-cni's copy of the config at path: the
// same network name (istio-cni copies the file) and the same plugins in
// the same order, istio-cni's and ours aside.
func (c *istioCopy) of(i *Installer, path string) bool {
	b, _, err := readLimited(path)
	if err != nil {
		return false
	}
	name, types, err := i.network(path, b)
	return err == nil && len(types) > 0 && name == c.name && slices.Equal(types, c.types)
}

// network returns a config's network name and its plugin types,
// istio-cni's and ours aside.
func (i *Installer) network(path string, b []byte) (string, []string, error) {
	var name string
	var all []string
	if filepath.Ext(path) == ConflistExt {
		list, err := libcni.NetworkConfFromBytes(b)
		if err != nil {
			return "", nil, err
		}
		name = list.Name
		for _, p := range list.Plugins {
			all = append(all, p.Network.Type)
		}
	} else {
		c, err := libcni.NetworkPluginConfFromBytes(b)
		if err != nil {
			return "", nil, err
		}
		name = c.Network.Name
		all = append(all, c.Network.Type)
	}
	return name, slices.DeleteFunc(all, func(t string) bool { return t == IstioCNIType || t == i.cfg.PluginName }), nil
}

// removeIstioCopies removes istio-cni's copies of the primary's config
// (see istioCopy): the configs that sort before it, hold istio-cni's entry
// while its agent has left the node, and name the primary's network and
// plugins. The caller has put our entry in place first.
func (i *Installer) removeIstioCopies(primary string) error {
	if i.cfg.IstioCNIGone == nil {
		return nil
	}
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil {
		return fmt.Errorf("read CNI conf dir: %w", err)
	}
	for _, e := range ents {
		p := filepath.Join(i.cfg.ConfDir, e.Name())
		if e.IsDir() || !isConfigName(e.Name()) || e.Name() >= filepath.Base(primary) || i.isOwnedFile(p) || loadable(p) != nil {
			continue
		}
		c := i.istioCopyCandidate(p)
		if c == nil || !c.of(i, primary) {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove istio-cni's copy of the primary's config: %w", err)
		}
		i.log.Info("removed istio-cni's copy of the primary CNI config (its istioOwnedCNIConfig): its node agent has left the node, and ours is chained for the primary's", "file", p, "primary", primary)
	}
	return nil
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
