package installer

import (
	"errors"
	"fmt"
	"time"
)

// ErrPrimaryContested means the primary CNI keeps taking our entry out of
// its config (an exclusive primary, such as Cilium with cni.exclusive):
// the installer puts it back each time, but every pod that starts in
// between skips the plugin.
var ErrPrimaryContested = errors.New("the primary CNI keeps removing the plugin's config entry")

// A primary that takes our entry out contestedRemovals times within
// contestedWindow is fighting us, not restarting: Check fails until a
// whole window passes without a removal.
const (
	contestedRemovals = 3
	contestedWindow   = time.Minute
)

// noteRemoval counts one more time our entry was found gone from a config
// we had chained, and says so once when the removals come too often to be
// restarts of the primary.
func (i *Installer) noteRemoval(path string, now time.Time) {
	i.contestMu.Lock()
	defer i.contestMu.Unlock()
	// A removal a whole window after the last one starts afresh, whether
	// or not a Check has ended the episode yet.
	if n := len(i.removals); n > 0 && now.Sub(i.removals[n-1]) >= contestedWindow {
		i.contested = nil
	}
	ongoing := i.contested != nil
	i.removals = append(i.removals, now)
	if len(i.removals) > contestedRemovals {
		i.removals = i.removals[len(i.removals)-contestedRemovals:]
	}
	if len(i.removals) < contestedRemovals || now.Sub(i.removals[0]) > contestedWindow {
		return
	}
	err := fmt.Errorf("%w: %s lost the %q entry %d times within %v; pods that start before it is back skip ambient-cni "+
		"and are captured only once they run. An exclusive primary does this (Cilium with cni.exclusive=true, its default): "+
		"set it to leave other plugins' entries in its config (Cilium: cni.exclusive=false); ambient-cni keeps putting the entry back meanwhile",
		ErrPrimaryContested, path, i.cfg.PluginName, contestedRemovals, now.Sub(i.removals[0]).Round(time.Millisecond))
	if !ongoing {
		i.log.Warn("primary CNI keeps removing our config entry", "file", path, "err", err)
		if i.cfg.OnRefused != nil {
			i.cfg.OnRefused(err)
		}
	}
	i.contested = err
}

// contestedNow is the contest error while the last removal is less than a
// window old, and ends the episode once it is not.
func (i *Installer) contestedNow(now time.Time) error {
	i.contestMu.Lock()
	defer i.contestMu.Unlock()
	if i.contested == nil {
		return nil
	}
	if n := len(i.removals); n > 0 && now.Sub(i.removals[n-1]) < contestedWindow {
		return i.contested
	}
	i.log.Info("primary CNI has left our config entry alone for a while", "window", contestedWindow)
	i.contested = nil
	return nil
}
