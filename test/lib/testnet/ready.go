package testnet

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// linkReadyWithin bounds WaitLinkReady: the kernel work it waits for runs
// on workqueues under the RTNL lock, which other tests' namespace
// teardowns can hold for a long time on a busy machine.
const linkReadyWithin = time.Minute

// WaitLinkReady waits until the kernel has finished bringing up the link
// named ifName in n, asynchronously after "link up" returned: the link is
// operationally up (its queue is attached: until then every packet it
// sends, ARP and neighbour replies included, is dropped) and every IPv6
// address on it has joined its solicited-node multicast group (until then
// the namespace ignores neighbour solicitations for the address). A peer
// that talks to it earlier can see its neighbour resolution fail after
// three unanswered probes, and its connect fail with "no route to host".
func WaitLinkReady(t testing.TB, n ns.NetNS, ifName string) {
	t.Helper()
	deadline := time.Now().Add(linkReadyWithin)
	for {
		var err error
		if derr := n.Do(func(ns.NetNS) error { err = linkReady(ifName); return nil }); derr != nil {
			t.Fatalf("in netns %s: %v", n.Path(), derr)
		}
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("link %s in netns %s not ready within %v: %v", ifName, n.Path(), linkReadyWithin, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// linkReady checks the link in the calling thread's namespace.
func linkReady(ifName string) error {
	l, err := netlink.LinkByName(ifName)
	if err != nil {
		return err
	}
	if st := l.Attrs().OperState; st != netlink.OperUp {
		return fmt.Errorf("operational state %s", st)
	}
	addrs, err := netlink.AddrList(l, netlink.FAMILY_V6)
	if err != nil {
		return err
	}
	groups, err := os.ReadFile("/proc/thread-self/net/igmp6")
	if errors.Is(err, os.ErrNotExist) {
		return nil // no IPv6 in this kernel
	}
	if err != nil {
		return err
	}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || ip.IsLinkLocalUnicast() {
			continue
		}
		if a.Flags&unix.IFA_F_TENTATIVE != 0 {
			return fmt.Errorf("%s still tentative", ip)
		}
		if !joined(string(groups), l.Attrs().Index, ip) {
			return fmt.Errorf("%s: solicited-node multicast group not joined yet", ip)
		}
	}
	return nil
}

// joined reports whether igmp6 (the text of /proc/net/igmp6) lists the
// solicited-node multicast group of ip (ff02::1:ffXX:XXXX, from its last
// 24 bits) on the interface with index ifIndex.
func joined(igmp6 string, ifIndex int, ip netip.Addr) bool {
	a := ip.As16()
	group := fmt.Sprintf("ff0200000000000000000001ff%02x%02x%02x", a[13], a[14], a[15])
	for _, line := range strings.Split(igmp6, "\n") {
		// index, interface name, group, users, flags, timer
		f := strings.Fields(line)
		if len(f) >= 3 && f[0] == fmt.Sprint(ifIndex) && f[2] == group {
			return true
		}
	}
	return false
}
