package netns

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestProcPathsUseHostProcRoot: the plugin runs in the host PID namespace,
// the agent's container may not; /proc/<pid>/ns/net from the plugin must be
// opened under the mounted host proc, never the container's own /proc.
func TestProcPathsUseHostProcRoot(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	cmd := exec.Command("nsenter", "--net="+pod.Path(), "--", "sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// A stand-in host proc where "host PID" 4242 is that process.
	hostProc := t.TempDir()
	if err := os.Symlink(fmt.Sprintf("/proc/%d", cmd.Process.Pid), filepath.Join(hostProc, "4242")); err != nil {
		t.Fatal(err)
	}
	want, err := Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer want.Close()
	pol := Policy{Roots: DefaultRoots, ProcRoot: hostProc}
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err := pol.Open("/proc/4242/ns/net")
		if err == nil {
			same := n.SameAs(want)
			_ = n.Close()
			if same {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("/proc/4242/ns/net was not opened under the host proc root: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
