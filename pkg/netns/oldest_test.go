package netns

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestFindTakesTheSandboxProcess: a pod whose processes may create network
// namespaces (a user-namespaced pod is root in its own user namespace) can
// start a decoy in the pod's cgroup, in a namespace of its own holding a
// copy of the pod's IP. The decoy is always younger than the pod's sandbox
// process, which the runtime starts before any container, but /proc lists
// processes by PID and PIDs wrap, so it can come first. The scanner must
// take the pod's oldest process and nothing else: the decoy never wins, by
// PID or by holding the IP when the sandbox's namespace does not.
func TestFindTakesTheSandboxProcess(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "unshare", "nsenter", "sleep", "sh", "mount")
	hier := podproc.RequireHierarchies(t)
	for _, c := range []struct {
		name string
		// sandboxPID and decoyPID are what ns_last_pid is set to before
		// each starts; the sandbox always starts first.
		sandboxPID, decoyPID int
		// sandboxHasIP: the sandbox's namespace holds the pod's IP.
		sandboxHasIP bool
		// hostFirst: a process of the pod in the host's namespace starts
		// before the sandbox, with the lowest PID.
		hostFirst bool
	}{
		// PIDs wrapped: the younger decoy is listed first.
		{"decoy with a lower PID", 500, 100, true, false},
		// The sandbox's namespace fails the check: a younger process
		// holding the IP is no fallback.
		{"no fallback to a younger process", 100, 500, false, false},
		// A process in the host's namespace is never the pod's sandbox
		// (a runtime's helper placed in the pod's cgroup), however old.
		{"older process in the host's namespace", 500, 100, true, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			u, ip := randUID(), randIP()
			root := testnet.RandName("kubepods-test-", 8)
			// Cleanups run last first: the PID namespace (and every
			// process in it) goes before the netns and cgroups it used.
			sandboxCg := makeCgroup(t, hier, podproc.CgroupPath(podproc.Cgroupfs, root, string(u), testnet.RandName("", 64)))
			decoyCg := makeCgroup(t, hier, podproc.CgroupPath(podproc.Cgroupfs, root, string(u), testnet.RandName("", 64)))
			hostCg := makeCgroup(t, hier, podproc.CgroupPath(podproc.Cgroupfs, root, string(u), testnet.RandName("", 64)))
			sandboxIP := ip
			if !c.sandboxHasIP {
				sandboxIP = randIP()
			}
			sandboxNetns, decoyNetns := podNS(t, sandboxIP), podNS(t, ip)
			p := newPidns(t)

			if c.hostFirst {
				p.run(t, "echo 50 > /proc/sys/kernel/ns_last_pid; echo ok")
				helper := p.sleeper(t, "/proc/self/ns/net", hostCg)
				helperBorn := startTime(t, p.Proc, helper)
				poll.Until(t, "a clock tick after the host process started", func() bool { return bootTicks(t) > helperBorn })
			}
			p.run(t, fmt.Sprintf("echo %d > /proc/sys/kernel/ns_last_pid; echo ok", c.sandboxPID))
			sandbox := p.sleeper(t, sandboxNetns.Path(), sandboxCg)
			born := startTime(t, p.Proc, sandbox)
			// Start times count clock ticks: let one pass so the decoy
			// is younger, as a container's process always is.
			poll.Until(t, "a clock tick after the sandbox started", func() bool { return bootTicks(t) > born })
			p.run(t, fmt.Sprintf("echo %d > /proc/sys/kernel/ns_last_pid; echo ok", c.decoyPID))
			decoy := p.sleeper(t, decoyNetns.Path(), decoyCg)
			if decoyBorn := startTime(t, p.Proc, decoy); decoyBorn <= born {
				t.Fatalf("decoy started at tick %d, sandbox at %d: the test needs the decoy younger", decoyBorn, born)
			}
			if (decoy < sandbox) != (c.decoyPID < c.sandboxPID) {
				t.Fatalf("sandbox got PID %d, decoy %d: ns_last_pid was not followed", sandbox, decoy)
			}

			got, err := Scanner{ProcRoot: p.Proc}.Scan(map[types.UID][]netip.Addr{u: {ip}})
			if err != nil {
				t.Fatal(err)
			}
			defer CloseAll(got)
			f, ok := got[u]
			if !c.sandboxHasIP {
				if ok {
					t.Fatalf("found pid %d netns %+v; want nothing: the sandbox's namespace (pid %d) holds none of the pod's IPs, and the decoy (pid %d, netns %+v) must not stand in",
						f.PID, f.Netns, sandbox, decoy, netnsOf(t, decoyNetns.Path()))
				}
				return
			}
			if !ok {
				t.Fatalf("the pod was not found; want the sandbox's process %d", sandbox)
			}
			if want := netnsOf(t, sandboxNetns.Path()); f.PID != sandbox || f.Netns != want {
				t.Fatalf("found pid %d netns %+v; want the sandbox's pid %d netns %+v (decoy: pid %d netns %+v)",
					f.PID, f.Netns, sandbox, want, decoy, netnsOf(t, decoyNetns.Path()))
			}
		})
	}
}

// startTime is pid's start time in clock ticks since boot, as the scanner
// reads it.
func startTime(t *testing.T, proc string, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := parseStartTime(b)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// userHZ is the clock tick of /proc/<pid>/stat's times (USER_HZ), 100 on
// every architecture this project builds for.
const userHZ = 100

// bootTicks is the time since boot in the clock ticks of /proc/<pid>/stat.
func bootTicks(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano()) / (1e9 / userHZ)
}

func TestParseStartTime(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"1 (sleep) S 0 1 1 0 -1 4194560 95 0 0 0 0 0 0 0 20 0 1 0 4242 2179072 128 18446744073709551615", 4242, true},
		// A command name may hold spaces and parentheses: the fields
		// start after the last ')'.
		{"7 (a) b) (c) S 0 1 1 0 -1 4194560 95 0 0 0 0 0 0 0 20 0 1 0 99 2179072", 99, true},
		{"7 (x) S 0 1 1", 0, false},
		{"7 x S 0 1 1 0 -1 4194560 95 0 0 0 0 0 0 0 20 0 1 0 99", 0, false},
		{"7 (x) S 0 1 1 0 -1 4194560 95 0 0 0 0 0 0 0 20 0 1 0 -5 0", 0, false},
	} {
		got, err := parseStartTime([]byte(c.in))
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseStartTime(%q) = %d, %v; want %d, ok %v", c.in, got, err, c.want, c.ok)
		}
	}
}

// TestFindOldestTie: start times count clock ticks, so two processes can
// share one. The pod's oldest processes sharing a tick in one namespace
// are one answer; in two namespaces neither can be told to be the sandbox,
// and the pod is not found. A fake proc tree gives the start times; its
// ns/net links lead to real namespaces.
// fakeProc is a process in a fake proc tree: its start time and the path
// of its netns.
type fakeProc struct {
	start uint64
	netns string
}

func TestFindOldestTie(t *testing.T) {
	testnet.RequireRoot(t)
	u, ip := randUID(), randIP()
	root := testnet.RandName("kubepods-test-", 8)
	a, b := podNS(t, ip), podNS(t, ip)
	for _, c := range []struct {
		name string
		// procs: the pid's start time and netns path.
		procs map[int]fakeProc
		want  string // the found netns path, "" for none
	}{
		{"same namespace", map[int]fakeProc{7: {100, a.Path()}, 9: {100, a.Path()}, 3: {200, b.Path()}}, a.Path()},
		{"two namespaces", map[int]fakeProc{7: {100, a.Path()}, 9: {100, b.Path()}}, ""},
		{"an older one settles it", map[int]fakeProc{7: {100, a.Path()}, 9: {100, b.Path()}, 11: {99, b.Path()}}, b.Path()},
		{"the host's namespace never counts", map[int]fakeProc{7: {100, a.Path()}, 9: {100, b.Path()}, 11: {99, "/proc/self/ns/net"}, 13: {100, "/proc/self/ns/net"}}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			proc := t.TempDir()
			for pid, p := range c.procs {
				dir := filepath.Join(proc, strconv.Itoa(pid))
				if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
					t.Fatal(err)
				}
				cg := "0::/" + podproc.CgroupPath(podproc.Cgroupfs, root, string(u), testnet.RandName("", 64)) + "\n"
				stat := fmt.Sprintf("%d (sleep) S 1 1 1 0 -1 4194560 95 0 0 0 0 0 0 0 20 0 1 0 %d 2179072 128\n", pid, p.start)
				for name, body := range map[string]string{"cgroup": cg, "stat": stat} {
					if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				if err := os.Symlink(p.netns, filepath.Join(dir, "ns", "net")); err != nil {
					t.Fatal(err)
				}
			}
			got, err := Scanner{ProcRoot: proc}.Scan(map[types.UID][]netip.Addr{u: {ip}})
			if err != nil {
				t.Fatal(err)
			}
			defer CloseAll(got)
			f, ok := got[u]
			switch {
			case c.want == "" && ok:
				t.Fatalf("found pid %d netns %+v; want nothing", f.PID, f.Netns)
			case c.want != "" && !ok:
				t.Fatalf("not found; want netns %+v", netnsOf(t, c.want))
			case c.want != "" && f.Netns != netnsOf(t, c.want):
				t.Fatalf("found pid %d netns %+v; want %+v", f.PID, f.Netns, netnsOf(t, c.want))
			}
		})
	}
}
