package nodeagent

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// snapshotWriter keeps the enablement snapshot file that the plugin reads
// when the agent is unreachable. It writes only when the content changes,
// atomically (temp file and rename) with mode 0600, and continues the
// generation found in an existing file so generations never go backwards
// across agent restarts.
type snapshotWriter struct {
	path string

	mu   sync.Mutex
	gen  int64
	last *nodefiles.EnablementSnapshot
}

// newSnapshotWriter returns a writer for path; an existing readable
// snapshot there sets the starting generation.
func newSnapshotWriter(path string) *snapshotWriter {
	w := &snapshotWriter{path: path}
	if b, err := os.ReadFile(path); err == nil {
		if s, err := nodefiles.ParseSnapshot(b); err == nil {
			w.gen = s.Generation
		}
	}
	return w
}

// Path is the snapshot file's path.
func (w *snapshotWriter) Path() string { return w.path }

// Update writes a snapshot of the given state unless it equals the last
// one written. It reports whether it wrote.
func (w *snapshotWriter) Update(enabled []string, podLevel bool, excluded []string) (bool, error) {
	next := &nodefiles.EnablementSnapshot{
		EnabledNamespaces:  sortedCopy(enabled),
		PodLevelEnablement: podLevel,
		ExcludedNamespaces: sortedCopy(excluded),
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
	w.gen, w.last = next.Generation, next
	return true, nil
}

// Remove deletes the snapshot file (for an uninstall); missing is fine.
func (w *snapshotWriter) Remove() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last = nil
	if err := os.Remove(w.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove enablement snapshot: %w", err)
	}
	return nil
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
		slices.Equal(a.ExcludedNamespaces, b.ExcludedNamespaces)
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
	wrote, err := a.snapshot.Update(enabled, podLevel, a.cfg.ExcludedNamespaces)
	if err != nil {
		a.log.Error("write enablement snapshot", "err", err)
		return err
	}
	if wrote {
		a.log.Info("enablement snapshot written", "path", a.snapshot.Path(), "enabled", enabled, "podLevel", podLevel)
	}
	return nil
}
