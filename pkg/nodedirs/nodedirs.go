// Package nodedirs holds the host directories the agent makes private
// (its socket's, the ZDS socket's) and a ledger of what it found there
// first, so that an uninstall leaves them as they were: the directories
// it created go (when nothing else is in them), and the ones that existed
// get back the mode and owner it changed. The ledger lives in the agent's
// run directory (nodefiles.Layout names it) and outlives agent restarts and upgrades, which keep the first
// agent's notes: a directory found already there without a note (a crash
// before the note, an older agent) counts as not ours and stays.
package nodedirs

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
)

// maxLedgerBytes bounds what is read back; the ledger names a few paths.
const maxLedgerBytes = 64 << 10

// Dir is what the ledger notes about one directory.
type Dir struct {
	Path string `json:"path"`
	// Created: it did not exist and the agent made it.
	Created bool `json:"created,omitempty"`
	// Mode, UID and GID are what an existing directory had.
	Mode fs.FileMode `json:"mode,omitempty"`
	UID  int         `json:"uid,omitempty"`
	GID  int         `json:"gid,omitempty"`
}

type ledger struct {
	Note string `json:"note"`
	Dirs []Dir  `json:"dirs"`
}

const note = "ambient-cni: host directories the agent created or made private, put back at uninstall"

// Ensure makes every dir private (unixsock.EnsurePrivateDir: created
// 0700, or tightened to 0700 and root's), first noting in the ledger what
// was there: each missing directory (parents included) as created, an
// existing one with its mode and owner. A dir the ledger already names
// keeps its first note; an unusable ledger is started over. The ledger is
// the file at path, in one of dirs (the agent's run directory).
func Ensure(path string, dirs ...string) error {
	if len(dirs) == 0 {
		return nil
	}
	l, err := load(path)
	if err != nil {
		// Start over: what exists now is noted as existing, so nothing is
		// removed on a guess.
		l = ledger{}
	}
	known := func(p string) bool { return slices.ContainsFunc(l.Dirs, func(d Dir) bool { return d.Path == p }) }
	changed := false
	for _, dir := range dirs {
		dir = filepath.Clean(dir)
		if !known(dir) {
			notes, err := survey(dir)
			if err != nil {
				return err
			}
			for _, n := range notes {
				if !known(n.Path) {
					l.Dirs = append(l.Dirs, n)
					changed = true
				}
			}
		}
		if err := unixsock.EnsurePrivateDir(dir); err != nil {
			return err
		}
	}
	if !changed {
		return nil
	}
	l.Note = note
	b, err := json.MarshalIndent(l, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(path, b, atomicfile.Options{Mode: 0o600}); err != nil {
		return fmt.Errorf("write node directory ledger: %w", err)
	}
	return nil
}

// survey notes dir as it is now: existing, or missing with every missing
// parent up to the first existing one.
func survey(dir string) ([]Dir, error) {
	var notes []Dir
	for p := dir; ; p = filepath.Dir(p) {
		fi, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			notes = append(notes, Dir{Path: p, Created: true})
			if filepath.Dir(p) == p {
				return notes, nil
			}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("stat %s: %w", p, err)
		}
		if p == dir && fi.IsDir() {
			d := Dir{Path: p, Mode: fi.Mode().Perm()}
			if st, ok := fi.Sys().(*unix.Stat_t); ok {
				d.UID, d.GID = int(st.Uid), int(st.Gid)
			}
			notes = append(notes, d)
		}
		// Not a directory: EnsurePrivateDir refuses it; nothing to note.
		return notes, nil
	}
}

// Restore puts back every directory the ledger at path notes, then removes
// the ledger: created ones are removed deepest first when empty (one
// still holding something, ours or not, stays), existing ones get their
// mode and owner back. Without a ledger there is nothing to put back.
func Restore(path string) error {
	l, err := load(path)
	if err != nil {
		return err
	}
	if len(l.Dirs) == 0 {
		return nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove node directory ledger: %w", err)
	}
	_, _ = atomicfile.RemoveStaleTemps(filepath.Dir(path))
	// Deepest first: a child goes before its parent.
	slices.SortFunc(l.Dirs, func(a, b Dir) int { return cmp.Compare(len(b.Path), len(a.Path)) })
	var errs []error
	for _, d := range l.Dirs {
		fi, err := os.Lstat(d.Path)
		if err != nil || !fi.IsDir() {
			continue // gone, or replaced by something we do not own
		}
		if d.Created {
			// Only when empty: ENOTEMPTY means something else lives there.
			if err := unix.Rmdir(d.Path); err != nil && !errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) {
				errs = append(errs, fmt.Errorf("remove %s: %w", d.Path, err))
			}
			continue
		}
		if st, ok := fi.Sys().(*unix.Stat_t); ok && (int(st.Uid) != d.UID || int(st.Gid) != d.GID) && os.Geteuid() == 0 {
			if err := os.Lchown(d.Path, d.UID, d.GID); err != nil {
				errs = append(errs, fmt.Errorf("chown %s back: %w", d.Path, err))
			}
		}
		if fi.Mode().Perm() != d.Mode {
			if err := os.Chmod(d.Path, d.Mode); err != nil {
				errs = append(errs, fmt.Errorf("chmod %s back to %v: %w", d.Path, d.Mode, err))
			}
		}
	}
	return errors.Join(errs...)
}

// load reads the ledger; a missing one is empty, an unreadable one an
// error (nothing is put back on a guess).
func load(path string) (ledger, error) {
	var l ledger
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return l, nil
	}
	if err != nil {
		return l, fmt.Errorf("read node directory ledger: %w", err)
	}
	if len(b) > maxLedgerBytes {
		return l, fmt.Errorf("node directory ledger %s larger than %d bytes", path, maxLedgerBytes)
	}
	if err := json.Unmarshal(b, &l); err != nil {
		return l, fmt.Errorf("node directory ledger %s: %w", path, err)
	}
	return l, nil
}
