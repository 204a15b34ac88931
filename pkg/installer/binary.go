package installer

import (
	"fmt"
	"io/fs"
	"os"
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

// ensureBinary copies the plugin binary into BinDir unless an identical
// executable copy is already there.
func (i *Installer) ensureBinary(force bool) (time.Duration, error) {
	checked := time.Now() // before the stat: see trustedStamp
	fi, err := os.Stat(i.dst)
	if err == nil && i.binStamp.ok && stampOf(fi) == i.binStamp {
		return 0, nil
	}
	if err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
		same, err := sameContent(i.cfg.PluginBinary, i.dst)
		if err != nil {
			return 0, fmt.Errorf("compare plugin binary: %w", err)
		}
		if same {
			// fi was taken before the content was read, so it describes
			// what was compared or something older: a later change
			// shows as a different stamp.
			i.binStamp = trustedStamp(fi, checked)
			return 0, nil
		}
	}
	if !force {
		if wait := i.limiter.take(time.Now()); wait > 0 {
			i.throttled.Add(1)
			return wait, nil
		}
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return 0, fmt.Errorf("create CNI bin dir: %w", err)
	}
	if err := atomicfile.CopyFile(i.cfg.PluginBinary, i.dst, atomicfile.Options{Mode: 0o755}); err != nil {
		return 0, fmt.Errorf("install plugin binary: %w", err)
	}
	if i.testHookBinaryCopied != nil {
		i.testHookBinaryCopied()
	}
	// No stamp for the copy: a stat now would describe whatever is at the
	// path by then, and a writer may already have overwritten or replaced
	// our copy; stamping that would hide it from every later pass. The
	// pass our own rename triggers compares the content and stamps it.
	i.binStamp = stamp{}
	i.binaryCopies.Add(1)
	if i.installed {
		i.countReinstall()
	}
	i.log.Info("installed plugin binary", "path", i.dst, "reinstall", i.installed)
	return 0, nil
}
