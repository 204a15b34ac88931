package installer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// Our temporary files end in ".tmp", an extension no runtime loads as a
// CNI config, so a half-written file is never picked up.
const (
	tempPrefix = ".ambient-cni-"
	tempSuffix = ".tmp"
)

func isOurTemp(name string) bool {
	return strings.HasPrefix(name, tempPrefix) && strings.HasSuffix(name, tempSuffix)
}

// errChanged means the destination changed under us while we prepared a
// write; the caller retries with fresh content instead of clobbering it.
var errChanged = errors.New("file changed while writing")

// owner is a file's uid/gid, kept so a rewritten config keeps its owner.
type owner struct{ uid, gid int }

func ownerOf(fi fs.FileInfo) *owner {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return &owner{int(st.Uid), int(st.Gid)}
	}
	return nil
}

// writeAtomic replaces path with data: temp file in the same directory,
// fsync, mode (and owner when we may), then rename and fsync the directory.
// guard, when set, runs just before the rename and can veto it.
func writeAtomic(path string, data []byte, mode fs.FileMode, own *owner, guard func() error) error {
	return replaceAtomic(path, mode, own, guard, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// copyAtomic copies src over dst the same way, streaming.
func copyAtomic(src, dst string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("open plugin binary: %w", err)
	}
	defer in.Close()
	return replaceAtomic(dst, mode, nil, nil, func(w io.Writer) error {
		if _, err := io.Copy(w, in); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		return nil
	})
}

// replaceAtomic is the one way the installer replaces a file: fill writes
// the content into a temp file next to path, which is synced, given mode
// (and owner), checked by guard and renamed over path.
func replaceAtomic(path string, mode fs.FileMode, own *owner, guard func() error, fill func(io.Writer) error) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, tempPrefix+"*"+tempSuffix)
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
	if err = f.Chmod(mode.Perm()); err != nil {
		return fmt.Errorf("chmod %s: %w", tmp, err)
	}
	if own != nil {
		// Only root can give a file away; elsewhere keep what we have.
		if cerr := f.Chown(own.uid, own.gid); cerr != nil && !errors.Is(cerr, fs.ErrPermission) {
			return fmt.Errorf("chown %s: %w", tmp, cerr)
		}
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if guard != nil {
		if err = guard(); err != nil {
			return err
		}
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp, path, err)
	}
	syncDir(dir)
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

// sameContent reports whether two files hold the same bytes. A missing b
// is simply "not the same".
func sameContent(a, b string) (bool, error) {
	fa, err := os.Open(a)
	if err != nil {
		return false, fmt.Errorf("open %s: %w", a, err)
	}
	defer fa.Close()
	fb, err := os.Open(b)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open %s: %w", b, err)
	}
	defer fb.Close()
	sa, err := fa.Stat()
	if err != nil {
		return false, err
	}
	sb, err := fb.Stat()
	if err != nil {
		return false, err
	}
	if !sb.Mode().IsRegular() || sa.Size() != sb.Size() {
		return false, nil
	}
	bufA, bufB := make([]byte, 64<<10), make([]byte, 64<<10)
	for {
		na, errA := io.ReadFull(fa, bufA)
		nb, errB := io.ReadFull(fb, bufB)
		if na != nb || !bytes.Equal(bufA[:na], bufB[:nb]) {
			return false, nil
		}
		if errA == io.EOF || errA == io.ErrUnexpectedEOF {
			return errB == io.EOF || errB == io.ErrUnexpectedEOF, nil
		}
		if errA != nil {
			return false, errA
		}
		if errB != nil {
			return false, nil
		}
	}
}

// readLimited reads a config file, refusing anything over MaxConfigSize.
func readLimited(path string) ([]byte, fs.FileInfo, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("%s is not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxConfigSize+1))
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(b) > MaxConfigSize {
		return nil, nil, fmt.Errorf("%s: %w (limit %d bytes)", path, ErrConfigTooLarge, MaxConfigSize)
	}
	return b, fi, nil
}

// removeStaleTemps deletes temporary files a previous run of ours left
// behind (a crash between create and rename).
func removeStaleTemps(dir string) (int, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return 0, nil
		}
		return 0, err
	}
	n := 0
	for _, e := range ents {
		if e.Type().IsRegular() && isOurTemp(e.Name()) {
			if err := os.Remove(filepath.Join(dir, e.Name())); err == nil {
				n++
			}
		}
	}
	return n, nil
}

// EnsurePrivateDir creates dir (and missing parents) readable only by its
// owner, or tightens an existing one to 0700. It is for what the plugin
// and agent share on the host (the agent socket, the enablement snapshot):
// only root may talk to the agent or read which namespaces are captured.
// A symlink or a non-directory at dir is refused rather than followed.
func EnsurePrivateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("stat %s: %w", dir, err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		return fmt.Errorf("%s is a symlink; refusing to use it as a private directory", dir)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s exists and is not a directory", dir)
	}
	if os.Geteuid() == 0 {
		if o := ownerOf(fi); o != nil && (o.uid != 0 || o.gid != 0) {
			if err := os.Lchown(dir, 0, 0); err != nil {
				return fmt.Errorf("chown %s to root: %w", dir, err)
			}
		}
	}
	if fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("chmod %s 0700: %w", dir, err)
		}
	}
	return nil
}
