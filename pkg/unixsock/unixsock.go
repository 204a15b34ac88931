// Package unixsock owns the node agent's listening Unix sockets for the
// plugin event server and the ZDS server: it binds under a private name and
// renames the socket into place with its final mode, so peers never see the
// path missing or too open, a stale socket is replaced and any other kind
// of file is refused; it remembers the file it bound so closing removes the
// socket only while it is still ours; it reads peers' credentials, and
// serves HTTP on such a socket to root peers only (RootOnly).
package unixsock

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// maxPath is the longest socket path bind accepts: sun_path holds 108
// bytes including the terminating NUL.
const maxPath = 107

// Config describes one listening socket.
type Config struct {
	// Path is where the socket lives.
	Path string
	// Net is "unix" (stream) or "unixpacket" (SOCK_SEQPACKET).
	Net string
	// Mode, when non-zero, is the socket file's permission bits, set
	// before the socket appears at Path.
	Mode fs.FileMode
	// PrivateDir makes the socket's directory root-only first (see
	// EnsurePrivateDir); otherwise a missing directory is created 0755.
	PrivateDir bool
}

// Listener is a listening socket that knows which file it bound.
type Listener struct {
	*net.UnixListener
	path     string
	dev, ino uint64

	closeOnce sync.Once
	closeErr  error
}

// Listen binds cfg.Path. A socket already there (a previous agent's) is
// replaced; anything else is an error and is left alone.
func Listen(cfg Config) (*Listener, error) {
	path, dir := cfg.Path, filepath.Dir(cfg.Path)
	if cfg.PrivateDir {
		if err := EnsurePrivateDir(dir); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create socket dir %s: %w", dir, err)
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() != fs.ModeSocket {
		return nil, fmt.Errorf("%s exists and is not a socket; refusing to replace it", path)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	tmp := filepath.Join(dir, ".s"+hex.EncodeToString(rnd[:]))
	inPlace := len(tmp) > maxPath && len(tmp) > len(path)
	if inPlace {
		// No room for a private name: bind at the path itself, after
		// taking the stale socket away.
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
		tmp = path
	}
	ln, err := net.ListenUnix(cfg.Net, &net.UnixAddr{Name: tmp, Net: cfg.Net})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// Unlink only our own socket, and only in Close: a newer process may
	// own the path by then.
	ln.SetUnlinkOnClose(false)
	fail := func(err error) (*Listener, error) {
		_ = ln.Close()
		_ = os.Remove(tmp)
		return nil, err
	}
	if cfg.Mode != 0 {
		if err := os.Chmod(tmp, cfg.Mode.Perm()); err != nil {
			return fail(fmt.Errorf("restrict socket %s: %w", path, err))
		}
	}
	var st unix.Stat_t
	if err := unix.Lstat(tmp, &st); err != nil {
		return fail(fmt.Errorf("stat socket %s: %w", path, err))
	}
	if !inPlace {
		if err := os.Rename(tmp, path); err != nil {
			return fail(fmt.Errorf("move socket into place at %s: %w", path, err))
		}
	}
	return &Listener{UnixListener: ln, path: path, dev: st.Dev, ino: st.Ino}, nil
}

// Path is where the socket lives.
func (l *Listener) Path() string { return l.path }

// Close stops listening and removes the socket file if it is still the
// one Listen bound. Repeated calls return the first result.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		l.closeErr = l.UnixListener.Close()
		var st unix.Stat_t
		if unix.Lstat(l.path, &st) == nil && st.Dev == l.dev && st.Ino == l.ino {
			_ = os.Remove(l.path)
		}
	})
	return l.closeErr
}

// PeerCred returns the credentials (pid, uid, gid) of the process at the
// other end of c, as the kernel recorded them at connect time.
func PeerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// EnsurePrivateDir creates dir (and missing parents) readable only by its
// owner, or tightens an existing one to 0700 and, when running as root,
// hands it to root. It is for what the plugin and agent share on the host
// (the agent socket, the enablement snapshot, the DEL spool) and for the
// ZDS socket: only root may talk to the agent or read which namespaces are
// captured. A symlink or a non-directory at dir is refused, not followed.
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
		if st, ok := fi.Sys().(*unix.Stat_t); ok && (st.Uid != 0 || st.Gid != 0) {
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
