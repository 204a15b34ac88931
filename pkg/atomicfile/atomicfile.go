// Package atomicfile replaces files so readers see the old content or the
// new, never a mix, for everything that writes files on the node: the
// installer, the plugin's DEL spool and the agent's enablement snapshot. It
// writes a temporary file next to the target, syncs it, gives it its mode
// (and owner) and renames it over the target; it uses only the standard
// library, so the plugin binary stays thin.
package atomicfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// Temporary files are named TempPrefix + random + TempSuffix: hidden, and
// with an extension no CNI runtime loads as a config and no reader of ours
// takes for an entry, so a half-written file is never picked up.
const (
	TempPrefix = ".ambient-cni-"
	TempSuffix = ".tmp"
)

// IsTemp reports whether a file name is one of our temporary files.
func IsTemp(name string) bool {
	return strings.HasPrefix(name, TempPrefix) && strings.HasSuffix(name, TempSuffix)
}

// ErrChanged is what a Guard returns to veto the rename: the target
// changed while the new content was prepared, and the caller retries with
// fresh content instead of clobbering it.
var ErrChanged = errors.New("file changed while writing")

// Owner is a file's uid and gid.
type Owner struct{ UID, GID int }

// OwnerOf returns fi's owner, or nil when the platform does not say.
func OwnerOf(fi fs.FileInfo) *Owner {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return &Owner{int(st.Uid), int(st.Gid)}
	}
	return nil
}

// Options tune a write.
type Options struct {
	// Mode is the new file's permission bits.
	Mode fs.FileMode
	// Owner, when set, is given the file where the process may do so
	// (root); elsewhere the file keeps the writer's owner.
	Owner *Owner
	// Guard, when set, runs just before the rename and can veto it.
	Guard func() error
	// SkipSync leaves out both fsyncs, for state that only has to outlive
	// the process, not the machine (the agent's runtime records: a crash of
	// the process never loses a renamed file, and after a reboot the pod
	// network namespaces they describe are gone anyway). The rename stays
	// atomic for readers.
	SkipSync bool
}

// WriteFile replaces path with data.
func WriteFile(path string, data []byte, o Options) error {
	return replace(path, o, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// CopyFile replaces dst with a copy of src, streaming.
func CopyFile(src, dst string, o Options) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("open %s: %w", src, err)
	}
	defer in.Close()
	return replace(dst, o, func(w io.Writer) error {
		if _, err := io.Copy(w, in); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		return nil
	})
}

// replace is the one way to replace a file: fill writes the content into
// a temporary file next to path (created exclusively, so a planted symlink
// is never followed), which is synced, given its mode and owner, checked by
// the guard and renamed over path; the directory is synced after.
func replace(path string, o Options, fill func(io.Writer) error) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, TempPrefix+"*"+TempSuffix)
	if err != nil {
		return fmt.Errorf("create temp file in %s: %w", dir, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if err = fill(f); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err = f.Chmod(o.Mode.Perm()); err != nil {
		return fmt.Errorf("chmod %s: %w", tmp, err)
	}
	if o.Owner != nil {
		// Only root can give a file away; elsewhere keep what we have.
		if cerr := f.Chown(o.Owner.UID, o.Owner.GID); cerr != nil && !errors.Is(cerr, fs.ErrPermission) {
			return fmt.Errorf("chown %s: %w", tmp, cerr)
		}
	}
	if !o.SkipSync {
		if err = f.Sync(); err != nil {
			return fmt.Errorf("sync %s: %w", tmp, err)
		}
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if o.Guard != nil {
		if err = o.Guard(); err != nil {
			return err
		}
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp, path, err)
	}
	if !o.SkipSync {
		syncDir(dir)
	}
	return nil
}

// syncDir makes a rename durable; failure only costs durability, not
// correctness, so it is not reported.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
}

// RemoveStaleTemps deletes temporary files a previous run left behind (a
// crash between create and rename) and returns how many it removed. A
// missing directory has none.
func RemoveStaleTemps(dir string) (int, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return 0, nil
		}
		return 0, err
	}
	n := 0
	for _, e := range ents {
		if e.Type().IsRegular() && IsTemp(e.Name()) {
			if err := os.Remove(filepath.Join(dir, e.Name())); err == nil {
				n++
			}
		}
	}
	return n, nil
}
