// Package testnet builds throwaway network topologies for every root test:
// network namespaces ("pods") joined by veth pairs, with cleanup
// registered on the test. It needs root; RequireRoot turns a missing privilege into a skip, or
// into a failure when CI=true.
package testnet

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// InCI reports whether the tests run under CI, where a missing
// prerequisite is a failure rather than a skip.
func InCI() bool { return os.Getenv("CI") == "true" }

// Missing skips the test with reason, or fails it under CI.
func Missing(t testing.TB, reason string) {
	t.Helper()
	if InCI() {
		t.Fatalf("prerequisite missing under CI=true: %s", reason)
	}
	t.Skipf("skipping: %s", reason)
}

// RequireRoot skips (or fails under CI) unless running as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "needs root for network namespaces and iptables")
	}
}

// RequireCommands skips (or fails under CI) unless every command is on PATH.
func RequireCommands(t testing.TB, cmds ...string) {
	t.Helper()
	for _, c := range cmds {
		if _, err := exec.LookPath(c); err != nil {
			Missing(t, fmt.Sprintf("command %q not found (as root, make deps installs the Debian packages the tests need)", c))
		}
	}
}

// OpenFDs counts the test process's open file descriptors, for tests that
// check a component closes what it opened.
func OpenFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// RandName returns prefix followed by n random hex characters, for names
// that must not collide across parallel test runs (interface names are
// limited to 15 bytes).
func RandName(prefix string, n int) string {
	b := make([]byte, (n+1)/2)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return prefix + hex.EncodeToString(b)[:n]
}

// busyGrace is how long RemoveNS waits for a namespace's mount to be free.
const busyGrace = 30 * time.Second

// RemoveNS closes a namespace made by testutils.NewNS and removes its
// mount. umount without MNT_DETACH fails with EBUSY while any descriptor
// opened through the mount exists, which is how an agent pinning the
// namespace would show. But a child process being forked anywhere in the
// test process holds a copy of every descriptor until its exec (libcni
// runs plugins all the time), and on a busy machine a forked child may
// wait seconds for its turn to exec: EBUSY is retried up to busyGrace
// before it counts (an agent that pins a namespace pins it for good, and
// the suites count the agent's namespace descriptors besides); a mount
// still busy then is detached (nothing leaks: testutils' UnmountNS gives
// up there and leaves the mount behind) and reported.
func RemoveNS(n ns.NetNS) error {
	path := n.Path()
	_ = n.Close()
	var err error
	for deadline := time.Now().Add(busyGrace); ; time.Sleep(20 * time.Millisecond) {
		if err = unix.Unmount(path, 0); !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			break
		}
	}
	if errors.Is(err, unix.EBUSY) {
		_ = unix.Unmount(path, unix.MNT_DETACH)
		_ = os.Remove(path)
		return fmt.Errorf("netns %s stayed busy for %s (a descriptor opened through its mount is held): %w", path, busyGrace, err)
	}
	if rerr := os.Remove(path); rerr != nil && !os.IsNotExist(rerr) {
		return errors.Join(err, rerr)
	}
	if err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmount netns %s: %w", path, err)
	}
	return nil
}

// NewNS creates a named network namespace with loopback up and removes it
// when the test ends.
func NewNS(t testing.TB) ns.NetNS {
	t.Helper()
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("create netns: %v", err)
	}
	t.Cleanup(func() { _ = RemoveNS(n) })
	if err := LoopbackUp(n); err != nil {
		t.Fatalf("bring up lo: %v", err)
	}
	return n
}

// LoopbackUp brings up lo in the namespace, as runtimes do in a sandbox
// before the network's chain runs.
func LoopbackUp(n ns.NetNS) error {
	return n.Do(func(ns.NetNS) error { return loopbackUp() })
}

// Pod is one end of a veth pair inside a namespace.
type Pod struct {
	NS     ns.NetNS
	IfName string
	V4     netip.Addr
	V6     netip.Addr
}

// Pair holds two namespaces joined by a veth pair with IPv4 10.x.y.1/.2 /24
// and IPv6 fd00:x:y::1/::2 /64 addresses.
type Pair struct {
	A, B Pod
}

// NewPair creates two namespaces joined directly by a veth pair, with
// addresses from a random private /24 (and /64) so parallel tests differ.
func NewPair(t testing.TB) *Pair {
	t.Helper()
	a, b := NewNS(t), NewNS(t)
	var r [2]byte
	_, _ = rand.Read(r[:])
	r[0] = 200 + r[0]%50
	p := &Pair{
		A: Pod{NS: a, IfName: "eth0", V4: netip.AddrFrom4([4]byte{10, r[0], r[1], 1}), V6: netip.MustParseAddr(fmt.Sprintf("fd00:%x:%x::1", r[0], r[1]))},
		B: Pod{NS: b, IfName: "eth0", V4: netip.AddrFrom4([4]byte{10, r[0], r[1], 2}), V6: netip.MustParseAddr(fmt.Sprintf("fd00:%x:%x::2", r[0], r[1]))},
	}
	tmpA, tmpB := RandName("tna", 8), RandName("tnb", 8)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: tmpA}, PeerName: tmpB}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	for _, side := range []struct {
		tmp string
		pod Pod
	}{{tmpA, p.A}, {tmpB, p.B}} {
		l, err := netlink.LinkByName(side.tmp)
		if err != nil {
			t.Fatalf("find veth %s: %v", side.tmp, err)
		}
		if err := netlink.LinkSetNsFd(l, int(side.pod.NS.Fd())); err != nil {
			_ = netlink.LinkDel(l)
			t.Fatalf("move veth into netns: %v", err)
		}
		if err := side.pod.NS.Do(func(ns.NetNS) error {
			return configure(side.tmp, side.pod)
		}); err != nil {
			t.Fatalf("configure %s: %v", side.pod.NS.Path(), err)
		}
	}
	// Both ends are up; the kernel finishes bringing them up on its own
	// time, and a connection before that can fail (see WaitLinkReady).
	WaitLinkReady(t, p.A.NS, p.A.IfName)
	WaitLinkReady(t, p.B.NS, p.B.IfName)
	return p
}

func configure(tmp string, p Pod) error {
	l, err := netlink.LinkByName(tmp)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetName(l, p.IfName); err != nil {
		return fmt.Errorf("rename: %w", err)
	}
	for _, a := range []netip.Addr{p.V4, p.V6} {
		bits := 24
		if a.Is6() {
			bits = 64
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}}
		if a.Is6() {
			addr.Flags = 0x02 // IFA_F_NODAD: usable immediately, no DAD wait
		}
		if err := netlink.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("add %s: %w", a, err)
		}
	}
	return netlink.LinkSetUp(l)
}

// Do runs f in the pod's namespace, failing the test on error.
func (p Pod) Do(t testing.TB, f func() error) {
	t.Helper()
	if err := p.NS.Do(func(ns.NetNS) error { return f() }); err != nil {
		t.Fatalf("in netns %s: %v", p.NS.Path(), err)
	}
}
