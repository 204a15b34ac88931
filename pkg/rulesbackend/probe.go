package rulesbackend

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// iptablesUsable reports whether b's binaries exist, without running them.
func iptablesUsable(b iptables.Backend) bool {
	for _, f := range ruleset.Families {
		for _, bin := range []string{b.SaveCmd(f), b.RestoreCmd(f)} {
			if _, err := lookPath(bin); err != nil {
				return false
			}
		}
	}
	return true
}

// legacyTablesLoaded reports whether x_tables (iptables-legacy) is in use on
// the node at all: without it no pod can hold legacy rules, and checking
// for them can be skipped.
func legacyTablesLoaded() bool {
	for _, p := range []string{"/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"} {
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	return false
}

// ProbeNFTables checks, in a throwaway network namespace, that the kernel
// accepts what the nftables backend installs (inet tables with nat, route
// and filter base chains, sets). It leaves nothing behind.
func ProbeNFTables() error {
	errc := make(chan error, 1)
	go func() { errc <- probeInThreadNetns() }() // owner: ProbeNFTables, which waits for it
	return <-errc
}

// probeInThreadNetns runs the probe in a network namespace of the calling
// goroutine's own thread and puts the thread back where it was. Relying on
// the thread to die with the goroutine is not enough: when the goroutine
// ran on the process's main thread, the runtime keeps that thread (it
// cannot end the thread group leader), and /proc/self/ns/net, which names
// the leader's namespace and which the agent takes for the host's, would
// name the throwaway namespace from then on.
func probeInThreadNetns() error {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open this thread's network namespace: %w", err)
	}
	defer unix.Close(orig)
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("unshare network namespace: %w", err)
	}
	probeErr := nftables.Probe()
	if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
		// Stay locked: the thread is discarded (or, the main thread,
		// parked) instead of running other goroutines in the wrong place.
		return errors.Join(probeErr, fmt.Errorf("return to the original network namespace: %w", err))
	}
	runtime.UnlockOSThread()
	return probeErr
}

func lookPath(bin string) (string, error) { return exec.LookPath(bin) }
