package ruleset

import (
	"net/netip"
	"testing"
)

func TestPodConfigValidate(t *testing.T) {
	good := []PodConfig{{}, {ProbeSNATv4: netip.MustParseAddr("10.0.0.1"), ProbeSNATv6: netip.MustParseAddr("fd00::1")},
		{VirtualInterfaces: []string{"k6t-eth0", "tap+", "a", "abcdefghijklmn+", "net1.100", "x@y"}}}
	for _, c := range good {
		if err := c.Validate(); err != nil {
			t.Errorf("%+v rejected: %v", c, err)
		}
	}
	bad := []PodConfig{
		{VirtualInterfaces: []string{""}},
		{VirtualInterfaces: []string{"+"}},
		{VirtualInterfaces: []string{"abcdefghijklmnop"}},
		{VirtualInterfaces: []string{"eth 0"}},
		{VirtualInterfaces: []string{"eth0/1"}},
		{VirtualInterfaces: []string{"eth:0"}},
		{VirtualInterfaces: []string{"a+b"}},
		{VirtualInterfaces: []string{"tap*"}},
		{VirtualInterfaces: []string{"."}},
		{VirtualInterfaces: []string{"eth0\"", "-j ACCEPT"}},
		{VirtualInterfaces: []string{"asd^&&*$&*(#$&*(#&$*()))"}},
		{VirtualInterfaces: []string{"t\u00e4p0"}},
		{VirtualInterfaces: make([]string, MaxVirtualInterfaces+1)},
		{ProbeSNATv4: netip.MustParseAddr("fd00::1")},
		{ProbeSNATv6: netip.MustParseAddr("10.0.0.1")},
		{ProbeSNATv6: netip.MustParseAddr("::ffff:10.0.0.1")},
		{ProbeSNATv6: netip.MustParseAddr("fe80::1%eth0")},
	}
	for _, c := range bad {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

func TestRuleSetShape(t *testing.T) {
	for _, f := range Families {
		rs := PodRules(PodConfig{DNSCapture: true}, f)
		if got := rs.Tables(); len(got) != 3 || got[0] != Raw || got[1] != Mangle || got[2] != NAT {
			t.Errorf("%s tables %v", f, got)
		}
		if rs.Chain(NAT, Output) == nil || rs.Chain(NAT, Postrouting) != nil {
			t.Errorf("%s chains %+v", f, rs.Chains)
		}
		// Rules of both families line up: same count, same actions, so a
		// backend holding both in one table can interleave them.
		other := PodRules(PodConfig{DNSCapture: true}, IPv4+IPv6-f)
		for i, c := range rs.Chains {
			if len(c.Rules) != len(other.Chains[i].Rules) {
				t.Fatalf("%s %s %s: %d rules, other family %d", f, c.Table, c.Hook, len(c.Rules), len(other.Chains[i].Rules))
			}
		}
		if byp := PodRules(PodConfig{BypassInbound: true}, f); byp.Chain(NAT, Prerouting) != nil {
			t.Errorf("%s bypass keeps inbound rules", f)
		}
		if vb := PodRules(PodConfig{BypassInbound: true, VirtualInterfaces: []string{"k6t-eth0"}}, f); len(vb.Chain(NAT, Prerouting).Rules) != 1 {
			t.Errorf("%s bypass with a virtual interface: %+v", f, vb.Chain(NAT, Prerouting))
		}
		h := HostProbeRules(HostProbeConfig{}, f)
		if h.Kind != Host || len(h.Chains) != 1 || h.Chains[0].Rules[0].DstSet != ProbeSet(f) {
			t.Errorf("%s host rules %+v", f, h)
		}
	}
	if IPv4.Loopback().String() != "127.0.0.1/32" || IPv6.Loopback().String() != "::1/128" || Family(0).String() != "inet" {
		t.Error("family helpers")
	}
}

func TestFamilies(t *testing.T) {
	for _, tc := range []struct {
		cfg    PodConfig
		nsIPv6 bool
		want   int
	}{
		{PodConfig{}, true, 2},
		{PodConfig{}, false, 1},
		{PodConfig{IPv4Only: true}, true, 1},
		{PodConfig{IPv4Only: true}, false, 1},
	} {
		got := tc.cfg.Families(tc.nsIPv6)
		if len(got) != tc.want || got[0] != IPv4 {
			t.Errorf("%+v, namespace IPv6 %v: %v", tc.cfg, tc.nsIPv6, got)
		}
		// IPv6 is stale exactly where the namespace has it and the
		// desired state leaves it out.
		if stale := tc.cfg.StaleIPv6(tc.nsIPv6); stale != (tc.nsIPv6 && tc.want == 1) {
			t.Errorf("%+v, namespace IPv6 %v: stale IPv6 %v", tc.cfg, tc.nsIPv6, stale)
		}
		// The result is the caller's to change.
		got[0] = IPv6
		if Families[0] != IPv4 {
			t.Fatal("Families changed through a result")
		}
	}
	if h := (HostProbeConfig{IPv4Only: true}); len(h.Families(true)) != 1 || !h.Pod().IPv4Only {
		t.Error("host probe options lose IPv4Only")
	}
}

// ProbeIP takes what can be a pod's address, unmapped, with its family,
// and refuses the rest.
func TestProbeIP(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		f        Family
	}{
		{"10.1.2.3", "10.1.2.3", IPv4},
		{"::ffff:10.1.2.3", "10.1.2.3", IPv4},
		{"fd00::5", "fd00::5", IPv6},
	} {
		ip, f, err := ProbeIP(netip.MustParseAddr(tc.in))
		if err != nil || ip != netip.MustParseAddr(tc.want) || f != tc.f {
			t.Errorf("ProbeIP(%s) = %s, %v, %v; want %s, %v", tc.in, ip, f, err, tc.want, tc.f)
		}
	}
	bad := []netip.Addr{{}}
	for _, s := range []string{"0.0.0.0", "::", "127.0.0.1", "::1", "224.0.0.1", "ff02::1", "fe80::1%eth0", "::ffff:127.0.0.1"} {
		bad = append(bad, netip.MustParseAddr(s))
	}
	for _, ip := range bad {
		if got, _, err := ProbeIP(ip); err == nil {
			t.Errorf("ProbeIP(%s) accepted it as %s", ip, got)
		}
	}
}

func TestCheckPodNetns(t *testing.T) {
	if CheckPodNetns("") == nil {
		t.Error("an empty pod netns path (the caller's own namespace) accepted")
	}
	if err := CheckPodNetns("/var/run/netns/pod"); err != nil {
		t.Error(err)
	}
}
