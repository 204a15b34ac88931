package netns

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ErrInvalid marks what can never be a pod's network namespace as given: a
// path outside the policy, one that names nothing (gone, a socket, a
// process that exited), a file that is not a network namespace, the host's
// own. Callers tell it with errors.Is; the error's text gives the reason.
// Other errors (a refused open, a failed syscall) are the agent's.
var ErrInvalid = errors.New("not a pod network namespace")

type invalidError struct{ err error }

func (e invalidError) Error() string        { return e.err.Error() }
func (e invalidError) Unwrap() error        { return e.err }
func (e invalidError) Is(target error) bool { return target == ErrInvalid }

func invalid(err error) error { return invalidError{err} }

// Identity identifies one network namespace by the device and inode of its
// nsfs file, which is what makes two paths to it equal.
type Identity struct {
	Dev, Ino uint64
}

// Handle is an open handle on a pod network namespace. Holding it pins the
// namespace: what was validated is what gets entered, and the namespace
// stays usable for ZDS and rule removal until the agent lets go.
type Handle struct {
	f      *os.File
	source string
	id     Identity
}

// Open opens path and checks that it is a network namespace (an nsfs file
// of type CLONE_NEWNET) other than the agent's own, which is the host's. It
// does not restrict where the path lives; Policy does.
func Open(path string) (*Handle, error) {
	// O_NONBLOCK: a FIFO named as a netns must fail its checks, not block
	// the open waiting for a writer.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, openError(path, err)
	}
	n, err := fromFD(fd, path)
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return n, nil
}

// openError names the side of a failed open: a path that names nothing
// openable as a namespace (gone, a symlink where none may be, a socket, a
// process that exited) is the caller's; a refusal (EACCES, EPERM: the
// agent lacks a capability) or anything else is the agent's.
func openError(path string, err error) error {
	err = fmt.Errorf("open netns %s: %w", path, err)
	for _, e := range []error{unix.ENOENT, unix.ENOTDIR, unix.ELOOP, unix.ENXIO, unix.ESRCH, unix.ENAMETOOLONG, unix.ENODEV} {
		if errors.Is(err, e) {
			return invalid(err)
		}
	}
	return err
}

// Adopt takes over f, a namespace file that was opened and checked
// elsewhere (Scanner.Scan), and returns a handle on that same namespace:
// the checks of Open run on a duplicate of f's descriptor, and the unpinned
// reopen enters the namespace through it. Nothing is opened by path. f is
// closed in every case.
func Adopt(f *os.File) (*Handle, error) {
	defer f.Close()
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate netns descriptor %s: %w", f.Name(), err)
	}
	n, err := fromFD(fd, f.Name())
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return n, nil
}

// fromFD checks fd and, when it passes, returns a handle on its namespace;
// fd is closed on success.
func fromFD(fd int, path string) (*Handle, error) {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return nil, fmt.Errorf("statfs netns %s: %w", path, err)
	}
	if sfs.Type != unix.NSFS_MAGIC {
		return nil, invalid(fmt.Errorf("netns %s is not an nsfs mount (filesystem magic %#x)", path, sfs.Type))
	}
	typ, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil {
		return nil, fmt.Errorf("query namespace type of %s: %w", path, err)
	}
	if typ != unix.CLONE_NEWNET {
		return nil, invalid(fmt.Errorf("%s is a namespace, but not a network namespace", path))
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat netns %s: %w", path, err)
	}
	var host unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &host); err != nil {
		return nil, fmt.Errorf("stat the agent's own netns: %w", err)
	}
	if st.Dev == host.Dev && st.Ino == host.Ino {
		return nil, invalid(fmt.Errorf("netns %s is the host network namespace", path))
	}
	held, err := reopenUnpinned(fd, path)
	if err != nil {
		return nil, fmt.Errorf("reopen netns: %w", err)
	}
	return &Handle{f: os.NewFile(uintptr(held), path), source: path, id: Identity{Dev: st.Dev, Ino: st.Ino}}, nil
}

// reopenUnpinned returns a new descriptor for the namespace behind fd that
// does not go through the runtime's bind mount, so holding it never keeps
// the runtime from unmounting the netns path (umount without MNT_DETACH
// fails with EBUSY while a file opened through the mount is open). It
// enters the namespace and opens /proc/thread-self/ns/net there; fd itself
// is closed on success.
func reopenUnpinned(fd int, path string) (int, error) {
	nfd := -1
	err := doFD(fd, path, func() error {
		var err error
		nfd, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		return err
	})
	if err != nil {
		// Every descriptor but the result is closed before returning, so
		// the caller never sees one of ours still open.
		if nfd >= 0 {
			_ = unix.Close(nfd)
		}
		return -1, err
	}
	_ = unix.Close(fd)
	return nfd, nil
}

// Path names the held namespace for code that enters it by path (the rule
// applier, subprocesses): /proc/<agent pid>/fd/<fd>, valid while the
// handle is open.
func (n *Handle) Path() string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), n.f.Fd())
}

// Source is the path the namespace was opened from, for logs.
func (n *Handle) Source() string { return n.source }

// File is the open namespace file, e.g. to pass to ztunnel.
func (n *Handle) File() *os.File { return n.f }

// SameAs reports whether both handles are the same namespace.
func (n *Handle) SameAs(o *Handle) bool {
	return n != nil && o != nil && n.id == o.id
}

// ID is the namespace's inode number, as ip netns and /proc show it.
func (n *Handle) ID() uint64 { return n.id.Ino }

// Identity is the namespace's full identity (device and inode).
func (n *Handle) Identity() Identity { return n.id }

// Close releases the handle.
func (n *Handle) Close() error {
	if n == nil {
		return nil
	}
	return n.f.Close()
}
