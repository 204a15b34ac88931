package podnetns

import (
	"fmt"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Addrs lists the unicast addresses configured on any interface of the
// network namespace at path, without moving the calling thread into it.
func Addrs(path string) ([]netip.Addr, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	defer f.Close()
	h, err := netlink.NewHandleAt(netns.NsHandle(int(f.Fd())))
	if err != nil {
		return nil, fmt.Errorf("netlink in netns %s: %w", path, err)
	}
	defer h.Close()
	list, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses in netns %s: %w", path, err)
	}
	out := make([]netip.Addr, 0, len(list))
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// HoldsAnyOf reports whether the namespace at path has one of ips on an
// interface. The agent checks this before touching a namespace found by a
// /proc scan, so a reused PID or a stale cgroup can never point it at the
// wrong namespace.
func HoldsAnyOf(path string, ips []netip.Addr) (bool, error) {
	have, err := Addrs(path)
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
