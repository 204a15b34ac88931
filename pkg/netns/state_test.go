package netns

import (
	"net"
	"os"
	"os/exec"
	"slices"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
)

// TestState reads what the backends decide on: lo up, IPv6 on the
// interfaces and on lo, x_tables registered.
func TestState(t *testing.T) {
	testnet.RequireRoot(t)
	pair := testnet.NewPair(t)
	p := pair.A.NS.Path()
	st, err := StateOf(p)
	if err != nil {
		t.Fatal(err)
	}
	if !st.LoopbackUp || !st.IPv6 || !st.IPv6Loopback || len(st.XTables) != 0 {
		t.Fatalf("fresh pod: %+v", st)
	}
	pair.A.Do(t, func() error {
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/lo/disable_ipv6", []byte("1"), 0o644); err != nil {
			return err
		}
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetDown(lo)
	})
	if st, err = StateOf(p); err != nil || st.LoopbackUp || !st.IPv6 || st.IPv6Loopback {
		t.Fatalf("lo down without IPv6: %+v %v", st, err)
	}
	if _, err := StateOf("/nonexistent/netns"); err == nil {
		t.Fatal("bad path accepted")
	}
}

// TestXTables: a namespace legacy iptables touched shows its tables.
func TestXTables(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-legacy")
	n := testnet.NewNS(t)
	if err := n.Do(func(ns.NetNS) error {
		return runCmd("iptables-legacy", "-t", "nat", "-S")
	}); err != nil {
		t.Fatal(err)
	}
	st, err := StateOf(n.Path())
	if err != nil || !slices.Contains(st.XTables, "nat") {
		t.Fatalf("after iptables-legacy -t nat: %+v %v", st, err)
	}
}

func runCmd(name string, args ...string) error {
	return exec.Command(name, args...).Run()
}

// TestStateIPv6: IPv6 is read per interface over netlink and agrees with
// the sysctls: off once every interface and "all" turn it off, on again
// when one interface turns it back on.
func TestStateIPv6(t *testing.T) {
	testnet.RequireRoot(t)
	pair := testnet.NewPair(t)
	p := pair.A.NS.Path()
	var links []string
	pair.A.Do(t, func() error {
		ls, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range ls {
			if name := l.Attrs().Name; name != "lo" {
				links = append(links, name)
			}
		}
		on, err := ipv6Links()
		if err != nil {
			return err
		}
		for _, name := range append(links, "lo") {
			b, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + name + "/disable_ipv6")
			if err != nil {
				return err
			}
			if want := string(b) == "0\n"; on[name].ipv6 != want {
				t.Errorf("%s: netlink says IPv6 on = %v, the sysctl says %q", name, on[name].ipv6, b)
			}
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if on[name].index != l.Attrs().Index || on[name].up != (l.Attrs().Flags&net.FlagUp != 0) {
				t.Errorf("%s: dump says index %d up %v, the link says %d %v", name, on[name].index, on[name].up, l.Attrs().Index, l.Attrs().Flags)
			}
		}
		return nil
	})
	set := func(name, v string) {
		pair.A.Do(t, func() error {
			return os.WriteFile("/proc/sys/net/ipv6/conf/"+name+"/disable_ipv6", []byte(v), 0o644)
		})
	}
	set("all", "1")
	for _, l := range links {
		set(l, "1")
	}
	if st, err := StateOf(p); err != nil || st.IPv6 {
		t.Fatalf("IPv6 off everywhere: %+v %v", st, err)
	}
	set(links[0], "0")
	if st, err := StateOf(p); err != nil || !st.IPv6 {
		t.Fatalf("IPv6 back on %s: %+v %v", links[0], st, err)
	}
}
