package nodeagent

import (
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// EnablementSource is the node-wide view the enablement snapshot is built
// from: the namespaces the enablement selectors enable, and whether
// pod-level enablement is in use (pkg/podcache.Cache).
type EnablementSource interface {
	EnablementState() (enabled []string, podLevel bool)
}

// snapshotWriter keeps the enablement snapshot file that the plugin reads
// when the agent is unreachable. It writes only when the content changes,
// atomically (temp file and rename) with mode 0600, and continues the
// generation found in an existing file so generations never go backwards
// across agent restarts.
type snapshotWriter struct {
	path string
	// state is the copy in the persistent state directory ("" for none):
	// the one the plugin decides by, as it survives a reboot.
	state string

	mu   sync.Mutex
	gen  int64
	last *nodefiles.EnablementSnapshot
}

// newSnapshotWriter returns a writer for path; an existing readable
// snapshot there sets the starting generation.
func newSnapshotWriter(path, state string) *snapshotWriter {
	w := &snapshotWriter{path: path, state: state}
	for _, p := range []string{path, state} {
		if p == "" {
			continue
		}
		if b, err := os.ReadFile(p); err == nil {
			if s, err := nodefiles.ParseSnapshot(b); err == nil {
				w.gen = max(w.gen, s.Generation)
			}
		}
	}
	return w
}

// Path is the snapshot file's path.
func (w *snapshotWriter) Path() string { return w.path }

// Update writes a snapshot of the given state unless it equals the last
// one written. It reports whether it wrote.
func (w *snapshotWriter) Update(enabled []string, podLevel bool, excluded []string, namespaces []string, pods map[string]bool) (bool, error) {
	next := &nodefiles.EnablementSnapshot{
		EnabledNamespaces:  sortedCopy(enabled),
		PodLevelEnablement: podLevel,
		ExcludedNamespaces: sortedCopy(excluded),
		Namespaces:         sortedCopy(namespaces),
		Pods:               pods,
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.last != nil && sameSnapshot(w.last, next) {
		return false, nil
	}
	next.Generation = w.gen + 1
	next.Written = time.Now().UTC()
	if err := nodefiles.WriteSnapshot(w.path, next); err != nil {
		return false, err
	}
	if w.state != "" {
		if err := nodefiles.WriteSnapshot(w.state, next); err != nil {
			return false, err
		}
	}
	w.gen, w.last = next.Generation, next
	return true, nil
}

func sortedCopy(s []string) []string {
	out := slices.Clone(s)
	if out == nil {
		out = []string{}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func sameSnapshot(a, b *nodefiles.EnablementSnapshot) bool {
	return a.PodLevelEnablement == b.PodLevelEnablement &&
		slices.Equal(a.EnabledNamespaces, b.EnabledNamespaces) &&
		slices.Equal(a.ExcludedNamespaces, b.ExcludedNamespaces) &&
		slices.Equal(a.Namespaces, b.Namespaces) && maps.Equal(a.Pods, b.Pods)
}

// NodeStateSource, when the EnablementSource also is one, adds to the
// snapshot what lets the plugin fail closed for what it never saw: every
// namespace known, and this node's pods by UID with their decision.
type NodeStateSource interface {
	NodeState() (namespaces []string, pods map[string]bool)
}

// RefreshSnapshot rewrites the enablement snapshot from cfg.Enablement if
// it changed. Wire it to the pod cache's OnEnablementChange: the first
// call should come once the cache is synced and the pods enrolled before a
// restart are restored, since a premature empty snapshot would let the
// plugin pass pods through.
func (a *Agent) RefreshSnapshot() error {
	if a.cfg.Enablement == nil {
		return nil
	}
	enabled, podLevel := a.cfg.Enablement.EnablementState()
	var namespaces []string
	var pods map[string]bool
	if ns, ok := a.cfg.Enablement.(NodeStateSource); ok {
		namespaces, pods = ns.NodeState()
	}
	wrote, err := a.snapshot.Update(enabled, podLevel, a.cfg.ExcludedNamespaces, namespaces, pods)
	if err != nil {
		a.log.Error("write enablement snapshot", "err", err)
		return err
	}
	if wrote {
		a.log.Info("enablement snapshot written", "path", a.snapshot.Path(), "enabled", enabled, "podLevel", podLevel)
	}
	return nil
}
