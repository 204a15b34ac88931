package netns

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestFindUserNamespacedPod: a hostUsers: false pod's processes run in a
// user namespace of their own (its uid 0 is a high host uid), and its
// network namespace is created inside that user namespace, so owned by
// it, as containerd 2.x makes a user-namespaced sandbox's. Discovery keys
// on nothing of that: the scanner finds the pod by its kubelet cgroup and
// its IP like any other, and the agent, the host's root (whose
// capabilities cover namespaces a child user namespace owns), adopts the
// namespace and works inside it.
func TestFindUserNamespacedPod(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "sleep")
	selfUserns := nsIdentity(t, "/proc/self/ns/user")
	for _, d := range []struct {
		name string
		o    podproc.Options
	}{
		{"cgroupfs", podproc.Options{Driver: podproc.Cgroupfs}},
		{"systemd", podproc.Options{Driver: podproc.Systemd, QoS: podproc.Burstable}},
	} {
		t.Run(d.name, func(t *testing.T) {
			d.o.Root = testnet.RandName("kubepods-userns-", 8)
			uid, ip := randUID(), randIP()
			sb, err := podproc.StartUserNS(string(uid), d.o)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(sb.Stop)
			pid := sb.Cmd.Process.Pid
			netnsPath := fmt.Sprintf("/proc/%d/ns/net", pid)

			// The fixture is what it claims: its own user namespace,
			// uid 0 mapped to a host uid other than 0, and a network
			// namespace that user namespace owns.
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", pid))
			if err != nil {
				t.Fatal(err)
			}
			if f := strings.Fields(string(b)); len(f) != 3 || f[0] != "0" || f[1] != fmt.Sprint(podproc.UserNSHostID) || f[2] != "65536" {
				t.Fatalf("uid_map %q, want 0 %d 65536", b, podproc.UserNSHostID)
			}
			podUserns := nsIdentity(t, fmt.Sprintf("/proc/%d/ns/user", pid))
			if podUserns == selfUserns {
				t.Fatal("the pod process shares the test's user namespace")
			}
			if owner := netnsOwner(t, netnsPath); owner != podUserns {
				t.Fatalf("the pod's netns is owned by user namespace %+v, want the pod's %+v", owner, podUserns)
			}

			// The pod's IP, configured from the host as a CNI plugin does.
			if err := Do(netnsPath, func() error {
				lo, err := netlink.LinkByName("lo")
				if err != nil {
					return err
				}
				return netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(32, 32)}})
			}); err != nil {
				t.Fatalf("add %s in the pod's netns: %v", ip, err)
			}

			got, err := Scanner{}.Scan(map[types.UID][]netip.Addr{uid: {ip}})
			if err != nil {
				t.Fatal(err)
			}
			f, ok := got[uid]
			if !ok {
				CloseAll(got)
				t.Fatalf("the user-namespaced pod was not found (%d found)", len(got))
			}
			if f.PID != pid || f.ContainerID != sb.ContainerID || f.Netns != netnsOf(t, netnsPath) {
				CloseAll(got)
				t.Fatalf("found pid %d container %s netns %+v, want %d %s %+v", f.PID, f.ContainerID, f.Netns, pid, sb.ContainerID, netnsOf(t, netnsPath))
			}
			h, err := Adopt(f.File)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			// Inside the adopted namespace: the pod's address, and a
			// socket bound to it (what ztunnel's in-pod listeners need).
			err = Do(h.Path(), func() error {
				l, err := net.Listen("tcp", netip.AddrPortFrom(ip, 15001).String())
				if err != nil {
					return err
				}
				return l.Close()
			})
			if err != nil {
				t.Errorf("listen on %s:15001 inside the adopted namespace: %v", ip, err)
			}
			t.Logf("pid %d, uid_map %q, netns %+v owned by its user namespace: found and entered", pid, strings.TrimSpace(string(b)), f.Netns)
		})
	}
}

// nsIdentity is the identity of any namespace file.
func nsIdentity(t *testing.T, path string) Identity {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}
}

// netnsOwner is the user namespace that owns the network namespace at
// path (ioctl NS_GET_USERNS).
func netnsOwner(t *testing.T, path string) Identity {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		t.Fatalf("NS_GET_USERNS %s: %v", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}
}
