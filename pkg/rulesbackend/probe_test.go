package rulesbackend

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// init runs on the main goroutine, on the process's main thread; locking
// keeps TestMain there, so it can run the probe on the thread group
// leader: the case the runtime does not discard a thread for.
func init() { runtime.LockOSThread() }

// mainThreadProbe is what the probe did to the process's own namespace
// when run on the main thread ("" = nothing, or not run: not root).
var mainThreadProbe string

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		before, _ := os.Readlink("/proc/self/ns/net")
		err := probeInThreadNetns()
		runtime.LockOSThread() // it unlocked once; stay on the main thread
		if after, _ := os.Readlink("/proc/self/ns/net"); after != before {
			mainThreadProbe = fmt.Sprintf("/proc/self/ns/net is %s after the probe, was %s (probe error: %v)", after, before, err)
		}
	}
	runtime.UnlockOSThread()
	os.Exit(m.Run())
}

// Run on the main thread, the probe leaves the process's namespace (what
// /proc/self/ns/net names, "the host" to the agent) as it was.
func TestProbeOnTheMainThreadLeavesTheProcessNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	if mainThreadProbe != "" {
		t.Fatal(mainThreadProbe)
	}
}

// Run on any thread, the probe puts that thread back where it was.
func TestProbeLeavesTheThreadWhereItWas(t *testing.T) {
	testnet.RequireRoot(t)
	runtime.LockOSThread()
	before, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if err := probeInThreadNetns(); err != nil {
		t.Logf("probe: %v (the kernel may lack nftables; the thread must be back anyway)", err)
	}
	runtime.LockOSThread() // it unlocked once; read on the same thread
	defer runtime.UnlockOSThread()
	after, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("the probe left its thread in %s (was %s)", after, before)
	}
}

// ProbeNFTables from any goroutine leaves every thread of the process in
// the namespace the process has.
func TestProbeNFTablesLeavesNoThreadBehind(t *testing.T) {
	testnet.RequireRoot(t)
	self, _ := os.Readlink("/proc/self/ns/net")
	for range 20 {
		if err := ProbeNFTables(); err != nil {
			t.Skipf("nftables probe fails here: %v", err)
		}
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		ns, err := os.Readlink("/proc/self/task/" + task.Name() + "/ns/net")
		if err == nil && ns != self {
			t.Errorf("thread %s is in %s, the process in %s", task.Name(), ns, self)
		}
	}
}
