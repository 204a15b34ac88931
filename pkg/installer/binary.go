package installer

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// stamp identifies one version of the installed binary cheaply, so a pass
// does not re-read megabytes when nothing touched the file.
type stamp struct {
	ok         bool
	ino        uint64
	size       int64
	mtim, ctim syscall.Timespec
	mode       fs.FileMode
}

// stampSettle is how long a file must have been left alone before its
// stamp is trusted. A write in the same timestamp tick as the stat that
// made a stamp can leave size, times and inode as they were ("racily
// clean", as git calls it); one that comes this much later cannot.
const stampSettle = time.Second

// trustedStamp is fi's stamp when the file last changed well before
// checked (a time taken before fi), else no stamp, so the next pass
// compares the content again.
func trustedStamp(fi fs.FileInfo, checked time.Time) stamp {
	s := stampOf(fi)
	if !s.ok || !time.Unix(s.ctim.Unix()).Before(checked.Add(-stampSettle)) {
		return stamp{}
	}
	return s
}

func stampOf(fi fs.FileInfo) stamp {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return stamp{}
	}
	return stamp{ok: true, ino: st.Ino, size: fi.Size(), mtim: st.Mtim, ctim: st.Ctim, mode: fi.Mode()}
}

// copyStamps remembers, per installed copy, the stamp of the version last
// proven identical to ours. Passes and Check both use it, under its own
// lock, so Check never waits for a pass.
type copyStamps struct {
	mu sync.Mutex
	m  map[string]stamp
}

// proven reports whether fi is the version of dst last proven ours.
func (c *copyStamps) proven(dst string, fi fs.FileInfo) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.m[dst]
	return s.ok && stampOf(fi) == s
}

func (c *copyStamps) set(dst string, s stamp) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.m[dst] = s
}

// isOurs reports whether dst is an executable copy of src that only its
// owner may write: by its stamp when one was proven, else by content,
// stamping it when it settled.
func (c *copyStamps) isOurs(src, dst string) (bool, error) {
	checked := time.Now() // before the stat: see trustedStamp
	fi, err := os.Stat(dst)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if c.proven(dst, fi) {
		return true, nil
	}
	// A copy that is not executable, or that group or others may write
	// (anyone could swap what the runtime runs as root), is replaced by
	// a 0755 one; a tighter mode an operator set is kept.
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 || fi.Mode().Perm()&0o022 != 0 {
		return false, nil
	}
	same, err := sameContent(src, dst)
	if err != nil || !same {
		return false, err
	}
	// fi was taken before the content was read, so it describes what was
	// compared or something older: a later change shows as a different
	// stamp.
	c.set(dst, trustedStamp(fi, checked))
	return true, nil
}

// ensureBinary keeps an identical executable copy of the plugin binary in
// every bin dir. Each copy is repaired on its own, so a directory that
// cannot be written does not hold back the others; any failure fails the
// pass, so the config is chained only once a runtime searching any of the
// dirs finds our binary.
func (i *Installer) ensureBinary(force bool) (time.Duration, error) {
	var errs []error
	for _, dst := range i.bins {
		wait, err := i.ensureCopy(dst, force)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if wait > 0 {
			// No token left: the rest waits for the pass Run schedules.
			return wait, errors.Join(errs...)
		}
	}
	return 0, errors.Join(errs...)
}

// ensureCopy copies the plugin binary to dst unless an identical
// executable copy is already there.
func (i *Installer) ensureCopy(dst string, force bool) (time.Duration, error) {
	ours, err := i.copies.isOurs(i.cfg.PluginBinary, dst)
	if err != nil {
		return 0, fmt.Errorf("compare plugin binary %s: %w", dst, err)
	}
	if ours {
		return 0, nil
	}
	if !force {
		if wait := i.limiter.take(time.Now()); wait > 0 {
			i.throttled.Add(1)
			return wait, nil
		}
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return 0, fmt.Errorf("create CNI bin dir: %w", err)
	}
	if err := atomicfile.CopyFile(i.cfg.PluginBinary, dst, atomicfile.Options{Mode: 0o755}); err != nil {
		return 0, fmt.Errorf("install plugin binary %s: %w", dst, err)
	}
	if i.testHookBinaryCopied != nil {
		i.testHookBinaryCopied()
	}
	// No stamp for the copy: a stat now would describe whatever is at the
	// path by then, and a writer may already have overwritten or replaced
	// our copy; stamping that would hide it from every later pass. The
	// pass our own rename triggers compares the content and stamps it.
	i.copies.set(dst, stamp{})
	i.binaryCopies.Add(1)
	if i.installed {
		i.countReinstall()
	}
	i.log.Info("installed plugin binary", "path", dst, "reinstall", i.installed)
	return 0, nil
}
