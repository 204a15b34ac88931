package nodefiles

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestBootReady: the marker counts only when it names the boot the kernel
// runs now; anything else in its place (missing, another boot's id, a
// FIFO, a symlink, a directory, a huge file) is "not ready", never a hang.
func TestBootReady(t *testing.T) {
	dir := t.TempDir()
	l := InDir(filepath.Join(dir, "run"))
	bootID := filepath.Join(dir, "boot_id")
	writeBootID := func(id string) {
		t.Helper()
		if err := os.WriteFile(bootID, []byte(id+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeBootID("11111111-2222-3333-4444-555555555555")
	if err := BootReady(l, bootID); err == nil || !strings.Contains(err.Error(), "since the node booted") {
		t.Fatalf("no marker: %v, want not ready", err)
	}
	if err := MarkBootReady(l, bootID); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(l.BootReady()); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("marker mode %v, %v", st, err)
	}
	if err := BootReady(l, bootID); err != nil {
		t.Fatalf("marker of this boot: %v", err)
	}
	writeBootID("99999999-2222-3333-4444-555555555555") // a reboot that kept the run directory
	if err := BootReady(l, bootID); err == nil || !strings.Contains(err.Error(), "earlier boot") {
		t.Fatalf("marker of an earlier boot: %v, want not ready", err)
	}
	if err := MarkBootReady(l, bootID); err != nil {
		t.Fatal(err)
	}
	if err := BootReady(l, bootID); err != nil {
		t.Fatalf("marker rewritten on the new boot: %v", err)
	}
	if err := BootReady(l, filepath.Join(dir, "no-boot-id")); err == nil {
		t.Error("no boot id to compare with: ready, want an error")
	}

	hostile := map[string]func(p string) error{
		"fifo":      func(p string) error { return syscall.Mkfifo(p, 0o600) },
		"directory": func(p string) error { return os.Mkdir(p, 0o700) },
		"symlink to the right id": func(p string) error {
			return os.Symlink(bootID, p)
		},
		"too large": func(p string) error { return os.WriteFile(p, []byte(strings.Repeat("x", 1<<20)), 0o600) },
		"empty":     func(p string) error { return os.WriteFile(p, nil, 0o600) },
	}
	for name, make := range hostile {
		t.Run(name, func(t *testing.T) {
			if err := ClearBootReady(l); err != nil {
				if err := os.RemoveAll(l.BootReady()); err != nil {
					t.Fatal(err)
				}
			}
			if err := make(l.BootReady()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = os.RemoveAll(l.BootReady()) })
			if err := BootReady(l, bootID); err == nil {
				t.Errorf("%s in the marker's place counts as ready", name)
			}
		})
	}
	if err := ClearBootReady(l); err != nil {
		t.Fatal(err)
	}
	if err := ClearBootReady(l); err != nil {
		t.Errorf("clearing a missing marker: %v", err)
	}
}
