package netns

import (
	"bytes"
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
	// reading its start time and opening its namespace.
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

// Find locates running pods' network namespaces (each pod's sandbox
// process's, see Scan) with one Scan and turns
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
// pods (UID to its IPs), the held network namespace of the pod's sandbox
// process, if that namespace is not the host's and has one of the pod's IPs
// on an interface. A pod without IPs cannot be confirmed and is never
// returned.
//
// The sandbox process is the pod's oldest: the one with the earliest start
// time among the processes whose cgroup names the pod and that are not in
// the host's namespace (the agent's own, never a pod's: a hostNetwork pod's
// processes, or a runtime's helper placed in the pod's cgroup, are there).
// The runtime starts it before any container, so a process the pod starts
// later, in a namespace of its own that holds a copy of the pod's IP, can
// never stand in for it, whatever its PID. Only the oldest process's
// namespace is checked: when it fails the checks the pod is not found, even
// if a younger process's namespace would pass them. Two processes of a pod
// started in the same clock tick in different namespaces leave the pod not
// found, as neither can be told to be the sandbox.
//
// Each candidate's /proc/<pid> directory is opened first and its cgroup,
// stat and ns/net files are opened through that descriptor, so all come
// from the same process even if the PID is reused meanwhile; the checks run
// on the opened namespace, which is then returned as it is. The caller owns
// every returned File; everything else Scan opened is closed before it
// returns. Processes that vanish mid-scan are skipped.
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
	// Every process of every wanted pod is looked at, so the oldest is
	// known only once the pass is over; until then each pod holds the
	// namespace of its oldest process so far.
	oldest := map[types.UID]*candidate{}
	defer func() {
		for _, c := range oldest {
			_ = c.Close()
		}
	}()
	for _, name := range names {
		pid, err := strconv.Atoi(name)
		if err != nil || pid <= 0 {
			continue
		}
		s.consider(pid, pods, oldest, host)
	}
	out := make(map[types.UID]Found, len(oldest))
	for uid, c := range oldest {
		if f, ok := s.confirm(uid, c, pods[uid]); ok {
			out[uid] = f
			delete(oldest, uid) // handed to the caller
		}
	}
	return out, nil
}

// candidate is the oldest process of a pod seen so far in a scan.
type candidate struct {
	Found
	start uint64
	// tied is set when a process started in the same tick is in another
	// namespace: which is the sandbox cannot be told.
	tied bool
}

// consider looks at one process and, if it belongs to a wanted pod, is not
// in the host's namespace and is older than the pod's oldest so far, makes
// it the pod's candidate.
func (s Scanner) consider(pid int, pods map[types.UID][]netip.Addr, oldest map[types.UID]*candidate, host Identity) {
	dir := filepath.Join(s.root(), strconv.Itoa(pid))
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return // gone
	}
	defer unix.Close(dfd)
	cg, err := readAt(dfd, "cgroup")
	if err != nil {
		return // gone, or not ours to read
	}
	pc, err := ParseCgroup(cg)
	if err != nil {
		if !errors.Is(err, ErrNotPod) {
			s.log().Debug("ignoring process with an unusable cgroup file", "pid", pid, "err", err)
		}
		return
	}
	if len(pods[pc.UID]) == 0 {
		return
	}
	if s.beforeOpen != nil {
		s.beforeOpen(pid)
	}
	// Through the directory descriptor: if pid has exited (and perhaps
	// been reused) since the cgroup file was read, these fail rather than
	// read another process's.
	stat, err := readAt(dfd, "stat")
	if err != nil {
		return
	}
	start, err := parseStartTime(stat)
	if err != nil {
		s.log().Debug("ignoring process with an unusable stat file", "pid", pid, "err", err)
		return
	}
	prev := oldest[pc.UID]
	if prev != nil && start > prev.start {
		return
	}
	nfd, err := unix.Openat(dfd, "ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	file := os.NewFile(uintptr(nfd), filepath.Join(dir, "ns", "net"))
	var st unix.Stat_t
	if err := unix.Fstat(nfd, &st); err != nil {
		_ = file.Close()
		return
	}
	n := Identity{Dev: st.Dev, Ino: st.Ino}
	if n == host {
		// hostNetwork, or a runtime's helper placed in the pod's cgroup:
		// never the pod's namespace, and no sandbox to compare with.
		_ = file.Close()
		return
	}
	if prev != nil && start == prev.start {
		if n != prev.Netns {
			prev.tied = true
		}
		_ = file.Close()
		return
	}
	if prev != nil {
		_ = prev.Close()
	}
	oldest[pc.UID] = &candidate{Found: Found{PID: pid, ContainerID: pc.ContainerID, Netns: n, File: file}, start: start}
}

// confirm checks the namespace of a pod's oldest process and returns it if
// it is the pod's.
func (s Scanner) confirm(uid types.UID, c *candidate, ips []netip.Addr) (Found, bool) {
	if c.tied {
		s.log().Warn("the pod's oldest processes started together in different netns; cannot tell its sandbox, not touching either",
			"uid", uid, "pid", c.PID)
		return Found{}, false
	}
	holds, err := HoldsAnyOf(c.File, ips)
	if err != nil || !holds {
		s.log().Warn("netns of the pod's sandbox process does not hold the pod's IPs; not touching it",
			"uid", uid, "pid", c.PID, "netns", c.Netns.Ino, "err", err)
		return Found{}, false
	}
	return c.Found, true
}

// parseStartTime returns the start time (field 22, clock ticks since boot)
// from a /proc/<pid>/stat file. The command name (field 2) may contain
// spaces and parentheses, so fields are counted from the last ')'.
func parseStartTime(stat []byte) (uint64, error) {
	end := bytes.LastIndexByte(stat, ')')
	if end < 0 {
		return 0, errors.New("stat has no command name")
	}
	fields := bytes.Fields(stat[end+1:])
	// fields[0] is field 3 (state).
	const startField = 22 - 3
	if len(fields) <= startField {
		return 0, fmt.Errorf("stat has %d fields after the command name, want more than %d", len(fields), startField)
	}
	start, err := strconv.ParseUint(string(fields[startField]), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("stat start time: %w", err)
	}
	return start, nil
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
