package netns

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"
)

// DefaultRoots are where runtimes mount pod network namespaces:
// iproute2/CRI-O/containerd's default, and containerd's state dir when
// netns_mounts_under_state_dir is on.
var DefaultRoots = []string{
	"/var/run/netns",
	"/run/netns",
	"/run/containerd/io.containerd.grpc.v1.cri/netns",
}

// procNetns matches a process's network namespace link.
var procNetns = regexp.MustCompile(`^/proc/[1-9][0-9]{0,9}/ns/net$`)

// Policy decides which netns paths the agent accepts from the runtime: an
// nsfs mount below one of Roots (after resolving symlinks) or
// /proc/<pid>/ns/net.
type Policy struct {
	// Roots are where pod netns mounts may live; nil means DefaultRoots.
	Roots []string
	// ProcRoot is where the host's /proc is mounted in the agent's
	// container ("" or "/proc" when the agent shares the host PID
	// namespace): a /proc/<pid>/ns/net path from the plugin names a host
	// PID, so it is opened below ProcRoot.
	ProcRoot string
}

// Open validates path against the policy and opens it.
func (p Policy) Open(path string) (*Handle, error) {
	if !filepath.IsAbs(path) || strings.ContainsRune(path, 0) {
		return nil, invalid(fmt.Errorf("netns path %q is not absolute", path))
	}
	if procNetns.MatchString(path) {
		// A magic link, not a path to resolve: open it as it is, in the
		// host's PID namespace.
		if p.ProcRoot != "" && p.ProcRoot != "/proc" {
			return Open(filepath.Join(p.ProcRoot, strings.TrimPrefix(path, "/proc/")))
		}
		return Open(path)
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
		return nil, invalid(fmt.Errorf("netns %s (resolved %s) is not under an allowed root %v nor /proc/<pid>/ns/net", path, real, p.roots()))
	}
	// O_NOFOLLOW: the path was resolved above; a symlink swapped in since
	// then must not redirect us.
	fd, err := unix.Open(real, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, openError(real, err)
	}
	n, err := fromFD(fd, path)
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return n, nil
}

// Identify returns the identity of the network namespace at path, checked
// against the policy like Open, without holding it: enough to tell which
// namespace a CNI DEL names.
func (p Policy) Identify(path string) (Identity, error) {
	if !filepath.IsAbs(path) || strings.ContainsRune(path, 0) {
		return Identity{}, invalid(fmt.Errorf("netns path %q is not absolute", path))
	}
	real := path
	var err error
	if procNetns.MatchString(path) {
		if p.ProcRoot != "" && p.ProcRoot != "/proc" {
			real = filepath.Join(p.ProcRoot, strings.TrimPrefix(path, "/proc/"))
		}
	} else {
		if real, err = filepath.EvalSymlinks(path); err != nil {
			return Identity{}, fmt.Errorf("resolve netns path %s: %w", path, err)
		}
		if !p.allowed(real) {
			return Identity{}, invalid(fmt.Errorf("netns %s (resolved %s) is not under an allowed root %v nor /proc/<pid>/ns/net", path, real, p.roots()))
		}
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(real, &sfs); err != nil {
		return Identity{}, fmt.Errorf("statfs netns %s: %w", path, err)
	}
	if sfs.Type != unix.NSFS_MAGIC {
		return Identity{}, invalid(fmt.Errorf("netns %s is not an nsfs mount", path))
	}
	var st unix.Stat_t
	if err := unix.Stat(real, &st); err != nil {
		return Identity{}, fmt.Errorf("stat netns %s: %w", path, err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}, nil
}

// allowed reports whether real lies strictly below a root. Roots are
// resolved too (/var/run is usually a symlink to /run); missing roots are
// skipped.
func (p Policy) allowed(real string) bool {
	for _, r := range p.roots() {
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

func (p Policy) roots() []string {
	if p.Roots == nil {
		return DefaultRoots
	}
	return p.Roots
}
