package netns

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// State is what a network namespace offers the capture rules.
type State struct {
	// LoopbackUp: lo is up. Redirected traffic reaches ztunnel over lo,
	// so without it capture cannot work and Apply refuses, changing
	// nothing.
	LoopbackUp bool
	// LoopbackIndex is lo's interface index, which the policy route's
	// local route names.
	LoopbackIndex int
	// IPv6: the kernel has IPv6 and the namespace does not turn it off
	// everywhere (net.ipv6.conf.all, or some interface other than lo, has
	// disable_ipv6 = 0). IPv6 capture rules are needed.
	IPv6 bool
	// IPv6Loopback: lo has IPv6 (net.ipv6.conf.lo.disable_ipv6 = 0), so the
	// IPv6 local route can exist; without it the kernel refuses the route
	// ("IPv6 is disabled on nexthop device") and, as Istio does, we skip
	// the IPv6 policy route. Redirected IPv6 then fails closed (it cannot
	// reach ztunnel over lo) instead of leaving uncaptured.
	IPv6Loopback bool
	// XTables lists the x_tables (iptables-legacy) tables registered in
	// the namespace; x_tables registers one on first use, so a namespace
	// legacy iptables never touched has none.
	XTables []string
}

// StateOf reads the state of the network namespace at path ("" = the
// caller's), entering it once.
func StateOf(path string) (State, error) {
	var st State
	err := Do(path, func() error {
		var err error
		st, err = ReadState()
		return err
	})
	if err != nil {
		return State{}, fmt.Errorf("netns %s: %w", path, err)
	}
	return st, nil
}

// ReadState reads the state of the network namespace the calling thread is
// in: run it inside Do, which locks the thread there. Loopback over
// netlink, x_tables from /proc/thread-self/net (which resolves against the
// thread's namespace), IPv6 per interface over netlink. Not from /proc/sys
// when it can be helped: every namespace has the same
// net/ipv6/conf/<name> entries, so each lookup there walks a dentry chain
// as long as the node has namespaces, and the cost of a capture would grow
// with the pods on the node.
func ReadState() (State, error) {
	var st State
	// One RTM_GETLINK dump gives every interface's IPv6 setting and lo's
	// index and flags; a kernel without IPv6 answers it with nothing, and
	// lo is then asked for by name.
	links, err := ipv6Links()
	if err != nil {
		return st, err
	}
	if lo, ok := links["lo"]; ok {
		st.LoopbackIndex, st.LoopbackUp = lo.index, lo.up
	} else {
		l, err := netlink.LinkByName("lo")
		if err != nil {
			return st, fmt.Errorf("find lo: %w", err)
		}
		st.LoopbackIndex = l.Attrs().Index
		st.LoopbackUp = l.Attrs().Flags&net.FlagUp != 0
	}
	for _, p := range []string{"/proc/thread-self/net/ip_tables_names", "/proc/thread-self/net/ip6_tables_names"} {
		b, err := os.ReadFile(p)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return st, err
		}
		st.XTables = append(st.XTables, strings.Fields(string(b))...)
	}
	for name, l := range links {
		if name == "lo" {
			st.IPv6Loopback = l.ipv6
		} else if l.ipv6 {
			st.IPv6 = true
		}
	}
	if !st.IPv6 && links != nil {
		// No interface besides lo has it (rare in a pod: a namespace with
		// only lo, or one that turned IPv6 off per interface): what counts
		// then is net.ipv6.conf.all, one sysctl lookup.
		b, err := os.ReadFile("/proc/sys/net/ipv6/conf/all/disable_ipv6")
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return st, err
		}
		st.IPv6 = err == nil && strings.TrimSpace(string(b)) == "0"
	}
	return st, nil
}

// native is the host's byte order, that of netlink attribute values.
var native = binary.NativeEndian

// devconfDisableIPv6 is DEVCONF_DISABLE_IPV6 (linux/ipv6.h): the index of
// disable_ipv6 in the s32 values of IFLA_INET6_CONF.
const devconfDisableIPv6 = 26

// link6 is what the AF_INET6 link dump tells of one interface.
type link6 struct {
	index int
	up    bool // IFF_UP
	ipv6  bool // disable_ipv6 = 0
}

// ipv6Links reports, per interface of the calling thread's namespace, its
// index, whether it is up and whether IPv6 is on (disable_ipv6 = 0), from
// one RTM_GETLINK dump of the AF_INET6 family. A kernel without IPv6 has
// no interface in it (nil).
func ipv6Links() (map[string]link6, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETLINK, unix.NLM_F_DUMP)
	req.AddData(nl.NewIfInfomsg(unix.AF_INET6))
	msgs, err := req.Execute(unix.NETLINK_ROUTE, unix.RTM_NEWLINK)
	if errors.Is(err, unix.EAFNOSUPPORT) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("dump IPv6 links: %w", err)
	}
	out := map[string]link6{}
	for _, m := range msgs {
		if len(m) < unix.SizeofIfInfomsg {
			continue
		}
		hdr := nl.DeserializeIfInfomsg(m)
		attrs, err := nl.ParseRouteAttr(m[unix.SizeofIfInfomsg:])
		if err != nil {
			return nil, fmt.Errorf("parse IPv6 link: %w", err)
		}
		name, on := "", false
		for _, a := range attrs {
			switch a.Attr.Type {
			case unix.IFLA_IFNAME:
				name = strings.TrimRight(string(a.Value), "\x00")
			case unix.IFLA_PROTINFO:
				nested, err := nl.ParseRouteAttr(a.Value)
				if err != nil {
					return nil, fmt.Errorf("parse IPv6 link info: %w", err)
				}
				for _, n := range nested {
					if n.Attr.Type == unix.IFLA_INET6_CONF && len(n.Value) >= 4*(devconfDisableIPv6+1) {
						v := int32(native.Uint32(n.Value[4*devconfDisableIPv6:]))
						on = v == 0
					}
				}
			}
		}
		if name != "" {
			out[name] = link6{index: int(hdr.Index), up: hdr.Flags&unix.IFF_UP != 0, ipv6: on}
		}
	}
	return out, nil
}
