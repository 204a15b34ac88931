// Package podproc starts what kubelet leaves on a node for a running pod:
// a long-lived process inside the pod's network namespace, placed in a
// cgroup whose path carries the pod UID (cgroupfs or systemd layout, in
// every mounted hierarchy it is asked for). pkg/netns's tests and the
// kubelet simulator use it to exercise /proc-based netns discovery against
// real kernel state.
package podproc

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// Driver is a kubelet cgroup driver layout.
type Driver int

const (
	// Cgroupfs lays pods out as kubepods/<qos>/pod<uid>/<container-id>.
	Cgroupfs Driver = iota
	// Systemd lays pods out as kubepods.slice/kubepods-<qos>.slice/
	// kubepods-<qos>-pod<uid_>.slice/cri-containerd-<id>.scope.
	Systemd
)

// QoS is a pod's quality-of-service class, which names the kubelet cgroup
// the pod sits in. The zero value is BestEffort.
type QoS int

const (
	// BestEffort pods sit below kubepods/besteffort.
	BestEffort QoS = iota
	// Burstable pods sit below kubepods/burstable.
	Burstable
	// Guaranteed pods sit directly below kubepods.
	Guaranteed
)

// DefaultHierarchies returns the cgroup mounts to place the process in: one
// v1 controller and the v2 mount, so both line formats appear in
// /proc/<pid>/cgroup. Missing mounts are skipped.
func DefaultHierarchies() []string {
	return []string{"/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified"}
}

// RequireHierarchies returns the DefaultHierarchies that are mounted, and
// skips the test (fails it under CI) when none is.
func RequireHierarchies(t testing.TB) []string {
	t.Helper()
	var hier []string
	for _, h := range DefaultHierarchies() {
		if _, err := os.Stat(filepath.Join(h, "cgroup.procs")); err == nil {
			hier = append(hier, h)
		}
	}
	if len(hier) == 0 {
		testnet.Missing(t, fmt.Sprintf("none of the cgroup hierarchies %v is mounted", DefaultHierarchies()))
	}
	return hier
}

// Sandbox is a running pod process.
type Sandbox struct {
	UID         string
	ContainerID string
	Cmd         *exec.Cmd
	dirs        []string // cgroup dirs below each hierarchy, leaf last
}

// Options configure Start.
type Options struct {
	Driver Driver
	// Root is a per-test cgroup root segment so parallel runs never share
	// directories; it must contain "kubepods" for the path to be kubelet-shaped.
	Root string
	// Hierarchies overrides DefaultHierarchies.
	Hierarchies []string
	// QoS picks the pod's QoS cgroup; the zero value is BestEffort.
	QoS QoS
	// PIDNamespace, when set, is a PID namespace file (/proc/<pid>/ns/pid)
	// the process is started in, as a node agent in a PID namespace of its
	// own sees its node's pods only when they live there. Empty is the
	// caller's.
	PIDNamespace string
}

// CgroupPath returns a BestEffort pod's container cgroup path below a
// hierarchy.
func CgroupPath(d Driver, root, uid, containerID string) string {
	return CgroupPathQoS(d, BestEffort, root, uid, containerID)
}

// CgroupPathQoS returns the container cgroup path below a hierarchy of a pod
// of class q, laid out as kubelet's driver d does.
func CgroupPathQoS(d Driver, q QoS, root, uid, containerID string) string {
	qos := map[QoS]string{BestEffort: "besteffort", Burstable: "burstable"}[q]
	if d == Systemd {
		// systemd escapes the dashes of the uid; each slice repeats its
		// parents' names.
		pod := "kubepods-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice"
		parts := []string{root, "kubepods.slice"}
		if qos != "" {
			pod = "kubepods-" + qos + "-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice"
			parts = append(parts, "kubepods-"+qos+".slice")
		}
		return filepath.Join(append(parts, pod, "cri-containerd-"+containerID+".scope")...)
	}
	return filepath.Join(root, "kubepods", qos, "pod"+uid, containerID)
}

// Start runs `sleep infinity` inside the netns at netnsPath and moves it
// into the pod's cgroup. Call Stop to kill it and remove the cgroups.
func Start(uid, netnsPath string, o Options) (*Sandbox, error) {
	hier := o.Hierarchies
	if hier == nil {
		hier = DefaultHierarchies()
	}
	id := make([]byte, 32)
	_, _ = rand.Read(id)
	s := &Sandbox{UID: uid, ContainerID: hex.EncodeToString(id)}
	s.Cmd = exec.Command("nsenter", "--net="+netnsPath, "--", "sleep", "infinity")
	// No Pdeathsig: it fires when the forking OS thread exits, and netns
	// helpers end locked threads, which would kill the pod at random.
	if err := startIn(s.Cmd, o.PIDNamespace); err != nil {
		return nil, fmt.Errorf("start pod process: %w", err)
	}
	if err := waitInNetns(s.Cmd.Process.Pid, netnsPath); err != nil {
		s.Stop()
		return nil, err
	}
	rel := CgroupPathQoS(o.Driver, o.QoS, o.Root, uid, s.ContainerID)
	for _, h := range hier {
		if _, err := os.Stat(h); err != nil {
			continue
		}
		if err := s.place(h, rel); err != nil {
			s.Stop()
			return nil, err
		}
	}
	return s, nil
}

// UserNSHostID is where StartUserNS maps a pod's uids and gids 0-65535 on
// the host: kubelet's default for a hostUsers: false pod is a block of
// 65536 ids at a multiple of 65536, never 0.
const UserNSHostID = 65536 * 7

// StartUserNS runs `sleep infinity` as a user-namespaced pod's process
// (hostUsers: false): in a user namespace of its own mapping its ids
// 0-65535 to the host's from UserNSHostID, and in a new network namespace
// created inside that user namespace (so owned by it), as containerd 2.x
// makes a user-namespaced sandbox's; then it moves it into the pod's
// cgroup. The network namespace is /proc/<pid>/ns/net. Call Stop to kill
// it and remove the cgroups.
func StartUserNS(uid string, o Options) (*Sandbox, error) {
	hier := o.Hierarchies
	if hier == nil {
		hier = DefaultHierarchies()
	}
	id := make([]byte, 32)
	_, _ = rand.Read(id)
	s := &Sandbox{UID: uid, ContainerID: hex.EncodeToString(id)}
	// One clone makes both namespaces, so the new user namespace owns
	// the new network namespace; the id maps are written before sleep
	// runs (util-linux's unshare would need newuidmap for that).
	s.Cmd = exec.Command("sleep", "infinity")
	ids := []syscall.SysProcIDMap{{ContainerID: 0, HostID: UserNSHostID, Size: 65536}}
	s.Cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET, UidMappings: ids, GidMappings: ids}
	if err := startIn(s.Cmd, o.PIDNamespace); err != nil {
		return nil, fmt.Errorf("start user-namespaced pod process: %w", err)
	}
	if err := waitExec(s.Cmd.Process.Pid, "sleep"); err != nil {
		s.Stop()
		return nil, err
	}
	rel := CgroupPathQoS(o.Driver, o.QoS, o.Root, uid, s.ContainerID)
	for _, h := range hier {
		if _, err := os.Stat(h); err != nil {
			continue
		}
		if err := s.place(h, rel); err != nil {
			s.Stop()
			return nil, err
		}
	}
	return s, nil
}

// waitExec waits until pid runs comm, so callers never see it half-way
// (still the forked test binary).
func waitExec(pid int, comm string) error {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && strings.TrimSpace(string(b)) == comm {
			return nil
		}
		time.Sleep(2 * time.Millisecond)
	}
	return fmt.Errorf("pid %d did not become %s", pid, comm)
}

// startIn starts cmd with its PID in the PID namespace at pidns (the
// caller's when empty): an OS thread of its own joins the namespace for
// its children (setns with CLONE_NEWPID changes only where the thread's
// children go) and forks cmd. The thread is never handed back to the Go
// scheduler: it ends with its goroutine.
func startIn(cmd *exec.Cmd, pidns string) error {
	if pidns == "" {
		return cmd.Start()
	}
	f, err := os.Open(pidns)
	if err != nil {
		return fmt.Errorf("open PID namespace: %w", err)
	}
	defer f.Close()
	errc := make(chan error, 1)
	go func() { // owner: startIn, which waits for it
		runtime.LockOSThread()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWPID); err != nil {
			errc <- fmt.Errorf("join PID namespace %s: %w", pidns, err)
			return
		}
		errc <- cmd.Start()
	}()
	return <-errc
}

func (s *Sandbox) place(hier, rel string) error {
	// Every level below the hierarchy is ours (Options.Root is per test),
	// so Stop removes each one that is empty by then: the last pod out
	// takes the shared parents with it.
	cur := hier
	for _, seg := range strings.Split(rel, "/") {
		if seg == "" {
			continue
		}
		cur = filepath.Join(cur, seg)
		if err := os.Mkdir(cur, 0o755); err != nil && !os.IsExist(err) {
			return fmt.Errorf("create cgroup %s: %w", cur, err)
		}
		s.dirs = append(s.dirs, cur)
	}
	pid := strconv.Itoa(s.Cmd.Process.Pid)
	if err := os.WriteFile(filepath.Join(cur, "cgroup.procs"), []byte(pid), 0o644); err != nil {
		return fmt.Errorf("move pid %s into %s: %w", pid, cur, err)
	}
	return nil
}

// waitInNetns waits until nsenter has switched pid into the target netns,
// so callers never observe the process half-way (still in the host netns).
func waitInNetns(pid int, netnsPath string) error {
	var want syscall.Stat_t
	if err := syscall.Stat(netnsPath, &want); err != nil {
		return fmt.Errorf("stat netns %s: %w", netnsPath, err)
	}
	self := fmt.Sprintf("/proc/%d/ns/net", pid)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var st syscall.Stat_t
		if err := syscall.Stat(self, &st); err == nil && st.Dev == want.Dev && st.Ino == want.Ino {
			return nil
		}
		time.Sleep(2 * time.Millisecond)
	}
	return fmt.Errorf("pid %d did not enter netns %s", pid, netnsPath)
}

// Stop kills the process (nsenter execs sleep, so the PID is the sleeper)
// and removes the pod's cgroup directories, deepest first, with every
// parent below the hierarchy that no other pod still uses.
func (s *Sandbox) Stop() {
	if s.Cmd.Process != nil {
		_ = s.Cmd.Process.Kill()
		_ = s.Cmd.Wait()
	}
	for i := len(s.dirs) - 1; i >= 0; i-- {
		_ = os.Remove(s.dirs[i])
	}
	s.dirs = nil
}
