package rulesbackend

import (
	"os"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// ProbeNFTables from any goroutine leaves every thread of the process in
// the namespace the process has. (How the probe's thread gets back, also
// on the main thread, is pkg/netns's: its Do tests.)
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
