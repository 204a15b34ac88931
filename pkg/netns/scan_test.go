package netns

import (
	"crypto/rand"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"k8s.io/apimachinery/pkg/types"
)

func TestMain(m *testing.M) {
	// The private-cgroup-namespace test re-runs this binary as the agent.
	if req := os.Getenv(cgnsHelperEnv); req != "" {
		os.Exit(cgnsHelper(req))
	}
	enterOnMainThread()
	os.Exit(m.Run())
}

func randUID() types.UID {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return types.UID(fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]))
}

// randIP returns an address from 10.200.0.0-10.249.255.255, only ever
// configured inside namespaces the test made.
func randIP() netip.Addr {
	var b [3]byte
	_, _ = rand.Read(b[:])
	return netip.AddrFrom4([4]byte{10, 200 + b[0]%50, b[1], b[2]})
}

// podNS creates a netns with ip on its loopback.
func podNS(t *testing.T, ip netip.Addr) ns.NetNS {
	t.Helper()
	n := testnet.NewNS(t)
	if err := n.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())}})
	}); err != nil {
		t.Fatalf("add %s: %v", ip, err)
	}
	return n
}

// startPod starts a process of pod uid in the netns at path, in the pod's
// kubelet-shaped cgroup.
func startPod(t *testing.T, uid types.UID, path string, o podproc.Options) *podproc.Sandbox {
	t.Helper()
	sb, err := podproc.Start(string(uid), path, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sb.Stop)
	return sb
}

func netnsOf(t *testing.T, path string) Identity {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}
}

func TestFindHoldsCheckedNamespaces(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nsenter", "sleep")
	root := testnet.RandName("kubepods-test-", 8)
	a, b, hostPod, wrongIP, noIPs, absent := randUID(), randUID(), randUID(), randUID(), randUID(), randUID()
	ipA, ipB := randIP(), randIP()
	nsA, nsB := podNS(t, ipA), podNS(t, ipB)
	sbA := startPod(t, a, nsA.Path(), podproc.Options{Driver: podproc.Cgroupfs, Root: root})
	sbB := startPod(t, b, nsB.Path(), podproc.Options{Driver: podproc.Systemd, Root: root, QoS: podproc.Burstable})
	// A process of a pod that lives in the host netns (hostNetwork, or a
	// leftover) must never be returned, even if the host had its IP.
	startPod(t, hostPod, "/proc/self/ns/net", podproc.Options{Root: root})
	// A pod whose process sits in a namespace without the pod's IP.
	startPod(t, wrongIP, podNS(t, randIP()).Path(), podproc.Options{Root: root, QoS: podproc.Guaranteed})
	// A pod without IPs cannot be confirmed.
	startPod(t, noIPs, podNS(t, randIP()).Path(), podproc.Options{Root: root})

	want := map[types.UID][]netip.Addr{
		a: {randIP(), ipA}, b: {ipB}, hostPod: {netip.MustParseAddr("127.0.0.1")},
		wrongIP: {randIP()}, noIPs: nil, absent: {randIP()},
	}
	s := Scanner{}
	// Warm up whatever the runtime opens once (netlink, epoll) before
	// counting descriptors.
	findAndClose(t, s, want)
	before := testnet.OpenFDs(t)

	got, err := s.Scan(want)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		CloseAll(got)
		t.Fatalf("Find found %d pods, want 2: %+v", len(got), got)
	}
	if held := testnet.OpenFDs(t); held != before+2 {
		t.Errorf("holding 2 namespaces: %d descriptors open, want %d+2", held, before)
	}
	for uid, w := range map[types.UID]struct {
		n  ns.NetNS
		sb *podproc.Sandbox
	}{a: {nsA, sbA}, b: {nsB, sbB}} {
		f := got[uid]
		if f.PID != w.sb.Cmd.Process.Pid || f.ContainerID != w.sb.ContainerID {
			t.Errorf("%s: pid %d container %s, want %d %s", uid, f.PID, f.ContainerID, w.sb.Cmd.Process.Pid, w.sb.ContainerID)
		}
		if wantNs := netnsOf(t, w.n.Path()); f.Netns != wantNs {
			t.Errorf("%s: netns %+v, want %+v", uid, f.Netns, wantNs)
		}
		if held := netnsOf(t, fmt.Sprintf("/proc/self/fd/%d", f.File.Fd())); held != f.Netns {
			t.Errorf("%s: file holds %+v, Found says %+v", uid, held, f.Netns)
		}
	}

	// The pod's process exits and nothing else keeps its namespace: the
	// descriptor Find returned is still that namespace, with the pod's IP,
	// while the /proc path it was found through is gone.
	fa := got[a]
	procPath := fmt.Sprintf("/proc/%d/ns/net", fa.PID)
	sbA.Stop()
	_ = nsA.Close()
	if err := testutils.UnmountNS(nsA); err != nil {
		t.Fatalf("unmount %s: %v", nsA.Path(), err)
	}
	if _, err := os.Stat(procPath); err == nil {
		t.Fatalf("%s still exists after the process exited", procPath)
	}
	if held := netnsOf(t, fmt.Sprintf("/proc/self/fd/%d", fa.File.Fd())); held != fa.Netns {
		t.Errorf("after exit, file holds %+v, want %+v", held, fa.Netns)
	}
	if ok, err := HoldsAnyOf(fa.File, []netip.Addr{ipA}); err != nil || !ok {
		t.Errorf("after exit, held namespace holds %s = %v, %v; want true", ipA, ok, err)
	}

	// Stopping the pod released descriptors of its own (the netns handle,
	// the process's pidfd): count again before closing what Find returned.
	holding := testnet.OpenFDs(t)
	CloseAll(got)
	if after := testnet.OpenFDs(t); after != holding-2 {
		t.Errorf("closing the 2 namespaces Find returned: %d descriptors open, want %d-2", after, holding)
	}
	t.Logf("descriptors: %d before Find, %d while holding 2 (%d after the pod stopped), %d after closing them", before, before+2, holding, testnet.OpenFDs(t))
}

// TestFindLeaksNothing repeats Find over found and not-found pods and
// checks that every descriptor it did not return is closed.
func TestFindLeaksNothing(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nsenter", "sleep")
	root := testnet.RandName("kubepods-test-", 8)
	found, wrongIP, hostPod := randUID(), randUID(), randUID()
	ip := randIP()
	startPod(t, found, podNS(t, ip).Path(), podproc.Options{Root: root})
	wrongNS := podNS(t, randIP())
	// Several processes in the same wrong namespace: checked once each
	// scan, and closed every time.
	for range 3 {
		startPod(t, wrongIP, wrongNS.Path(), podproc.Options{Root: root, Driver: podproc.Systemd})
	}
	startPod(t, hostPod, "/proc/self/ns/net", podproc.Options{Root: root})
	s := Scanner{}
	for _, c := range []struct {
		name  string
		pods  map[types.UID][]netip.Addr
		found int
	}{
		{"found", map[types.UID][]netip.Addr{found: {ip}}, 1},
		{"not found", map[types.UID][]netip.Addr{wrongIP: {randIP()}, hostPod: {randIP()}, randUID(): {randIP()}}, 0},
		{"mixed", map[types.UID][]netip.Addr{found: {ip}, wrongIP: {randIP()}, hostPod: {randIP()}}, 1},
	} {
		findAndClose(t, s, c.pods)
		before := testnet.OpenFDs(t)
		for range 20 {
			got, err := s.Scan(c.pods)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != c.found {
				t.Fatalf("%s: found %d, want %d", c.name, len(got), c.found)
			}
			CloseAll(got)
		}
		if after := testnet.OpenFDs(t); after != before {
			t.Errorf("%s: %d descriptors open after 20 scans, %d before", c.name, after, before)
		}
		t.Logf("%s: %d descriptors before and %d after 20 scans", c.name, before, testnet.OpenFDs(t))
	}
}

func TestFindErrors(t *testing.T) {
	_, err := Scanner{ProcRoot: t.TempDir() + "/missing"}.Scan(map[types.UID][]netip.Addr{randUID(): {randIP()}})
	if err == nil {
		t.Fatal("missing proc root accepted")
	}
	// A proc root without processes finds nothing, without error.
	got, err := Scanner{ProcRoot: t.TempDir()}.Scan(map[types.UID][]netip.Addr{randUID(): {randIP()}})
	if err != nil || len(got) != 0 {
		t.Fatalf("empty proc root: %v, %v", got, err)
	}
}

func TestHoldsAnyOf(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t)
	f, err := os.Open(p.A.NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ok, err := HoldsAnyOf(f, []netip.Addr{p.B.V4, p.A.V6})
	if err != nil || !ok {
		t.Fatalf("HoldsAnyOf(A, [B.v4, A.v6]) = %v, %v; want true", ok, err)
	}
	ok, err = HoldsAnyOf(f, []netip.Addr{p.B.V4, p.B.V6})
	if err != nil || ok {
		t.Fatalf("HoldsAnyOf(A, B's addrs) = %v, %v; want false", ok, err)
	}
	notNS, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer notNS.Close()
	if _, err := HoldsAnyOf(notNS, nil); err == nil {
		t.Fatal("a file that is not a netns accepted")
	}
}

// findAndClose runs Find and closes what it returns.
func findAndClose(t *testing.T, s Scanner, pods map[types.UID][]netip.Addr) {
	t.Helper()
	got, err := s.Scan(pods)
	if err != nil {
		t.Fatal(err)
	}
	CloseAll(got)
}

// BenchmarkFind measures one /proc pass looking for 500 pods, most of them
// absent, on whatever this machine runs.
func BenchmarkFind(b *testing.B) {
	want := make(map[types.UID][]netip.Addr, 500)
	for range 500 {
		want[randUID()] = []netip.Addr{randIP()}
	}
	for b.Loop() {
		got, err := (Scanner{}).Scan(want)
		if err != nil {
			b.Fatal(err)
		}
		CloseAll(got)
	}
}
