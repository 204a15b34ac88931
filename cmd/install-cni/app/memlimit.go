package app

import (
	"log/slog"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// memoryLimitFraction is the share of the container's memory limit the Go
// runtime aims to stay under: the rest covers what the runtime does not
// count (thread stacks outside the heap, the kernel's page cache charged to
// the cgroup) and a burst before the GC catches up.
const memoryLimitFraction = 0.8

// cgroupMemoryFiles hold the container's memory limit: cgroup v2, then v1.
var cgroupMemoryFiles = []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}

// setMemoryLimit gives the Go runtime a soft memory limit below the
// container's, so the GC works harder before the kernel's OOM killer acts:
// without it the heap may grow to twice the live data and the pod is
// killed at its limit. An explicit GOMEMLIMIT wins (the runtime read it
// already); otherwise the limit comes from the cgroup's memory.max.
func setMemoryLimit(getenv func(string) string, log *slog.Logger) {
	if getenv("GOMEMLIMIT") != "" {
		log.Info("memory limit", "GOMEMLIMIT", getenv("GOMEMLIMIT"))
		return
	}
	for _, f := range cgroupMemoryFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		limit, ok := softMemoryLimit(string(b))
		if !ok {
			log.Info("memory limit: none (the container has no memory limit)", "file", f)
			return
		}
		debug.SetMemoryLimit(limit)
		log.Info("memory limit", "soft_limit_bytes", limit, "container_limit", strings.TrimSpace(string(b)), "file", f)
		return
	}
}

// softMemoryLimit turns a cgroup memory limit (memory.max: a byte count or
// "max"; v1's huge value for no limit) into the runtime's soft limit;
// false means no limit.
func softMemoryLimit(s string) (int64, bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	// cgroup v1 reports no limit as a page-rounded maximum (~8 EiB).
	if err != nil || n <= 0 || n >= 1<<62 {
		return 0, false
	}
	return int64(float64(n) * memoryLimitFraction), true
}

// returnStartupGarbage hands the memory freed since the start back to the
// kernel at once, not when the runtime's background scavenger gets to it:
// the initial list of a large cluster decoded every namespace whole
// (annotations and all) before the informer's transform cut it down, and
// that garbage's pages would otherwise stay resident until the scavenger
// returns them. It runs once, when the agent is ready: one forced
// collection, which blocks only the goroutine that asks for it.
func returnStartupGarbage() {
	debug.FreeOSMemory()
}
