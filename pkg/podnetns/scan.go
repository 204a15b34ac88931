package podnetns

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// Netns identifies one network namespace by the device and inode of its
// nsfs file, which is what makes two /proc/<pid>/ns/net paths equal.
type Netns struct {
	Dev, Ino uint64
}

// Found is a pod's network namespace as seen through one of its processes.
type Found struct {
	// PID of a process of the pod living in the namespace.
	PID int
	// Path is /proc/<pid>/ns/net under the scanner's proc root.
	Path string
	// Netns identifies the namespace.
	Netns Netns
}

// Scanner walks a proc filesystem.
type Scanner struct {
	// ProcRoot is the proc mount; "" means /proc.
	ProcRoot string
}

func (s Scanner) root() string {
	if s.ProcRoot == "" {
		return "/proc"
	}
	return s.ProcRoot
}

// HostNetns identifies the network namespace this process runs in, read
// from /proc/self/ns/net: the agent runs in the host netns, PID 1's may be
// unreadable, and "self" under a host proc mounted from another PID
// namespace would not resolve to us.
func (s Scanner) HostNetns() (Netns, error) {
	return statNetns("/proc/self/ns/net")
}

// Scan makes one pass over the proc filesystem and returns, for each UID in
// want that has a running process outside the host network namespace, the
// first such process found. UIDs must be lower-case. Processes that vanish
// mid-scan are skipped.
func (s Scanner) Scan(want map[string]bool) (map[string]Found, error) {
	host, err := s.HostNetns()
	if err != nil {
		return nil, fmt.Errorf("identify host netns: %w", err)
	}
	entries, err := os.ReadDir(s.root())
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", s.root(), err)
	}
	out := make(map[string]Found, len(want))
	for _, e := range entries {
		if len(out) == len(want) {
			break
		}
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		dir := filepath.Join(s.root(), e.Name())
		cg, err := os.ReadFile(filepath.Join(dir, "cgroup"))
		if err != nil {
			continue // gone, or a kernel thread we may not read
		}
		uid, ok := PodUIDFromCgroup(cg)
		if !ok || !want[uid] {
			continue
		}
		if _, seen := out[uid]; seen {
			continue
		}
		path := filepath.Join(dir, "ns", "net")
		n, err := statNetns(path)
		if err != nil || n == host {
			// A process in the host netns (hostNetwork, or a dying
			// sandbox) must never be mistaken for the pod's namespace.
			continue
		}
		out[uid] = Found{PID: pid, Path: path, Netns: n}
	}
	return out, nil
}

func statNetns(path string) (Netns, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return Netns{}, fmt.Errorf("stat %s: %w", path, err)
	}
	return Netns{Dev: uint64(st.Dev), Ino: st.Ino}, nil
}
