// Package nodefiles is the part of the plugin↔agent contract that lives on
// the node's disk next to the agent socket: the enablement snapshot the
// agent writes and the plugin falls back to while the agent is unreachable,
// the heartbeat that tells the plugin how long ago the agent was alive, and
// the spools of requests the plugin records meanwhile for the agent: DELs
// it replays, and ADDs of pods let through uncaptured, which it re-checks.
// Their paths (Layout), formats, readers and writers. The plugin binary imports it,
// so it stays small.
package nodefiles

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

const (
	// spoolSuffix marks complete spool entries; temp files lack it.
	spoolSuffix = ".json"
	// maxEntryBytes bounds one spool entry; a PodEvent is far smaller.
	maxEntryBytes = ambient.MaxRequestBytes
	// maxEntries bounds how many spool entries one List returns, so a
	// flooded spool cannot exhaust the agent's memory at startup.
	maxEntries = 10000
)

// validEntryName reports whether id can name a spool file: the CNI spec
// restricts container ids to this alphabet, and it keeps a hostile id from
// escaping the directory.
func validEntryName(id string) bool {
	if id == "" || len(id) > 253 || id[0] == '.' {
		return false
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return false
		}
	}
	return true
}

// Spool records a DEL the agent could not take, or an ADD the plugin let
// through without it, atomically (temp file and rename, mode 0600) so the
// agent never reads half an entry. A second request of the same command for
// the same sandbox overwrites the first.
func Spool(dir string, ev ambient.PodEvent) error {
	if ev.Command != ambient.CommandDel && ev.Command != ambient.CommandAdd {
		return fmt.Errorf("spool: only DEL and ADD are spooled, not %q", ev.Command)
	}
	if err := ev.Validate(); err != nil {
		return fmt.Errorf("spool: %w", err)
	}
	if !validEntryName(ev.SandboxID) {
		return fmt.Errorf("spool: sandbox id %q cannot name a file", ev.SandboxID)
	}
	b, err := json.Marshal(ev)
	if err != nil {
		return fmt.Errorf("spool: encode: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("spool: create %s: %w", dir, err)
	}
	return atomicfile.WriteFile(filepath.Join(dir, ev.SandboxID+spoolSuffix), b, atomicfile.Options{Mode: 0o600})
}

// Entry is one spooled DEL.
type Entry struct {
	// Path is the entry's file; pass it to Remove once handled.
	Path string
	// Event is the decoded request, or nil when the file was unusable.
	Event *ambient.PodEvent
	// Err says why Event is nil.
	Err error
}

// List reads the DEL spool. Unusable entries (not regular files,
// oversized, undecodable, invalid, not a DEL) are returned with Err set so
// the caller can log and remove them. A missing directory is an empty
// spool.
func List(dir string) ([]Entry, error) {
	return list(dir, ambient.CommandDel)
}

// ListAdds reads the ADD spool as List reads the DEL spool.
func ListAdds(dir string) ([]Entry, error) {
	return list(dir, ambient.CommandAdd)
}

func list(dir string, cmd ambient.Command) ([]Entry, error) {
	des, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read spool %s: %w", dir, err)
	}
	var out []Entry
	for _, de := range des {
		name := de.Name()
		if !strings.HasSuffix(name, spoolSuffix) {
			continue // temp files of a writer still at work, or strangers
		}
		if len(out) == maxEntries {
			break
		}
		p := filepath.Join(dir, name)
		ev, err := readEntry(p, cmd)
		out = append(out, Entry{Path: p, Event: ev, Err: err})
	}
	return out, nil
}

func readEntry(p string, cmd ambient.Command) (*ambient.PodEvent, error) {
	// O_NOFOLLOW: a symlink planted in the spool must not make the agent
	// read some other file; O_NONBLOCK: nor a FIFO block it.
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("not a regular file")
	}
	b, err := io.ReadAll(io.LimitReader(f, maxEntryBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read: %w", err)
	}
	if len(b) > maxEntryBytes {
		return nil, fmt.Errorf("larger than %d bytes", maxEntryBytes)
	}
	var ev ambient.PodEvent
	if err := json.Unmarshal(b, &ev); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	if ev.Command != cmd {
		return nil, fmt.Errorf("command %q is not %s", ev.Command, cmd)
	}
	if err := ev.Validate(); err != nil {
		return nil, err
	}
	return &ev, nil
}

// Remove deletes a handled spool entry; a missing file is fine.
func Remove(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove spool entry: %w", err)
	}
	return nil
}
