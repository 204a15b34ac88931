package unixsock

import (
	"encoding/binary"
	"net"
	"os"
	"path/filepath"
	"testing"
)

func mustListened(t *testing.T, path string, want bool) {
	t.Helper()
	got, err := Listened(path)
	if err != nil {
		t.Fatalf("Listened(%s): %v", path, err)
	}
	if got != want {
		t.Fatalf("Listened(%s) = %v, want %v", path, got, want)
	}
}

// TestListened binds real sockets: a listener is seen at its file, also
// after the file is renamed into place (as the ZDS server binds), and
// nothing is seen once it is closed with its file left behind, at a
// socket file no one listens on, at a regular file or at a missing path.
func TestListened(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "ztunnel.sock")
	mustListened(t, sock, false)

	tmp := filepath.Join(dir, ".bind")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	defer ln.Close()
	if err := os.Rename(tmp, sock); err != nil {
		t.Fatal(err)
	}
	mustListened(t, sock, true)
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	mustListened(t, sock, false)

	// Bound, never listening.
	gram := filepath.Join(dir, "gram.sock")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: gram, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	mustListened(t, gram, false)

	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	mustListened(t, plain, false)
}

// diagMsg is one sock_diag answer as the kernel writes it: a
// unix_diag_msg and, with vfs, the UNIX_DIAG_VFS attribute.
func diagMsg(family byte, vfs []byte) []byte {
	m := make([]byte, sizeofDiagMsg)
	m[0] = family
	if vfs != nil {
		a := make([]byte, 4+len(vfs))
		binary.NativeEndian.PutUint16(a, uint16(len(a)))
		binary.NativeEndian.PutUint16(a[2:], unixDiagVFS)
		copy(a[4:], vfs)
		m = append(m, a...)
	}
	return m
}

func TestParseListeningRefusesMalformedAnswers(t *testing.T) {
	vfs := make([]byte, sizeofDiagVFS)
	binary.NativeEndian.PutUint32(vfs, 7)
	binary.NativeEndian.PutUint32(vfs[4:], 9)
	got, err := parseListening([][]byte{diagMsg(1, vfs), diagMsg(1, nil), diagMsg(2, vfs)})
	if err != nil || len(got) != 1 || got[0] != (boundFile{ino: 7, dev: 9}) {
		t.Fatalf("parseListening = %v, %v; want one file, ino 7 dev 9", got, err)
	}
	for name, m := range map[string][]byte{
		"short header":      {1, 0, 0},
		"short bound file":  diagMsg(1, []byte{1, 2, 3}),
		"attribute too big": append(diagMsg(1, nil), 0xff, 0x00, 0x01, 0x00),
	} {
		if got, err := parseListening([][]byte{m}); err == nil {
			t.Errorf("%s: parseListening = %v, want an error", name, got)
		}
	}
}

func FuzzParseListening(f *testing.F) {
	vfs := make([]byte, sizeofDiagVFS)
	f.Add(diagMsg(1, vfs))
	f.Add(diagMsg(1, nil))
	f.Add([]byte{1})
	f.Fuzz(func(t *testing.T, b []byte) {
		files, err := parseListening([][]byte{b})
		if err != nil && files != nil {
			t.Fatalf("files %v with error %v", files, err)
		}
	})
}
