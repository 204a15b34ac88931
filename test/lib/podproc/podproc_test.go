package podproc

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// A pod process started with PIDNamespace lives in that namespace (a
// /proc mounted there lists it), still in the pod's cgroup, and Stop
// leaves neither it nor its cgroups behind.
func TestStartInPIDNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	hier := RequireHierarchies(t)
	testnet.RequireCommands(t, "unshare", "nsenter", "sleep")
	init := exec.Command("unshare", "--pid", "--fork", "--kill-child", "sleep", "infinity")
	if err := init.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = init.Process.Kill(); _ = init.Wait() })
	var initPid string
	for deadline := time.Now().Add(30 * time.Second); initPid == ""; {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", init.Process.Pid, init.Process.Pid))
		if f := strings.Fields(string(b)); len(f) == 1 {
			initPid = f[0]
		} else if time.Now().After(deadline) {
			t.Fatal("unshare started no child")
		} else {
			time.Sleep(10 * time.Millisecond)
		}
	}
	pidns := "/proc/" + initPid + "/ns/pid"
	uid := "1b2c3d4e-0000-4000-8000-" + testnet.RandName("", 12)
	root := testnet.RandName("kubepods-test-", 8)
	sb, err := Start(uid, "/proc/self/ns/net", Options{Root: root, Hierarchies: hier, PIDNamespace: pidns})
	if err != nil {
		t.Fatal(err)
	}
	pid := sb.Cmd.Process.Pid
	var want, got syscall.Stat_t
	if err := syscall.Stat(pidns, &want); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/ns/pid", pid), &got); err != nil {
		t.Fatal(err)
	}
	if got.Ino != want.Ino {
		sb.Stop()
		t.Fatalf("pod process %d is in PID namespace %d, want %d", pid, got.Ino, want.Ino)
	}
	status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for l := range strings.SplitSeq(string(status), "\n") {
		if strings.HasPrefix(l, "NSpid:") && len(strings.Fields(l)) != 3 {
			t.Errorf("pod process %d: %q, want its PID here and in the namespace", pid, l)
		}
	}
	cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if !strings.Contains(string(cg), "/pod"+uid+"/"+sb.ContainerID) {
		t.Errorf("pod process %d is not in its pod cgroup:\n%s", pid, cg)
	}
	sb.Stop()
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/ns", pid)); err == nil {
		t.Errorf("pod process %d still runs after Stop", pid)
	}
	for _, h := range hier {
		if _, err := os.Stat(filepath.Join(h, root)); err == nil {
			t.Errorf("cgroup %s left behind", filepath.Join(h, root))
		}
	}
}
