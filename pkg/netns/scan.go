package netns

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"
)

// maxCgroupFile bounds how much of /proc/<pid>/cgroup is read; real files
// are a few hundred bytes.
const maxCgroupFile = 64 << 10

// Found is a pod's network namespace, held open. The namespace is the one
// that was checked: it was opened once, and the checks ran on that
// descriptor, so a process that exits afterwards, or a PID that is reused,
// cannot change what File refers to.
type Found struct {
	// PID of the pod's process the namespace was found through, for logs.
	PID int
	// ContainerID is that process's container, from its cgroup.
	ContainerID string
	// Netns identifies the namespace.
	Netns Identity
	// File is the open namespace (an nsfs file, named /proc/<pid>/ns/net
	// for logs). The caller owns it and must close it.
	File *os.File
}

// Close closes the held namespace.
func (f Found) Close() error {
	if f.File == nil {
		return nil
	}
	return f.File.Close()
}

// CloseAll closes every namespace in found.
func CloseAll(found map[types.UID]Found) {
	for _, f := range found {
		_ = f.Close()
	}
}

// Scanner walks a proc filesystem.
type Scanner struct {
	// ProcRoot is the host's proc mount; "" means /proc. It may belong to
	// another PID namespace (the host's, mounted in the agent's container).
	ProcRoot string
	// Logger receives a warning for each namespace that a pod's cgroup led
	// to but that failed the checks or could not become a handle; nil
	// discards them.
	Logger *slog.Logger

	// beforeOpen, in tests, runs between reading a process's cgroup and
	// opening its namespace.
	beforeOpen func(pid int)
}

func (s Scanner) root() string {
	if s.ProcRoot == "" {
		return "/proc"
	}
	return s.ProcRoot
}

func (s Scanner) log() *slog.Logger {
	if s.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Logger
}

// HostNetns identifies the network namespace this process runs in, read
// from /proc/self/ns/net: the agent runs in the host netns, PID 1's may be
// unreadable, and "self" under a host proc mounted from another PID
// namespace would not resolve to us.
func (s Scanner) HostNetns() (Identity, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		return Identity{}, fmt.Errorf("stat /proc/self/ns/net: %w", err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}, nil
}

// Find locates running pods' network namespaces with one Scan and turns
// each into a Handle: the pod controller's find step, between deciding and
// capturing. Scan confirms a namespace (not the host's, holds one of the
// pod's IPs) on the descriptor it opened, and the handle is adopted from
// that very descriptor, never by opening a /proc/<pid> path again, so a PID
// that exits or is reused after the check cannot swap the namespace. It
// returns an open handle per pod UID it could locate and confirm; the
// caller owns the handles. A pod without IPs cannot be confirmed and is
// left out, as is one whose namespace holds none of its IPs.
func (s Scanner) Find(pods map[types.UID][]netip.Addr) (map[types.UID]*Handle, error) {
	found, err := s.Scan(pods)
	if err != nil {
		return nil, err
	}
	out := make(map[types.UID]*Handle, len(found))
	for uid, f := range found {
		h, err := Adopt(f.File)
		if err != nil {
			s.log().Warn("cannot hold the netns found for a pod", "uid", uid, "pid", f.PID, "err", err)
			continue
		}
		out[uid] = h
	}
	return out, nil
}

// Scan makes one pass over the proc filesystem and returns, for each pod in
// pods (UID to its IPs), a held network namespace that a process of the pod
// is in, that is not the host's, and that has one of the pod's IPs on an
// interface. A pod without IPs cannot be confirmed and is never returned.
//
// Each candidate's /proc/<pid> directory is opened first and its cgroup
// file and ns/net are opened through that descriptor, so both come from the
// same process even if the PID is reused meanwhile; the checks run on the
// opened namespace, which is then returned as it is. The caller owns every
// returned File; everything else Scan opened is closed before it returns.
// Processes that vanish mid-scan are skipped.
func (s Scanner) Scan(pods map[types.UID][]netip.Addr) (map[types.UID]Found, error) {
	host, err := s.HostNetns()
	if err != nil {
		return nil, fmt.Errorf("identify host netns: %w", err)
	}
	root, err := os.Open(s.root())
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", s.root(), err)
	}
	names, err := root.Readdirnames(-1)
	_ = root.Close()
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", s.root(), err)
	}
	wanted := 0
	for _, ips := range pods {
		if len(ips) > 0 {
			wanted++
		}
	}
	out := make(map[types.UID]Found, wanted)
	// Namespaces already found wanting for a pod: its other processes
	// there need no second look.
	rejected := map[types.UID]map[Identity]bool{}
	for _, name := range names {
		if len(out) == wanted {
			break
		}
		pid, err := strconv.Atoi(name)
		if err != nil || pid <= 0 {
			continue
		}
		f, ok := s.candidate(pid, pods, out, rejected, host)
		if ok {
			out[f.uid] = f.Found
		}
	}
	return out, nil
}

type candidate struct {
	Found
	uid types.UID
}

// candidate looks at one process and returns its pod's held namespace if
// it is one Scan should return.
func (s Scanner) candidate(pid int, pods map[types.UID][]netip.Addr, out map[types.UID]Found,
	rejected map[types.UID]map[Identity]bool, host Identity) (candidate, bool) {
	dir := filepath.Join(s.root(), strconv.Itoa(pid))
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return candidate{}, false // gone
	}
	defer unix.Close(dfd)
	cg, err := readAt(dfd, "cgroup")
	if err != nil {
		return candidate{}, false // gone, or not ours to read
	}
	pc, err := ParseCgroup(cg)
	if err != nil {
		if !errors.Is(err, ErrNotPod) {
			s.log().Debug("ignoring process with an unusable cgroup file", "pid", pid, "err", err)
		}
		return candidate{}, false
	}
	ips := pods[pc.UID]
	if len(ips) == 0 {
		return candidate{}, false
	}
	if _, done := out[pc.UID]; done {
		return candidate{}, false
	}
	if s.beforeOpen != nil {
		s.beforeOpen(pid)
	}
	// Through the directory descriptor: if pid has exited (and perhaps
	// been reused) since the cgroup file was read, this fails rather than
	// open another process's namespace.
	nfd, err := unix.Openat(dfd, "ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return candidate{}, false
	}
	nsPath := filepath.Join(dir, "ns", "net")
	file := os.NewFile(uintptr(nfd), nsPath)
	keep := false
	defer func() {
		if !keep {
			_ = file.Close()
		}
	}()
	var st unix.Stat_t
	if err := unix.Fstat(nfd, &st); err != nil {
		return candidate{}, false
	}
	n := Identity{Dev: st.Dev, Ino: st.Ino}
	if n == host {
		// hostNetwork, or a process of the pod that left its sandbox:
		// never the pod's namespace.
		return candidate{}, false
	}
	if rejected[pc.UID][n] {
		return candidate{}, false
	}
	holds, err := HoldsAnyOf(file, ips)
	if err != nil || !holds {
		s.log().Warn("netns found by cgroup does not hold the pod's IPs; not touching it",
			"uid", pc.UID, "pid", pid, "netns", n.Ino, "err", err)
		if rejected[pc.UID] == nil {
			rejected[pc.UID] = map[Identity]bool{}
		}
		rejected[pc.UID][n] = true
		return candidate{}, false
	}
	keep = true
	return candidate{uid: pc.UID, Found: Found{PID: pid, ContainerID: pc.ContainerID, Netns: n, File: file}}, true
}

// readAt reads a small file below the directory descriptor dfd.
func readAt(dfd int, name string) ([]byte, error) {
	fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxCgroupFile+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxCgroupFile {
		return nil, fmt.Errorf("%s larger than %d bytes", name, maxCgroupFile)
	}
	return b, nil
}
