package plugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// istioCNIChainSettle is how long istio-cni's entry must have been in the
// network's chain on disk before a pod goes to istio-cni's plugin. A
// runtime reloads its CNI config when the file changes, but a sandbox whose
// setup began before that runs the chain it loaded then, without
// istio-cni's plugin; seconds cover the reload and such a setup with room.
const istioCNIChainSettle = 5 * time.Second

// maxChainFileBytes bounds a config file read for the chain; real ones are
// a few KiB.
const maxChainFileBytes = 1 << 20

// istioCNIChained reports whether istio-cni's plugin is in network's chain
// in confDir, as the runtime loads it (the first config file of that
// name, in the runtime's order, and the network's folder of plugin files
// that libcni 1.3 appends), and has been for istioCNIChainSettle at now.
// It says how it found the chain either way.
func istioCNIChained(confDir, network string, now time.Time) (bool, string) {
	if confDir == "" {
		return false, "the plugin entry names no CNI config directory (istioCNIConfDir) to find istio-cni's plugin in"
	}
	file, types, changed, err := networkChain(confDir, network)
	if err != nil {
		return false, fmt.Sprintf("network %s's chain cannot be read: %v", network, err)
	}
	if !slices.Contains(types, "istio-cni") {
		return false, fmt.Sprintf("its plugin is not in network %s's chain (%s: %s)", network, file, strings.Join(types, ","))
	}
	if age := now.Sub(changed); age < istioCNIChainSettle {
		return false, fmt.Sprintf("its plugin has been in network %s's chain (%s) for %v, less than %v: the runtime may still run the chain it had before", network, file, age.Round(time.Millisecond), istioCNIChainSettle)
	}
	return true, fmt.Sprintf("its plugin is in network %s's chain (%s: %s)", network, file, strings.Join(types, ","))
}

// networkChain returns the config file of network in confDir that the
// runtime loads, the plugin types of its chain with those of the network's
// folder appended, and the newest modification time among them.
func networkChain(confDir, network string) (file string, types []string, changed time.Time, err error) {
	ents, err := os.ReadDir(confDir)
	if err != nil {
		return "", nil, time.Time{}, err
	}
	for _, e := range ents { // ReadDir sorts by name, as runtimes load them
		switch filepath.Ext(e.Name()) {
		case ".conf", ".conflist", ".json":
		default:
			continue
		}
		p := filepath.Join(confDir, e.Name())
		b, mtime, err := readChainFile(p)
		if err != nil {
			continue // a runtime skips a file it cannot load
		}
		name, ts, inlined, err := chainTypes(b)
		if err != nil || name != network {
			continue
		}
		if inlined {
			return p, ts, mtime, nil // libcni skips the network's folder
		}
		file, types, changed = p, ts, mtime
		break
	}
	if file == "" {
		return "", nil, time.Time{}, fmt.Errorf("no config file of network %q in %s", network, confDir)
	}
	folder := filepath.Join(confDir, network)
	if ents, err := os.ReadDir(folder); err == nil {
		for _, e := range ents {
			if filepath.Ext(e.Name()) != ".conf" {
				continue
			}
			b, mtime, err := readChainFile(filepath.Join(folder, e.Name()))
			if err != nil {
				continue
			}
			var one struct{ Type string }
			if json.Unmarshal(b, &one) != nil || one.Type == "" {
				continue
			}
			types = append(types, one.Type)
			if mtime.After(changed) {
				changed = mtime
			}
		}
	}
	return file, types, changed, nil
}

// readChainFile reads a config file of at most maxChainFileBytes.
func readChainFile(path string) ([]byte, time.Time, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, time.Time{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, time.Time{}, err
	}
	if !st.Mode().IsRegular() {
		return nil, time.Time{}, fmt.Errorf("%s is not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxChainFileBytes+1))
	if err != nil {
		return nil, time.Time{}, err
	}
	if len(b) > maxChainFileBytes {
		return nil, time.Time{}, fmt.Errorf("%s is more than %d bytes", path, maxChainFileBytes)
	}
	return b, st.ModTime(), nil
}

// chainTypes decodes a CNI config file (a conflist, or a single plugin's
// .conf) into its network name and its plugins' types, in chain order.
// Not libcni's loader, which the installer uses: it would bring crypto and
// more into the plugin, 3.2 to 4.8 MB of the binary every pod's ADD
// executes, for the few keys read here.
func chainTypes(b []byte) (name string, types []string, inlinedOnly bool, err error) {
	var c struct {
		Name    string
		Type    string
		Plugins []struct{ Type string }
		// The list's plugins alone: libcni skips the network's folder.
		LoadOnlyInlinedPlugins bool `json:"loadOnlyInlinedPlugins"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return "", nil, false, err
	}
	if c.Name == "" {
		return "", nil, false, errors.New("no network name")
	}
	if c.Plugins == nil {
		if c.Type == "" {
			return "", nil, false, errors.New("neither plugins nor a type")
		}
		return c.Name, []string{c.Type}, false, nil
	}
	if len(c.Plugins) == 0 {
		return "", nil, false, errors.New("no plugins") // libcni refuses such a list
	}
	for _, p := range c.Plugins {
		types = append(types, p.Type)
	}
	return c.Name, types, c.LoadOnlyInlinedPlugins, nil
}
