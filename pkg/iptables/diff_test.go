package iptables

import (
	"reflect"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// appliedState returns the save a namespace holds after a clean apply of
// cfg on top of base.
func appliedState(t *testing.T, base string, cfg ruleset.PodConfig) *Save {
	t.Helper()
	s, err := ParseSave(base)
	if err != nil {
		t.Fatal(err)
	}
	out, err := simulateRestore(s, PlanApply(PodRules(cfg, ruleset.IPv4), s))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// edit applies a restore snippet to s, standing in for a hand edit.
func edit(t *testing.T, s *Save, snippet string) *Save {
	t.Helper()
	out, err := simulateRestore(s, snippet)
	if err != nil {
		t.Fatalf("edit %q: %v", snippet, err)
	}
	return out
}

func TestDiffNamesEachKindOfDrift(t *testing.T) {
	rs := PodRules(ruleset.PodConfig{}, ruleset.IPv4)
	clean := appliedState(t, "", ruleset.PodConfig{})
	if d := rs.Diff(clean); !d.Empty() || d.String() != "no drift" {
		t.Fatalf("clean state drifts:\n%s", d)
	}
	lo := "-A ISTIO_OUTPUT -o lo -j RETURN"
	probe := "-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -j RETURN\n-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j RETURN"
	cases := []struct {
		name, snippet string
		want          []string
	}{
		{"deleted rule", "*nat\n-D ISTIO_OUTPUT -o lo -j RETURN\nCOMMIT\n",
			[]string{`ipv4 nat ISTIO_OUTPUT: missing rule #3 "` + lo + `"`}},
		{"changed rule", "*nat\n:ISTIO_OUTPUT - [0:0]\n" + probe + "\n-A ISTIO_OUTPUT -o eth0 -j RETURN\n" +
			"-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001\nCOMMIT\n",
			[]string{`ipv4 nat ISTIO_OUTPUT: changed rule #3: want "` + lo + `", have "-A ISTIO_OUTPUT -o eth0 -j RETURN"`}},
		{"swapped rules", "*nat\n:ISTIO_OUTPUT - [0:0]\n" + lo + "\n" + probe + "\n" +
			"-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001\nCOMMIT\n",
			[]string{`ipv4 nat ISTIO_OUTPUT: moved rule #`}},
		{"stray rule", "*nat\n-A ISTIO_OUTPUT -p udp -j RETURN\nCOMMIT\n",
			[]string{`ipv4 nat ISTIO_OUTPUT: extra rule #5 "-A ISTIO_OUTPUT -p udp -j RETURN"`}},
		{"missing jump", "*mangle\n-D OUTPUT -j ISTIO_OUTPUT\nCOMMIT\n",
			[]string{`ipv4 mangle OUTPUT: missing rule "-A OUTPUT -j ISTIO_OUTPUT"`}},
		{"duplicate jump", "*nat\n-A OUTPUT -j ISTIO_OUTPUT\nCOMMIT\n",
			[]string{`ipv4 nat OUTPUT: extra rule "-A OUTPUT -j ISTIO_OUTPUT"`}},
		{"foreign reference", "*nat\n-A POSTROUTING -p tcp -j ISTIO_OUTPUT\nCOMMIT\n",
			[]string{`ipv4 nat POSTROUTING: extra rule "-A POSTROUTING -p tcp -j ISTIO_OUTPUT"`}},
		{"missing chain", "*mangle\n-D PREROUTING -j ISTIO_PRERT\n-F ISTIO_PRERT\n-X ISTIO_PRERT\nCOMMIT\n",
			[]string{"ipv4 mangle: missing chain ISTIO_PRERT", `ipv4 mangle ISTIO_PRERT: missing rule #1`, `ipv4 mangle PREROUTING: missing rule "-A PREROUTING -j ISTIO_PRERT"`}},
		{"unwanted chain", "*raw\n:ISTIO_OUTPUT - [0:0]\nCOMMIT\n",
			[]string{"ipv4 raw: extra chain ISTIO_OUTPUT"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := edit(t, clean, tc.snippet)
			d := rs.Diff(s)
			if len(d.Items) != len(tc.want) {
				t.Fatalf("got %d items, want %d:\n%s", len(d.Items), len(tc.want), d)
			}
			for i, w := range tc.want {
				if !strings.HasPrefix(d.Items[i].String(), w) {
					t.Errorf("item %d = %s\nwant prefix %s", i, d.Items[i], w)
				}
			}
			// And the plan repairs it.
			fixed := edit(t, s, PlanApply(rs, s))
			if d := rs.Diff(fixed); !d.Empty() {
				t.Errorf("not repaired:\n%s", d)
			}
		})
	}
}

func TestPlanLeavesOthersAlone(t *testing.T) {
	base := readFixture(t, "others-and-ours.txt")
	s, err := ParseSave(base)
	if err != nil {
		t.Fatal(err)
	}
	if p := PlanApply(PodRules(ruleset.PodConfig{}, ruleset.IPv4), s); p != "" {
		t.Fatalf("converged fixture planned changes:\n%s", p)
	}
	removed := edit(t, s, PlanRemove(s))
	want := `*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A CNI-HOSTPORT-DNAT -p tcp -m comment --comment "dnat name: \"cbr0\" id: \"abc\"" -m tcp --dport 8443 -j DNAT --to-destination 10.1.0.5:443
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -s 10.0.0.0/8 -m comment --comment "-j ISTIO_OUTPUT is just a comment" -j ACCEPT
COMMIT
`
	if got := removed.String(); got != want {
		t.Errorf("after removal:\n%s\nwant:\n%s", got, want)
	}
	if got := touchedTables(PlanRemove(s)); !reflect.DeepEqual(got, []string{"mangle", "nat"}) {
		t.Errorf("touched tables %v", got)
	}
	if PlanRemove(removed) != "" {
		t.Error("second removal not empty")
	}
}

func TestPlanSwitchesOptions(t *testing.T) {
	s := appliedState(t, "", ruleset.PodConfig{})
	for _, cfg := range []ruleset.PodConfig{{DNSCapture: true}, {BypassInbound: true}, {DNSCapture: true, BypassInbound: true}, {}} {
		rs := PodRules(cfg, ruleset.IPv4)
		s = edit(t, s, PlanApply(rs, s))
		if d := rs.Diff(s); !d.Empty() {
			t.Fatalf("%+v: drift after switch:\n%s", cfg, d)
		}
	}
	if s.Table("raw").Chain(ChainOutput) != nil || s.Table("nat").Chain(ChainPrerouting) == nil {
		t.Fatalf("back to defaults left wrong chains:\n%s", s)
	}
}

func TestDriftItemStrings(t *testing.T) {
	items := policyroute.Drift(ruleset.IPv6, PodRules(ruleset.PodConfig{}, ruleset.IPv6).Routing, false, false)
	got := ruleset.Drift{Items: items}.String()
	want := "ipv6: missing ip rule \"pref 32764 fwmark 0x111/0xfff lookup 100\"\nipv6: missing route \"local ::/0 dev lo table 100\""
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	if len(policyroute.Drift(ruleset.IPv4, ruleset.PolicyRoute{}, true, true)) != 0 {
		t.Error("present rule and route reported")
	}
}
