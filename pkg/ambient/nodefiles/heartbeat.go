package nodefiles

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// HeartbeatInterval is how often a serving agent refreshes its heartbeat;
// well below DefaultAgentDownAfter so one late refresh is not an outage.
const HeartbeatInterval = 15 * time.Second

// TouchHeartbeat records that the agent is alive at now: the file's
// modification time is the heartbeat, so the plugin reads it with one
// stat. The file is created empty (mode 0600) when missing.
func TouchHeartbeat(path string, now time.Time) error {
	err := os.Chtimes(path, now, now)
	if errors.Is(err, os.ErrNotExist) {
		if err = os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return fmt.Errorf("heartbeat dir: %w", err)
		}
		f, cerr := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if cerr != nil && !errors.Is(cerr, os.ErrExist) {
			return fmt.Errorf("create heartbeat: %w", cerr)
		}
		if f != nil {
			_ = f.Close()
		}
		err = os.Chtimes(path, now, now)
	}
	if err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	return nil
}

// LastAlive reads when the agent last refreshed its heartbeat. It only
// stats the path (never opens it), so no kind of file there can block the
// plugin; anything but a regular file is an error.
func LastAlive(path string) (time.Time, error) {
	st, err := os.Lstat(path)
	if err != nil {
		return time.Time{}, err
	}
	if !st.Mode().IsRegular() {
		return time.Time{}, fmt.Errorf("heartbeat %s is not a regular file", path)
	}
	return st.ModTime(), nil
}

// RemoveHeartbeat deletes the heartbeat (the agent is uninstalled, not
// restarting); missing is fine.
func RemoveHeartbeat(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove heartbeat: %w", err)
	}
	return nil
}
