package netns

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"k8s.io/apimachinery/pkg/types"
)

// cgnsHelperEnv carries a cgnsRequest to this test binary re-run as the
// agent inside its own cgroup namespace.
const cgnsHelperEnv = "AMBIENT_PODNETNS_CGNS_HELPER"

type cgnsRequest struct {
	Pods map[types.UID][]netip.Addr
	// Show lists PIDs whose /proc/<pid>/cgroup the helper reports as it
	// sees them.
	Show []int
}

type cgnsReply struct {
	Self    string         // the helper's own /proc/self/cgroup
	Cgroups map[int]string // Show's cgroup files
	Found   map[types.UID]cgnsFound
	Err     string
}

type cgnsFound struct {
	PID         int
	ContainerID string
	Netns       Identity
}

// cgnsHelper runs Find as the agent would and prints a cgnsReply. It
// closes every namespace it was given.
func cgnsHelper(reqJSON string) int {
	var req cgnsRequest
	reply := cgnsReply{Cgroups: map[int]string{}, Found: map[types.UID]cgnsFound{}}
	if err := json.Unmarshal([]byte(reqJSON), &req); err != nil {
		reply.Err = err.Error()
	}
	self, _ := os.ReadFile("/proc/self/cgroup")
	reply.Self = string(self)
	for _, pid := range req.Show {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		reply.Cgroups[pid] = string(b)
	}
	if reply.Err == "" {
		found, err := Scanner{}.Scan(req.Pods)
		if err != nil {
			reply.Err = err.Error()
		}
		for uid, f := range found {
			reply.Found[uid] = cgnsFound{PID: f.PID, ContainerID: f.ContainerID, Netns: f.Netns}
		}
		CloseAll(found)
	}
	if err := json.NewEncoder(os.Stdout).Encode(reply); err != nil {
		return 2
	}
	return 0
}

// makeCgroup creates rel below each hierarchy and removes what it created,
// deepest first, when the test ends. It returns the leaf directories.
func makeCgroup(t *testing.T, hier []string, rel string) []string {
	t.Helper()
	var leaves, made []string
	t.Cleanup(func() {
		for i := len(made) - 1; i >= 0; i-- {
			if err := os.Remove(made[i]); err != nil && !os.IsNotExist(err) {
				t.Errorf("remove cgroup %s: %v", made[i], err)
			}
		}
	})
	for _, h := range hier {
		cur := h
		for _, seg := range strings.Split(rel, "/") {
			cur = filepath.Join(cur, seg)
			if err := os.Mkdir(cur, 0o755); err == nil {
				made = append(made, cur)
			} else if !os.IsExist(err) {
				t.Fatalf("create cgroup %s: %v", cur, err)
			}
		}
		leaves = append(leaves, cur)
	}
	return leaves
}

// TestFindInPrivateCgroupNamespace runs the scanner as an agent whose
// container has its own cgroup namespace (cgroupns=private, the default for
// unprivileged containers on cgroup v2): `unshare --cgroup` from inside a
// kubelet-shaped Burstable pod cgroup, in a v1 hierarchy and the v2 mount.
// Other pods then show as /../../pod<uid>/<id> and the like, without
// "kubepods".
func TestFindInPrivateCgroupNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nsenter", "sleep", "unshare", "sh")
	hier := podproc.RequireHierarchies(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []struct {
		name   string
		driver podproc.Driver
	}{{"cgroupfs", podproc.Cgroupfs}, {"systemd", podproc.Systemd}} {
		t.Run(d.name, func(t *testing.T) {
			root := testnet.RandName("kubepods-cgns-", 8)
			opts := func(q podproc.QoS) podproc.Options {
				return podproc.Options{Driver: d.driver, Root: root, QoS: q, Hierarchies: hier}
			}
			type pod struct {
				uid types.UID
				ip  netip.Addr
				sb  *podproc.Sandbox
			}
			var pods []pod
			for _, q := range []podproc.QoS{podproc.Burstable, podproc.BestEffort, podproc.Guaranteed} {
				p := pod{uid: randUID(), ip: randIP()}
				p.sb = startPod(t, p.uid, podNS(t, p.ip).Path(), opts(q))
				pods = append(pods, p)
			}
			// Must not be found: a hostNetwork pod (the host has its IP), a
			// pod whose process is in a namespace without its IP, and a
			// victim whose uid and IP a pod fakes with a pod-shaped cgroup
			// below its own container cgroup, in a namespace holding the
			// victim's IP.
			hostPod, wrongIP, victim := randUID(), randUID(), randUID()
			startPod(t, hostPod, "/proc/self/ns/net", opts(podproc.Burstable))
			startPod(t, wrongIP, podNS(t, randIP()).Path(), opts(podproc.Burstable))
			victimIP := randIP()
			spoofRoot := podproc.CgroupPathQoS(d.driver, podproc.Burstable, root, string(pods[0].uid), pods[0].sb.ContainerID)
			startPod(t, victim, podNS(t, victimIP).Path(), podproc.Options{Driver: d.driver, Root: spoofRoot, Hierarchies: hier})

			// The agent's own pod cgroup, the root of its cgroup namespace.
			agent := makeCgroup(t, hier, podproc.CgroupPathQoS(d.driver, podproc.Burstable, root, string(randUID()), testnet.RandName("", 64)))

			req := cgnsRequest{Pods: map[types.UID][]netip.Addr{
				hostPod: {netip.MustParseAddr("127.0.0.1")}, wrongIP: {randIP()}, victim: {victimIP},
			}}
			for _, p := range pods {
				req.Pods[p.uid] = []netip.Addr{p.ip}
				req.Show = append(req.Show, p.sb.Cmd.Process.Pid)
			}
			reqJSON, err := json.Marshal(req)
			if err != nil {
				t.Fatal(err)
			}
			// sh moves itself into the agent's cgroup in every hierarchy,
			// then becomes `unshare --cgroup <this test binary>`.
			script := `exe=$1; shift; for d in "$@"; do echo $$ > "$d/cgroup.procs" || exit 1; done; exec unshare --cgroup "$exe"`
			cmd := exec.Command("sh", append([]string{"-c", script, "sh", exe}, agent...)...)
			cmd.Env = append(os.Environ(), cgnsHelperEnv+"="+string(reqJSON))
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("agent in its own cgroup namespace: %v\n%s", err, stderr.String())
			}
			var reply cgnsReply
			if err := json.Unmarshal(out, &reply); err != nil {
				t.Fatalf("agent reply %q: %v", out, err)
			}
			if reply.Err != "" {
				t.Fatalf("agent: %s", reply.Err)
			}

			// The agent really is at the root of its own cgroup namespace
			// in every hierarchy the pods use, and sees them relatively.
			for _, h := range hier {
				if !hasCgroupLine(reply.Self, h, "/") {
					t.Fatalf("agent's own cgroup is not its namespace root in %s:\n%s", h, reply.Self)
				}
			}
			for pid, cg := range reply.Cgroups {
				if !strings.Contains(cg, ":/../") {
					t.Fatalf("agent sees pod process %d with absolute cgroup paths:\n%s", pid, cg)
				}
				if d.driver == podproc.Cgroupfs && strings.Contains(cg, "kubepods") {
					t.Fatalf("agent sees pod process %d with kubepods in its path:\n%s", pid, cg)
				}
				t.Logf("agent sees pid %d as:\n%s", pid, strings.TrimSpace(cg))
			}

			if len(reply.Found) != len(pods) {
				t.Errorf("found %d pods, want %d: %+v", len(reply.Found), len(pods), reply.Found)
			}
			for _, p := range pods {
				f, ok := reply.Found[p.uid]
				if !ok {
					t.Errorf("pod %s not found", p.uid)
					continue
				}
				wantNs := netnsOf(t, fmt.Sprintf("/proc/%d/ns/net", p.sb.Cmd.Process.Pid))
				if f.PID != p.sb.Cmd.Process.Pid || f.ContainerID != p.sb.ContainerID || f.Netns != wantNs {
					t.Errorf("pod %s: found %+v, want pid %d container %s netns %+v", p.uid, f, p.sb.Cmd.Process.Pid, p.sb.ContainerID, wantNs)
				}
			}
		})
	}
}

// hasCgroupLine reports whether the cgroup file content places the process
// at path in the hierarchy mounted at mount (v2 if it is a cgroup2 mount,
// else the v1 controller named by the mount's base name).
func hasCgroupLine(content, mount, path string) bool {
	v2 := false
	if _, err := os.Stat(filepath.Join(mount, "cgroup.controllers")); err == nil {
		v2 = true
	}
	ctrl := filepath.Base(mount)
	for line := range strings.SplitSeq(strings.TrimSpace(content), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || parts[2] != path {
			continue
		}
		if v2 && parts[0] == "0" && parts[1] == "" {
			return true
		}
		if !v2 && parts[0] != "0" && slices.Contains(strings.Split(parts[1], ","), ctrl) {
			return true
		}
	}
	return false
}
