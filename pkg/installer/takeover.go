package installer

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// takeOver returns the config to chain into: cur itself, or, when
// istio-cni is chained in it and Config.IstioCNIGone says its node agent
// has left the node, cur without istio-cni's entry (took is then set).
// The caller writes the result with our entry in one write, so the
// runtime never sees the list with both plugins or with neither: a pod
// that comes while istio-cni's entry is there waits (its plugin fails
// without its agent), and every pod after is ours.
func (i *Installer) takeOver(cur []byte, name string) (base []byte, took bool, err error) {
	if i.cfg.IstioCNIGone == nil || filepath.Ext(name) != ConflistExt {
		return cur, false, nil
	}
	info, err := inspectList(cur, i.cfg.PluginName)
	if err != nil || info.nIstio == 0 {
		// Errors are ChainInto's to report.
		return cur, false, nil
	}
	dirs, err := istioRunDirs(cur)
	if err != nil {
		return nil, false, fmt.Errorf("%w; not taking over: %v", istioCNIError(), err)
	}
	for _, d := range dirs {
		if gone := i.cfg.IstioCNIGone(d); gone != nil {
			return nil, false, fmt.Errorf("%w; not taking over: %v", istioCNIError(), gone)
		}
	}
	out, err := Unchain(cur, IstioCNIType)
	if err != nil {
		return nil, false, fmt.Errorf("remove istio-cni's entry: %w", err)
	}
	return out, true, nil
}

// IstioCNIDefaultRunDir is istio-cni's run directory when its entry names
// none (its agent's default).
const IstioCNIDefaultRunDir = "/var/run/istio-cni"

// istioRunDirs returns the run directory each istio-cni entry of a list
// names (cni_agent_run_dir): where its plugin reaches its agent.
func istioRunDirs(conf []byte) ([]string, error) {
	list, err := libcni.ConfListFromBytes(conf)
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, p := range list.Plugins {
		if p.Network.Type != IstioCNIType {
			continue
		}
		var e struct {
			RunDir string `json:"cni_agent_run_dir"`
		}
		if err := json.Unmarshal(p.Bytes, &e); err != nil {
			return nil, fmt.Errorf("istio-cni's entry: %w", err)
		}
		if e.RunDir == "" {
			e.RunDir = IstioCNIDefaultRunDir
		}
		dirs = append(dirs, e.RunDir)
	}
	return dirs, nil
}

// IstioCNIAgentGone returns a Config.IstioCNIGone that says istio-cni's
// node agent is gone when nothing answers on its plugin event socket in
// runDir, the host directory mounted at the same path. istio-cni stops
// serving that socket only after its installer stopped for good (on the
// way out of its process), so from then on nothing chains istio-cni again;
// a new istio-cni pod on the node would serve it again before chaining
// itself. An entry whose plugin reaches its agent in another directory is
// not judged: the socket that says would not be the one looked at.
func IstioCNIAgentGone(runDir string) func(entryRunDir string) error {
	sock := filepath.Join(runDir, ambient.IstioCNIEventSocket)
	return func(entryRunDir string) error {
		if filepath.Clean(entryRunDir) != filepath.Clean(runDir) {
			return fmt.Errorf("istio-cni's plugin reaches its agent in %s, not in %s, the directory mounted to tell: set migration.fromIstioCNI.runDir to %s", entryRunDir, runDir, entryRunDir)
		}
		err := dialIstioCNI(sock)
		if err == nil {
			return fmt.Errorf("istio-cni's node agent still answers on %s: move istio-cni's DaemonSet off this node first", sock)
		}
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil
		}
		return fmt.Errorf("cannot tell whether istio-cni's node agent is gone (%s): %w", sock, err)
	}
}

// IstioCNIAnswers reports whether istio-cni's node agent accepts a
// connection on its plugin event socket in runDir.
func IstioCNIAnswers(runDir string) bool {
	return dialIstioCNI(filepath.Join(runDir, ambient.IstioCNIEventSocket)) == nil
}

// dialIstioCNI connects to istio-cni's plugin event socket sock and hangs
// up: nil when its agent answers.
func dialIstioCNI(sock string) error {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err != nil {
		return err
	}
	return c.Close()
}

// IstioCNIHolds returns an error, saying why, while istio-cni is chained
// in the primary config and Config.IstioCNIGone does not yet say its node
// agent has left the node for good: until then an agent set to take over
// must stand by, serving nothing istio-cni serves (ztunnel's socket) and
// touching no pod. nil when istio-cni is not chained, when the takeover
// may go ahead, when there is no primary config yet, and without
// IstioCNIGone; the install pass reports any other problem.
func (i *Installer) IstioCNIHolds() error {
	if i.cfg.IstioCNIGone == nil {
		return nil
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	path, err := i.findPrimary()
	if err != nil {
		return nil
	}
	paths := []string{path}
	// With a configured primary, the runtime may still load another file
	// first: istio-cni's own copy of the primary's (istioOwnedCNIConfig).
	if first, err := i.firstLoadable(); err == nil && first != path {
		paths = append(paths, first)
	}
	for _, p := range paths {
		cur, _, err := readLimited(p)
		if err != nil {
			continue
		}
		if _, _, err := i.takeOver(cur, filepath.Base(p)); err != nil {
			return fmt.Errorf("primary config %s: %w", p, err)
		}
	}
	return nil
}
