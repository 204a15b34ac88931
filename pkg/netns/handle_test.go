package netns

import (
	"crypto/rand"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func inode(t *testing.T, f *os.File) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// The handle Find builds is the namespace Scan checked, taken
// from its descriptor: adopting still yields that namespace when the path it
// was opened by is gone, the checked file is closed (the handle owns its own
// descriptor), and, like Open, the handle does not pin the runtime's
// bind mount.
func TestAdoptHoldsTheCheckedFile(t *testing.T) {
	testnet.RequireRoot(t)
	adopt := func(t *testing.T, n ns.NetNS, before func()) *Handle {
		t.Helper()
		checked, err := os.Open(n.Path())
		if err != nil {
			t.Fatal(err)
		}
		want := inode(t, checked)
		if before != nil {
			before()
		}
		h, err := Adopt(checked)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = h.Close() })
		if got := inode(t, h.File()); got != want || h.ID() != want {
			t.Fatalf("handle is namespace %d (ID %d), the checked file was %d", got, h.ID(), want)
		}
		if h.Source() != n.Path() {
			t.Errorf("handle source %q, want the checked file's name %q", h.Source(), n.Path())
		}
		if checked.Fd() != ^uintptr(0) {
			t.Errorf("the checked file is still open after adoption")
		}
		return h
	}
	t.Run("path gone", func(t *testing.T) {
		n, err := testutils.NewNS()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(); _ = testutils.UnmountNS(n) })
		adopt(t, n, func() {
			// Nothing names the namespace by path any more; only the
			// checked descriptor holds it.
			_ = n.Close()
			if err := unix.Unmount(n.Path(), unix.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(n.Path()); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("mount not pinned", func(t *testing.T) {
		n, err := testutils.NewNS()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(); _ = testutils.UnmountNS(n) })
		adopt(t, n, nil)
		_ = n.Close()
		// A plain umount fails with EBUSY while a file opened through
		// the mount is open.
		if err := testutils.UnmountNS(n); err != nil {
			t.Fatalf("the runtime cannot remove the netns while the agent holds it: %v", err)
		}
	})
}

// Adoption runs the same checks as Open and closes the file it was
// given when they fail.
func TestAdoptRejects(t *testing.T) {
	plain, err := os.Create(filepath.Join(t.TempDir(), "ns"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Adopt(plain); err == nil || !errors.Is(err, ErrInvalid) {
		t.Errorf("adopting a regular file: err %v, want an invalid-input error", err)
	}
	if plain.Fd() != ^uintptr(0) {
		t.Errorf("rejected file left open")
	}
	host, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Adopt(host); err == nil || !errors.Is(err, ErrInvalid) {
		t.Errorf("adopting the host netns: err %v, want an invalid-input error", err)
	}
	if host.Fd() != ^uintptr(0) {
		t.Errorf("rejected host netns file left open")
	}
}

// Find hands the controller a handle on the namespace the scan found and
// checked for a pod, and keeps no descriptor of its own.
func TestFindHandsOverCheckedNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nsenter", "sleep")
	hier := podproc.RequireHierarchies(t)
	var b [3]byte
	_, _ = rand.Read(b[:])
	ip := netip.AddrFrom4([4]byte{10, 200 + b[0]%50, b[1], b[2]})
	pod := testnet.NewNS(t)
	if err := pod.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(32, 32)}})
	}); err != nil {
		t.Fatal(err)
	}
	uid := types.UID(testnet.RandName("", 8) + "-0000-4000-8000-" + testnet.RandName("", 12))
	sb, err := podproc.Start(string(uid), pod.Path(), podproc.Options{Root: testnet.RandName("kubepods-test-", 8), Hierarchies: hier})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sb.Stop)
	want, err := Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer want.Close()

	f := Scanner{}
	pods := map[types.UID][]netip.Addr{uid: {ip}}
	// Warm up what the runtime opens once (netlink, epoll) before counting.
	warm, err := f.Find(pods)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range warm {
		_ = h.Close()
	}
	before := testnet.OpenFDs(t)
	got, err := f.Find(pods)
	if err != nil {
		t.Fatal(err)
	}
	h, ok := got[uid]
	if !ok || len(got) != 1 {
		t.Fatalf("Find returned %v, want exactly pod %s", got, uid)
	}
	if !h.SameAs(want) {
		t.Errorf("handle is namespace %d, the pod's is %d", h.ID(), want.ID())
	}
	if held := testnet.OpenFDs(t); held != before+1 {
		t.Errorf("holding one handle: %d descriptors open, want %d+1", held, before)
	}
	_ = h.Close()
	if after := testnet.OpenFDs(t); after != before {
		t.Errorf("%d descriptors open after closing the handle, %d before", after, before)
	}
}
