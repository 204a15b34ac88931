package iptables

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

var update = flag.Bool("update", false, "rewrite golden files")

// goldenConfigs are the option combinations with golden renderings.
var goldenConfigs = map[string]ruleset.PodConfig{
	"default":        {},
	"dns":            {DNSCapture: true},
	"bypass":         {BypassInbound: true},
	"dns-bypass":     {DNSCapture: true, BypassInbound: true},
	"custom-probe":   {ProbeSNATv4: netip.MustParseAddr("169.254.9.9"), ProbeSNATv6: netip.MustParseAddr("fd00:9999::9")},
	"virtual":        {VirtualInterfaces: []string{"k6t-eth0", "tap+"}},
	"virtual-bypass": {VirtualInterfaces: []string{"k6t-eth0"}, BypassInbound: true},
}

func TestRenderGolden(t *testing.T) {
	for name, cfg := range goldenConfigs {
		for _, f := range ruleset.Families {
			t.Run(name+"/"+f.String(), func(t *testing.T) {
				got := PodRules(cfg, f).Render()
				path := filepath.Join("testdata", "golden", name+"."+f.String()+".rules")
				if *update {
					if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				want, err := os.ReadFile(path)
				if err != nil {
					t.Fatalf("read golden (run with -update to create): %v", err)
				}
				if got != string(want) {
					t.Errorf("render differs from %s:\n--- got\n%s--- want\n%s", path, got, want)
				}
				// The rendering is exactly what planning against an empty
				// namespace produces.
				if plan := PlanApply(PodRules(cfg, f), &Save{}); plan != got {
					t.Errorf("plan on empty namespace differs from Render:\n%s", plan)
				}
			})
		}
	}
}

// TestRulesBehaviour checks the properties the compatibility spec demands
// of the rule text, independently of the golden files.
func TestRulesBehaviour(t *testing.T) {
	for _, f := range ruleset.Families {
		def := PodRules(ruleset.PodConfig{}, f).Render()
		probe := "169.254.7.127/32"
		lo := "127.0.0.1/32"
		if f == ruleset.IPv6 {
			probe, lo = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128", "::1/128"
		}
		for _, want := range []string{
			"-A ISTIO_OUTPUT ! -d " + lo + " -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
			"! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006",
			"-A ISTIO_PRERT -s " + probe + " -p tcp -j RETURN",
			"-A ISTIO_OUTPUT -d " + probe + " -p tcp -j RETURN",
			"-A ISTIO_OUTPUT -o lo -j RETURN",
			"-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
			"-j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
			"-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j RETURN\n-A ISTIO_OUTPUT -o lo -j RETURN\n",
		} {
			if !strings.Contains(def, want) {
				t.Errorf("%s default rules lack %q", f, want)
			}
		}
		for _, absent := range []string{"15053", "*raw", "ACCEPT"} {
			if strings.Contains(def, absent) {
				t.Errorf("%s default rules contain %q", f, absent)
			}
		}
		dns := PodRules(ruleset.PodConfig{DNSCapture: true}, f).Render()
		for _, want := range []string{"-p udp -m udp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053",
			"-p tcp -m tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053", "-j CT --zone 1"} {
			if !strings.Contains(dns, want) {
				t.Errorf("%s DNS rules lack %q", f, want)
			}
		}
		// TCP DNS is captured even when it leaves via lo (Istio's order).
		if strings.Index(dns, "-p tcp -m tcp --dport 53") > strings.Index(dns, "-o lo -j RETURN") {
			t.Errorf("%s: TCP DNS redirect after the lo exception", f)
		}
		// DNS redirect must precede the catch-all TCP redirect.
		if strings.Index(dns, "--dport 53") > strings.Index(dns, "--to-ports 15001") {
			t.Errorf("%s: DNS redirect after the outbound catch-all", f)
		}
		byp := PodRules(ruleset.PodConfig{BypassInbound: true}, f).Render()
		if strings.Contains(byp, "15006") || strings.Contains(byp, "-A PREROUTING -j ISTIO_PRERT\n-A OUTPUT -j ISTIO_OUTPUT\n-A ISTIO_OUTPUT -d") {
			t.Errorf("%s bypass still redirects inbound:\n%s", f, byp)
		}
		if !strings.Contains(byp, "--to-ports 15001") {
			t.Errorf("%s bypass lost outbound capture", f)
		}
		rs := PodRules(ruleset.PodConfig{}, f)
		if rs.Routing.Mark != 0x111 || rs.Routing.Mask != 0xfff || rs.Routing.Table != 100 || rs.Routing.Local.Bits() != 0 {
			t.Errorf("%s routing %v", f, rs.Routing)
		}
		if rs.Routing.Local.Addr().Is6() != (f == ruleset.IPv6) {
			t.Errorf("%s local route %s of wrong family", f, rs.Routing.Local)
		}
	}
}

func TestParseBackend(t *testing.T) {
	for in, want := range map[string]Backend{"nft": BackendNFT, "NFT": BackendNFT, "iptables-nft": BackendNFT,
		"nf_tables": BackendNFT, "legacy": BackendLegacy, " iptables-legacy ": BackendLegacy} {
		if got, err := ParseBackend(in); err != nil || got != want {
			t.Errorf("ParseBackend(%q) = %q, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "ebpf", "iptables", "nftables-legacy"} {
		if _, err := ParseBackend(in); err == nil {
			t.Errorf("ParseBackend(%q) accepted", in)
		}
	}
	if BackendNFT.SaveCmd(ruleset.IPv6) != "ip6tables-nft-save" || BackendLegacy.RestoreCmd(ruleset.IPv4) != "iptables-legacy-restore" {
		t.Error("binary names wrong")
	}
	if modeFromVersion("iptables v1.8.9 (nf_tables)\n") != BackendNFT || modeFromVersion("iptables v1.8.9 (legacy)") != BackendLegacy ||
		modeFromVersion("iptables v1.6.1") != BackendLegacy {
		t.Error("modeFromVersion wrong")
	}
	hint := nodeState{hint: true}
	many := nodeState{rules: 40}
	if b, ok := chooseBackend(BackendNFT, many, BackendLegacy, hint); !ok || b != BackendLegacy {
		t.Error("kubelet hint must win over rule count")
	}
	if b, ok := chooseBackend(BackendNFT, many, BackendLegacy, nodeState{rules: 3}); !ok || b != BackendNFT {
		t.Error("more rules must win")
	}
	if _, ok := chooseBackend(BackendNFT, nodeState{}, BackendLegacy, nodeState{}); ok {
		t.Error("a tie must fall back to the default mode")
	}
}
