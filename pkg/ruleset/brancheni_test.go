package ruleset

import (
	"net/netip"
	"testing"
)

func TestFindBranchENI(t *testing.T) {
	pod := netip.MustParseAddr("10.1.2.3")
	routes := []RouteView{
		{Table: 254, Dst: netip.MustParsePrefix("10.1.2.3/32"), Dev: "eni1"}, // main: ignored
		{Table: 105, Dst: netip.MustParsePrefix("0.0.0.0/0"), Dev: "vlan.eth.5"},
		{Table: 105, Dst: netip.MustParsePrefix("10.1.2.3/32"), Dev: "vlanabc"},
	}
	rules := []RuleView{
		{Priority: 9, Iif: "vlanabc", Table: LocalTable, Protocol: BranchENIProtocol}, // ours
		{Priority: 10, Iif: "vlan.eth.5", Table: 105},
		{Priority: 10, Iif: "vlanabc", Table: 105},
	}
	b, ok := FindBranchENI(pod, rules, routes)
	if !ok || b != (BranchENI{Table: 105, Veth: "vlanabc", VethPriority: 10}) {
		t.Fatalf("got %+v %v", b, ok)
	}
	// Mapped addresses are the same pod.
	if _, ok := FindBranchENI(netip.MustParseAddr("::ffff:10.1.2.3"), rules, routes); !ok {
		t.Error("mapped address not found")
	}
	// An ordinary pod, a rule for another device, a route that is not a
	// host route, and nothing at all are not branch ENI pods.
	for name, c := range map[string]struct {
		ip     string
		rules  []RuleView
		routes []RouteView
	}{
		"ordinary":     {"10.1.2.4", rules, routes},
		"other device": {"10.1.2.3", rules[1:2], routes},
		"not a host":   {"10.1.2.3", rules, []RouteView{{Table: 105, Dst: netip.MustParsePrefix("10.1.2.0/24"), Dev: "vlanabc"}}},
		"only ours":    {"10.1.2.3", rules[:1], routes},
		"empty":        {"10.1.2.3", nil, nil},
		"zero":         {"10.1.2.3", []RuleView{{}}, []RouteView{{}}},
	} {
		if b, ok := FindBranchENI(netip.MustParseAddr(c.ip), c.rules, c.routes); ok {
			t.Errorf("%s: found %+v", name, b)
		}
	}
}

func TestBranchENIRules(t *testing.T) {
	got := BranchENIRules(netip.MustParseAddr("10.1.2.3"), BranchENI{Table: 105, Veth: "vlanabc", VethPriority: 10})
	want := []string{
		"pref 512 to 10.1.2.3/32 iif lo ipproto tcp lookup 105 proto 172",
		"pref 9 from 10.1.2.3/32 iif vlanabc ipproto tcp lookup 255 proto 172",
	}
	if len(got) != len(want) {
		t.Fatalf("got %v", got)
	}
	for i := range want {
		if got[i].String() != want[i] || got[i].Family != IPv4 {
			t.Errorf("rule %d: %s (%v), want %s", i, got[i], got[i].Family, want[i])
		}
	}
	v6 := BranchENIRules(netip.MustParseAddr("fd00::3"), BranchENI{Table: 105, Veth: "v", VethPriority: 0})
	if v6[0].Family != IPv6 || v6[0].Dst.Bits() != 128 || v6[1].Priority != 0 {
		t.Errorf("IPv6: %v", v6)
	}
}
