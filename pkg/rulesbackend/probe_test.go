package rulesbackend

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/testnet"
)

// probeHelperEnv makes the test binary run ProbeNFTables first thing in
// TestMain, on the main goroutine, as install-cni does when it builds its
// backend (app.New), and report the network namespaces of its threads.
const probeHelperEnv = "AMBIENT_PROBE_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(probeHelperEnv) == "1" {
		os.Exit(probeHelper())
	}
	os.Exit(m.Run())
}

// netnsOf reads a /proc namespace link.
func netnsOf(path string) string {
	l, err := os.Readlink(path)
	if err != nil {
		return "error: " + err.Error()
	}
	return l
}

// threadNetns lists the network namespace of every thread of the process.
func threadNetns() map[string]int {
	ents, _ := os.ReadDir("/proc/self/task")
	out := map[string]int{}
	for _, e := range ents {
		out[netnsOf("/proc/self/task/"+e.Name()+"/ns/net")]++
	}
	return out
}

func probeHelper() int {
	before := netnsOf("/proc/self/ns/net")
	if err := ProbeNFTables(); err != nil {
		fmt.Println("probe:", err)
	}
	after := netnsOf("/proc/self/ns/net")
	threads := threadNetns()
	fmt.Printf("process netns %s -> %s; threads %v\n", before, after, threads)
	if after != before || len(threads) != 1 {
		return 1
	}
	return 0
}

// TestProbeLeavesNoThreadInAnotherNetns: probing nftables support in a
// throwaway namespace must leave every thread of the process in its own
// namespace. It used to unshare on a locked thread and let the runtime
// discard it; but the main thread is never discarded (the runtime wedges
// it), and the probe's goroutine runs on the main thread when the main
// goroutine calls it and waits, as install-cni does. /proc/self/ns/net
// (the main thread's) then named the throwaway namespace: the agent put the
// host probe SNAT there instead of in the node's namespace, and its "is
// this the host netns" check compared against the wrong one.
func TestProbeLeavesNoThreadInAnotherNetns(t *testing.T) {
	testnet.RequireRoot(t)
	for range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), probeHelperEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("a thread was left in another network namespace: %v\n%s", err, strings.TrimSpace(string(out)))
		}
		t.Logf("%s", strings.TrimSpace(string(out)))
	}
}
