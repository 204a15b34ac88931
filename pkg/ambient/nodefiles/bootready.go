package nodefiles

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// BootIDFile is the kernel's id of the running boot: a new random value at
// every boot, the same in every container of the node.
const BootIDFile = "/proc/sys/kernel/random/boot_id"

// maxBootIDBytes bounds the read of a boot id (36 characters and a newline).
const maxBootIDBytes = 64

// MarkBootReady writes the boot-ready marker (Layout.BootReady): the id of
// the running boot, read from bootIDFile (BootIDFile outside tests). The
// agent writes it once it is first ready after a boot; the plugin's CNI
// STATUS fails until then.
func MarkBootReady(l Layout, bootIDFile string) error {
	id, err := readSmall(bootIDFile)
	if err != nil {
		return fmt.Errorf("boot-ready marker: boot id: %w", err)
	}
	p := l.BootReady()
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("boot-ready marker: %w", err)
	}
	if err := atomicfile.WriteFile(p, append(bytes.TrimSpace(id), '\n'), atomicfile.Options{Mode: 0o600}); err != nil {
		return fmt.Errorf("boot-ready marker: %w", err)
	}
	return nil
}

// BootReady says whether an agent has been ready on this boot: the marker
// is in the run directory (tmpfs, emptied by a reboot) and names the boot
// the kernel runs now (bootIDFile), so a run directory on disk that
// outlived a reboot does not count either. nil means ready; the error
// says why not. It opens nothing that could block (a FIFO in the
// marker's place fails).
func BootReady(l Layout, bootIDFile string) error {
	got, err := readSmall(l.BootReady())
	if errors.Is(err, os.ErrNotExist) {
		return errors.New("no agent has been ready since the node booted")
	}
	if err != nil {
		return fmt.Errorf("no agent has been ready since the node booted: boot-ready marker: %w", err)
	}
	want, err := readSmall(bootIDFile)
	if err != nil {
		return fmt.Errorf("cannot tell whether an agent has been ready since the node booted: boot id: %w", err)
	}
	if !bytes.Equal(bytes.TrimSpace(got), bytes.TrimSpace(want)) || len(bytes.TrimSpace(want)) == 0 {
		return errors.New("no agent has been ready since the node booted (the boot-ready marker is of an earlier boot)")
	}
	return nil
}

// HeldSince is when CNI STATUS first held the node on this boot: the
// modification time of the hold marker (Layout.BootHeld), which names the
// boot; the first call of a boot writes it (now). A STATUS past its bound
// (PluginConf.StatusBootHold) no longer holds the node.
func HeldSince(l Layout, bootIDFile string, now time.Time) (time.Time, error) {
	want, err := readSmall(bootIDFile)
	if err != nil {
		return time.Time{}, fmt.Errorf("boot id: %w", err)
	}
	want = bytes.TrimSpace(want)
	p := l.BootHeld()
	if got, err := readSmall(p); err == nil && bytes.Equal(bytes.TrimSpace(got), want) {
		st, err := os.Lstat(p)
		if err != nil {
			return time.Time{}, fmt.Errorf("boot hold marker: %w", err)
		}
		return st.ModTime(), nil
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return time.Time{}, fmt.Errorf("boot hold marker: %w", err)
	}
	if err := atomicfile.WriteFile(p, append(want, '\n'), atomicfile.Options{Mode: 0o600}); err != nil {
		return time.Time{}, fmt.Errorf("boot hold marker: %w", err)
	}
	if err := os.Chtimes(p, now, now); err != nil {
		return time.Time{}, fmt.Errorf("boot hold marker: %w", err)
	}
	return now, nil
}

// ClearBootReady removes the boot-ready marker; missing is fine.
func ClearBootReady(l Layout) error {
	if err := os.Remove(l.BootReady()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove boot-ready marker: %w", err)
	}
	return nil
}

// readSmall reads a small regular file without following a symlink or
// blocking on a FIFO or device.
func readSmall(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxBootIDBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxBootIDBytes {
		return nil, fmt.Errorf("%s holds more than %d bytes", path, maxBootIDBytes)
	}
	return b, nil
}
