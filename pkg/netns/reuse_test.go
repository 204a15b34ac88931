package netns

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"k8s.io/apimachinery/pkg/types"
)

// pidns is a shell running as PID 1 of a fresh PID namespace whose proc is
// mounted at Proc, taking commands on stdin. It lets a test choose PIDs
// (ns_last_pid) without touching the host's.
type pidns struct {
	Proc string
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
}

func newPidns(t *testing.T) *pidns {
	t.Helper()
	p := &pidns{Proc: t.TempDir()}
	// unshare without --mount: the proc mount lands in the test's own
	// mount namespace, where the scanner reads it.
	p.cmd = exec.Command("unshare", "--pid", "--fork", "sh", "-c",
		`mount -t proc proc "$1" || exit 1; echo ready; while read -r line; do eval "$line"; done`, "sh", p.Proc)
	var err error
	if p.in, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.out = bufio.NewReader(stdout)
	var stderr strings.Builder
	p.cmd.Stderr = &stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// PID 1 exiting kills everything else in the namespace.
		_ = p.in.Close()
		_ = p.cmd.Wait()
		if err := syscall.Unmount(p.Proc, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", p.Proc, err)
		}
		if t.Failed() {
			t.Logf("pid namespace shell stderr:\n%s", stderr.String())
		}
	})
	if line := p.line(t); line != "ready" {
		t.Fatalf("pid namespace shell: %q", line)
	}
	return p
}

func (p *pidns) line(t *testing.T) string {
	t.Helper()
	s, err := p.out.ReadString('\n')
	if err != nil {
		t.Fatalf("pid namespace shell: %v", err)
	}
	return strings.TrimSpace(s)
}

// run sends one shell line and returns the one line it prints.
func (p *pidns) run(t *testing.T, line string) string {
	t.Helper()
	if _, err := fmt.Fprintln(p.in, line); err != nil {
		t.Fatal(err)
	}
	return p.line(t)
}

// sleeper starts `sleep infinity` in the netns at netnsPath, moves it into
// the cgroup dirs, waits until it is in the netns and returns its PID as
// the namespace numbers it.
func (p *pidns) sleeper(t *testing.T, netnsPath string, cgroups []string) int {
	t.Helper()
	cmd := fmt.Sprintf("nsenter --net=%s sleep infinity & s=$!;", netnsPath)
	for _, d := range cgroups {
		cmd += fmt.Sprintf(" echo $s > %s/cgroup.procs;", d)
	}
	pid, err := strconv.Atoi(p.run(t, cmd+" echo $s"))
	if err != nil {
		t.Fatal(err)
	}
	p.waitNetns(t, pid, netnsPath)
	return pid
}

func (p *pidns) waitNetns(t *testing.T, pid int, netnsPath string) {
	t.Helper()
	want := netnsOf(t, netnsPath)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var st syscall.Stat_t
		err := syscall.Stat(filepath.Join(p.Proc, strconv.Itoa(pid), "ns", "net"), &st)
		if err == nil && (Identity{Dev: st.Dev, Ino: st.Ino}) == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d did not enter netns %s", pid, netnsPath)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestFindIgnoresReusedPID makes the pod's process exit after Find has read
// its cgroup file and gives its PID to a process outside the pod whose
// namespace even holds the pod's IP (the worst case: a namespace that
// passes every check). Find must not return that namespace: the cgroup file
// and the namespace are read through one /proc/<pid> directory descriptor,
// which never resolves to the PID's next owner.
func TestFindIgnoresReusedPID(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "unshare", "nsenter", "sleep", "sh", "mount")
	hier := podproc.RequireHierarchies(t)
	u, ip := randUID(), randIP()
	// Cleanups run last first: the PID namespace (and every process in
	// it) goes before the netns and cgroups it used.
	cg := makeCgroup(t, hier, podproc.CgroupPath(podproc.Cgroupfs, testnet.RandName("kubepods-test-", 8), string(u), testnet.RandName("", 64)))
	podNetns, impostorNetns := podNS(t, ip), podNS(t, ip)
	p := newPidns(t)
	pid := p.sleeper(t, podNetns.Path(), cg)

	reused := false
	s := Scanner{ProcRoot: p.Proc, beforeOpen: func(got int) {
		if got != pid || reused {
			return
		}
		reused = true
		// Kill and reap the pod's process, then have the next PID be its.
		p.run(t, fmt.Sprintf("kill -9 %d; wait %d; echo %d > /proc/sys/kernel/ns_last_pid; echo ok", pid, pid, pid-1))
		if again := p.sleeper(t, impostorNetns.Path(), nil); again != pid {
			t.Fatalf("PID %d not reused: the impostor got %d", pid, again)
		}
	}}
	before := testnet.OpenFDs(t)
	got, err := s.Scan(map[types.UID][]netip.Addr{u: {ip}})
	if err != nil {
		t.Fatal(err)
	}
	defer CloseAll(got)
	if !reused {
		t.Fatalf("the scanner never looked at the pod's process %d", pid)
	}
	// The impostor really is at the PID and would pass the IP check.
	imp, err := os.Open(filepath.Join(p.Proc, strconv.Itoa(pid), "ns", "net"))
	if err != nil {
		t.Fatal(err)
	}
	defer imp.Close()
	if ok, err := HoldsAnyOf(imp, []netip.Addr{ip}); err != nil || !ok {
		t.Fatalf("impostor's namespace holds %s = %v, %v; the test needs it to", ip, ok, err)
	}
	if f, ok := got[u]; ok {
		t.Fatalf("Find returned the reused PID's namespace %+v (pod's was %+v, impostor's %+v)",
			f.Netns, netnsOf(t, podNetns.Path()), netnsOf(t, impostorNetns.Path()))
	}
	if after := testnet.OpenFDs(t) - 1; after != before { // imp is open
		t.Errorf("%d descriptors open after Find, %d before", after, before)
	}
}
