package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
)

// Block is one measured or baseline block of a latency figure: what the
// machine looked like when it started.
type Block struct {
	// Arm is "baseline" (the chain alone) or "measured" (with the plugin).
	Arm string `json:"arm"`
	Rep int    `json:"rep"`
	// Load1 is the one-minute load average; BusyPct the share of all
	// CPUs busy over the last second before the block.
	Load1   float64 `json:"load1"`
	BusyPct float64 `json:"busyPct"`
	// Quiet says whether the machine was quiet within the bounded wait,
	// WaitedS how long the wait took.
	Quiet   bool    `json:"quiet"`
	WaitedS float64 `json:"waitedS"`
}

// quietCheck waits up to maxWait for a second in which at most busyPct of
// the machine's CPUs were busy (the benchmark's own processes idle: it runs
// between blocks), then goes on either way and says which.
type quietCheck struct {
	maxWait time.Duration
	busyPct float64
	logf    func(string, ...any)
}

func (q quietCheck) wait(ctx context.Context, label string) (Block, error) {
	start := time.Now()
	for {
		busy, err := busyOver(ctx, time.Second)
		if err != nil {
			return Block{}, err
		}
		b := Block{Load1: procstat.LoadAvg()[0], BusyPct: busy, Quiet: busy <= q.busyPct, WaitedS: time.Since(start).Seconds()}
		if b.Quiet {
			q.logf("  %s: load %.2f, %.0f%% busy: quiet", label, b.Load1, b.BusyPct)
			return b, nil
		}
		if time.Since(start) >= q.maxWait {
			q.logf("  %s: load %.2f, %.0f%% busy: not quiet after %.0f s, going on", label, b.Load1, b.BusyPct, b.WaitedS)
			return b, nil
		}
	}
}

// busyOver samples /proc/stat over d and returns the percentage of all
// CPUs' time that was not idle (idle and iowait count as idle).
func busyOver(ctx context.Context, d time.Duration) (float64, error) {
	t0, i0, err := readStatCPU()
	if err != nil {
		return 0, err
	}
	if err := sleep(ctx, d); err != nil {
		return 0, err
	}
	t1, i1, err := readStatCPU()
	if err != nil {
		return 0, err
	}
	if t1 <= t0 {
		return 0, nil
	}
	return 100 * float64((t1-t0)-(i1-i0)) / float64(t1-t0), nil
}

// readStatCPU returns the total and idle (idle + iowait) jiffies of the
// aggregate cpu line of /proc/stat.
func readStatCPU() (total, idle uint64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	return parseStatCPU(string(b))
}

func parseStatCPU(s string) (total, idle uint64, err error) {
	line, _, _ := strings.Cut(s, "\n")
	f := strings.Fields(line)
	if len(f) < 6 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("malformed /proc/stat line %q", line)
	}
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/stat field %d: %q", i+1, v)
		}
		// guest and guest_nice are already counted in user and nice.
		if i < 8 {
			total += n
		}
		if i == 3 || i == 4 {
			idle += n
		}
	}
	return total, idle, nil
}
