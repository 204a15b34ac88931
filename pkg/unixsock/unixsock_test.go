package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestEnsurePrivateDir(t *testing.T) {
	root := t.TempDir()
	d := filepath.Join(root, "run", "ambient-cni")
	if err := EnsurePrivateDir(d); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(d); fi.Mode().Perm() != 0o700 || !fi.IsDir() {
		t.Errorf("mode %v", fi.Mode())
	}
	loose := filepath.Join(root, "loose")
	if err := os.Mkdir(loose, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(loose, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := EnsurePrivateDir(loose); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(loose); fi.Mode().Perm() != 0o700 {
		t.Errorf("existing dir not tightened: %v", fi.Mode())
	}
	link := filepath.Join(root, "link")
	if err := os.Symlink(loose, link); err != nil {
		t.Fatal(err)
	}
	if err := EnsurePrivateDir(link); err == nil {
		t.Error("symlink accepted")
	}
	file := filepath.Join(root, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := EnsurePrivateDir(file); err == nil {
		t.Error("file accepted")
	}
}

func TestListenReplacesOnlySockets(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "run", "agent.sock")
	// A stale socket (a crashed process's) is replaced ...
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	_ = stale.Close()
	ln, err := Listen(Config{Path: sock, Net: "unix", Mode: 0o600, PrivateDir: true})
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %v, %v; want a 0600 socket", fi.Mode(), err)
	}
	if fi, _ := os.Stat(filepath.Dir(sock)); fi.Mode().Perm() != 0o700 {
		t.Errorf("socket dir %v, want 0700", fi.Mode().Perm())
	}
	if des, _ := os.ReadDir(filepath.Dir(sock)); len(des) != 1 {
		t.Errorf("left beside the socket: %v", des)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	_ = c.Close()
	_ = ln.Close()
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left after Close: %v", err)
	}
	// ... any other file is not.
	file := filepath.Join(dir, "file.sock")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(Config{Path: file, Net: "unixpacket"}); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("regular file at the socket path: %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "keep me" {
		t.Errorf("regular file changed")
	}
}

// TestCloseRemovesOnlyOurSocket: a process stopping after a newer one took
// over the path leaves the newer one's socket alone.
func TestCloseRemovesOnlyOurSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "zds.sock")
	older, err := Listen(Config{Path: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	newer, err := Listen(Config{Path: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	if err := older.Close(); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("unixpacket", sock)
	if err != nil {
		t.Fatalf("newer listener unreachable after the older one closed: %v", err)
	}
	_ = c.Close()
	_ = newer.Close()
	_ = newer.Close() // repeated Close is harmless
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left after the last listener closed: %v", err)
	}
}

// TestListenLongPath: when a private name would not fit in sun_path, the
// socket is bound in place.
func TestListenLongPath(t *testing.T) {
	dir := t.TempDir()
	// Pad the directory so the final path is exactly maxPath bytes with a
	// one-letter name, which leaves no room for the private name.
	pad := maxPath - len(dir) - len("/x") - 1
	if pad < 1 {
		t.Skipf("temp dir %s too long for this test", dir)
	}
	sub := filepath.Join(dir, strings.Repeat("d", pad))
	sock := filepath.Join(sub, "x")
	if len(sock) != maxPath {
		t.Fatalf("path length %d", len(sock))
	}
	ln, err := Listen(Config{Path: sock, Net: "unix", Mode: 0o600})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %v, %v", fi, err)
	}
}

func TestPeerCred(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := Listen(Config{Path: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := net.Dial("unix", sock); err == nil {
			defer c.Close()
			_, _ = c.Read(make([]byte, 1))
		}
	}()
	c, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cred, err := PeerCred(c)
	if err != nil {
		t.Fatal(err)
	}
	if int(cred.Pid) != os.Getpid() || int(cred.Uid) != os.Getuid() {
		t.Errorf("peer %+v, want pid %d uid %d", cred, os.Getpid(), os.Getuid())
	}
}
