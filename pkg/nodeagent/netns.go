package nodeagent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// Netns is an open handle on a pod network namespace. Holding it pins the
// namespace: what was validated is what gets entered, and the namespace
// stays usable for ZDS and rule removal until the agent lets go.
type Netns struct {
	f        *os.File
	source   string
	dev, ino uint64
}

// OpenNetns opens path and checks that it is a network namespace (an nsfs
// file of type CLONE_NEWNET) other than the agent's own, which is the
// host's. It does not restrict where the path lives; NetnsPolicy does.
func OpenNetns(path string) (*Netns, error) {
	// O_NONBLOCK: a FIFO named as a netns must fail its checks, not block
	// the open waiting for a writer.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, openError(path, err)
	}
	n, err := netnsFromFD(fd, path)
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

// adoptNetns takes over f, a namespace file that was opened and checked
// elsewhere (podnetns.Scanner.Find), and returns a handle on that same
// namespace: the checks of OpenNetns run on a duplicate of f's descriptor,
// and the unpinned reopen enters the namespace through it. Nothing is opened
// by path. f is closed in every case.
func adoptNetns(f *os.File) (*Netns, error) {
	defer f.Close()
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate netns descriptor %s: %w", f.Name(), err)
	}
	n, err := netnsFromFD(fd, f.Name())
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return n, nil
}

func netnsFromFD(fd int, path string) (*Netns, error) {
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
	held, err := reopenUnpinned(fd)
	if err != nil {
		return nil, fmt.Errorf("reopen netns %s: %w", path, err)
	}
	return &Netns{f: os.NewFile(uintptr(held), path), source: path, dev: st.Dev, ino: st.Ino}, nil
}

// reopenUnpinned returns a new descriptor for the namespace behind fd that
// does not go through the runtime's bind mount, so holding it never keeps
// the runtime from unmounting the netns path (umount without MNT_DETACH
// fails with EBUSY while a file opened through the mount is open). It
// enters the namespace on a throwaway locked thread and opens
// /proc/thread-self/ns/net there; fd itself is closed on success.
func reopenUnpinned(fd int) (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Every descriptor but the result is closed before the result is
		// sent, so the caller never sees one of ours still open.
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{-1, err}
			return
		}
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			_ = unix.Close(orig)
			runtime.UnlockOSThread()
			ch <- result{-1, fmt.Errorf("setns: %w", err)}
			return
		}
		nfd, oerr := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		err = unix.Setns(orig, unix.CLONE_NEWNET)
		_ = unix.Close(orig)
		if err != nil {
			// The thread stays locked and dies with this goroutine rather
			// than run other goroutines in the pod's namespace.
			if oerr == nil {
				_ = unix.Close(nfd)
			}
			ch <- result{-1, fmt.Errorf("return to the agent's netns: %w", err)}
			return
		}
		runtime.UnlockOSThread()
		ch <- result{nfd, oerr}
	}()
	r := <-ch
	if r.err != nil {
		return -1, r.err
	}
	_ = unix.Close(fd)
	return r.fd, nil
}

// Path names the held namespace for code that enters it by path (the rule
// applier, subprocesses): /proc/<agent pid>/fd/<fd>, valid while the
// handle is open.
func (n *Netns) Path() string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), n.f.Fd())
}

// Source is the path the namespace was opened from, for logs.
func (n *Netns) Source() string { return n.source }

// File is the open namespace file, e.g. to pass to ztunnel.
func (n *Netns) File() *os.File { return n.f }

// SameAs reports whether both handles are the same namespace.
func (n *Netns) SameAs(o *Netns) bool {
	return n != nil && o != nil && n.dev == o.dev && n.ino == o.ino
}

// ID is the namespace's inode number, as ip netns and /proc show it.
func (n *Netns) ID() uint64 { return n.ino }

// id is the namespace's full identity (device and inode).
func (n *Netns) id() nsID { return nsID{n.dev, n.ino} }

// Close releases the handle.
func (n *Netns) Close() error {
	if n == nil {
		return nil
	}
	return n.f.Close()
}

// DefaultNetnsRoots are where runtimes mount pod network namespaces:
// iproute2/CRI-O/containerd's default, and containerd's state dir when
// netns_mounts_under_state_dir is on.
var DefaultNetnsRoots = []string{
	"/var/run/netns",
	"/run/netns",
	"/run/containerd/io.containerd.grpc.v1.cri/netns",
}

// procNetns matches a process's network namespace link.
var procNetns = regexp.MustCompile(`^/proc/[1-9][0-9]{0,9}/ns/net$`)

// NetnsPolicy decides which netns paths the event server accepts: an nsfs
// mount below one of Roots (after resolving symlinks) or /proc/<pid>/ns/net.
type NetnsPolicy struct {
	Roots []string
	// ProcRoot is where the host's /proc is mounted in the agent's
	// container ("" or "/proc" when the agent shares the host PID
	// namespace): a /proc/<pid>/ns/net path from the plugin names a host
	// PID, so it is opened below ProcRoot.
	ProcRoot string
}

// Open validates path against the policy and opens it.
func (p NetnsPolicy) Open(path string) (*Netns, error) {
	if !filepath.IsAbs(path) || strings.ContainsRune(path, 0) {
		return nil, invalid(fmt.Errorf("netns path %q is not absolute", path))
	}
	if procNetns.MatchString(path) {
		// A magic link, not a path to resolve: open it as it is, in the
		// host's PID namespace.
		if p.ProcRoot != "" && p.ProcRoot != "/proc" {
			return OpenNetns(filepath.Join(p.ProcRoot, strings.TrimPrefix(path, "/proc/")))
		}
		return OpenNetns(path)
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, invalid(fmt.Errorf("netns %s does not exist", path))
		}
		if errors.Is(err, os.ErrPermission) {
			// The agent's own rights, not the caller's path.
			return nil, fmt.Errorf("resolve netns path %s: %w", path, err)
		}
		// Not a directory on the way, a symlink loop, a name too long:
		// the path the runtime passed cannot name a namespace.
		return nil, invalid(fmt.Errorf("resolve netns path %s: %w", path, err))
	}
	if !p.allowed(real) {
		return nil, invalid(fmt.Errorf("netns %s (resolved %s) is not under an allowed root %v nor /proc/<pid>/ns/net", path, real, p.Roots))
	}
	// O_NOFOLLOW: the path was resolved above; a symlink swapped in since
	// then must not redirect us.
	fd, err := unix.Open(real, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, openError(real, err)
	}
	n, err := netnsFromFD(fd, path)
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return n, nil
}

// Identify returns the identity (nsfs device and inode) of the network
// namespace at path, checked against the policy like Open, without
// holding it: enough to tell which namespace a CNI DEL names.
func (p NetnsPolicy) Identify(path string) (dev, ino uint64, err error) {
	if !filepath.IsAbs(path) || strings.ContainsRune(path, 0) {
		return 0, 0, invalid(fmt.Errorf("netns path %q is not absolute", path))
	}
	real := path
	if procNetns.MatchString(path) {
		if p.ProcRoot != "" && p.ProcRoot != "/proc" {
			real = filepath.Join(p.ProcRoot, strings.TrimPrefix(path, "/proc/"))
		}
	} else {
		if real, err = filepath.EvalSymlinks(path); err != nil {
			return 0, 0, fmt.Errorf("resolve netns path %s: %w", path, err)
		}
		if !p.allowed(real) {
			return 0, 0, invalid(fmt.Errorf("netns %s (resolved %s) is not under an allowed root %v nor /proc/<pid>/ns/net", path, real, p.Roots))
		}
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(real, &sfs); err != nil {
		return 0, 0, fmt.Errorf("statfs netns %s: %w", path, err)
	}
	if sfs.Type != unix.NSFS_MAGIC {
		return 0, 0, invalid(fmt.Errorf("netns %s is not an nsfs mount", path))
	}
	var st unix.Stat_t
	if err := unix.Stat(real, &st); err != nil {
		return 0, 0, fmt.Errorf("stat netns %s: %w", path, err)
	}
	return st.Dev, st.Ino, nil
}

// allowed reports whether real lies strictly below a root. Roots are
// resolved too (/var/run is usually a symlink to /run); missing roots are
// skipped.
func (p NetnsPolicy) allowed(real string) bool {
	for _, r := range p.Roots {
		rr, err := filepath.EvalSymlinks(r)
		if err != nil {
			continue
		}
		if rr != "/" && strings.HasPrefix(real, rr+"/") {
			return true
		}
	}
	return false
}
