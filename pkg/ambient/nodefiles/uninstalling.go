package nodefiles

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// MarkUninstalling writes the uninstall marker (Layout.Uninstalling),
// synced to disk, creating the state directory (0700) if needed. An
// uninstall writes it before it unchains the plugin: an agent killed at
// any later step leaves a plugin that lets every pod through, never one
// that waits for an agent that is not coming back. note says who wrote it
// and why, for an operator who finds it.
func MarkUninstalling(l Layout, note string) error {
	p := l.Uninstalling()
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("uninstall marker: create %s: %w", filepath.Dir(p), err)
	}
	if err := atomicfile.WriteFile(p, []byte(note+"\n"), atomicfile.Options{Mode: 0o600}); err != nil {
		return fmt.Errorf("uninstall marker: %w", err)
	}
	return nil
}

// ClearUninstalling removes the uninstall marker and reports whether there
// was one. An agent removes a stale one (an uninstall cut short, then the
// mesh installed again) before it chains the plugin, and an uninstall
// removes its own once the plugin is unchained.
func ClearUninstalling(l Layout) (bool, error) {
	err := os.Remove(l.Uninstalling())
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, os.ErrNotExist):
		return false, nil
	}
	return false, fmt.Errorf("uninstall marker: %w", err)
}

// RemoveForUninstall deletes every file the agent and the plugin keep on
// the node for each other, in the run directory and the state directory:
// the capture records, both enablement snapshots, the DEL and ADD spools,
// the heartbeat, the plugin's credential and the fallback binary. An
// uninstall calls it once the plugin is unchained, when none of them has
// a reader left. It is the one place they are removed; what others own
// stays for them: the marker (ClearUninstalling, last), the installer's
// state, the node directories' ledger, the sockets. Missing is fine.
func RemoveForUninstall(l Layout) error {
	var errs []error
	for _, p := range []string{l.Records(), l.Snapshot(), l.StateSnapshot(), l.DelSpool(), l.AddSpool(), l.Heartbeat(),
		l.PluginCredential(), l.FallbackBinary()} {
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}
