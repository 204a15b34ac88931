package netns

import (
	"fmt"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
)

// Addrs lists the unicast addresses configured on any interface of the
// open network namespace ns, without moving the calling thread into it.
func Addrs(ns *os.File) ([]netip.Addr, error) {
	var out []netip.Addr
	err := doFD(int(ns.Fd()), ns.Name(), func() error {
		var err error
		out, err = addrsHere()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list addresses in netns %s: %w", ns.Name(), err)
	}
	return out, nil
}

// addrsHere is Addrs in the calling thread's namespace.
func addrsHere() ([]netip.Addr, error) {
	list, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(list))
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// HoldsAnyOf reports whether the open network namespace ns has one of ips
// on an interface. Scan checks this on the very descriptor it returns, so
// a reused PID or a stale cgroup can never point the agent at the wrong
// namespace.
func HoldsAnyOf(ns *os.File, ips []netip.Addr) (bool, error) {
	have, err := Addrs(ns)
	if err != nil {
		return false, err
	}
	for _, h := range have {
		for _, w := range ips {
			if h == w.Unmap() {
				return true, nil
			}
		}
	}
	return false, nil
}
