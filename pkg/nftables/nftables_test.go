package nftables

import (
	"bytes"
	"encoding/binary"
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	dt "github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

var update = flag.Bool("update", false, "rewrite golden files")

// goldenConfigs are the option combinations with golden renderings (the
// same as pkg/iptables').
var goldenConfigs = map[string]ruleset.PodConfig{
	"default":        {},
	"dns":            {DNSCapture: true},
	"bypass":         {BypassInbound: true},
	"dns-bypass":     {DNSCapture: true, BypassInbound: true},
	"custom-probe":   {ProbeSNATv4: netip.MustParseAddr("169.254.9.9"), ProbeSNATv6: netip.MustParseAddr("fd00:9999::9")},
	"virtual":        {VirtualInterfaces: []string{"k6t-eth0", "tap+"}},
	"virtual-bypass": {VirtualInterfaces: []string{"k6t-eth0"}, BypassInbound: true},
	"ipv4-only":      {IPv4Only: true, DNSCapture: true, VirtualInterfaces: []string{"k6t-eth0"}},
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", "golden", name+".nft")
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
		t.Errorf("rendering differs from %s:\n--- got\n%s--- want\n%s", path, got, want)
	}
}

// TestGolden keeps the nft rendering of every option combination under
// review: what Apply installs, in nft syntax.
func TestGolden(t *testing.T) {
	for name, cfg := range goldenConfigs {
		t.Run(name, func(t *testing.T) {
			got, err := PodText(cfg)
			if err != nil {
				t.Fatal(err)
			}
			golden(t, name, got)
		})
	}
	got, err := HostText(ruleset.HostProbeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "host-probe", got)
	got, err = HostText(ruleset.HostProbeConfig{IPv4Only: true})
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "host-probe-ipv4-only", got)
}

// walk calls fn for every rule of the program with its table and chain.
func walk(p program, fn func(t *table, c *chain, r *rule)) {
	for _, t := range p.tables {
		for _, c := range t.chains {
			for _, r := range c.rules {
				fn(t, c, r)
			}
		}
	}
}

// TestRenderInvariants checks what google/nftables leaves to the caller:
// protocol guards before payload matches, byte orders, chain types.
func TestRenderInvariants(t *testing.T) {
	for name, cfg := range goldenConfigs {
		p, err := renderPod(cfg)
		if err != nil {
			t.Fatal(err)
		}
		h, err := renderHost(ruleset.HostProbeConfig{}, ruleset.Families)
		if err != nil {
			t.Fatal(err)
		}
		p.tables = append(p.tables, h.tables...)
		ids := map[string]bool{}
		walk(p, func(tb *table, c *chain, r *rule) {
			where := name + " " + tb.name + " " + c.name + ": " + r.text
			if ids[string(r.id)] {
				t.Errorf("%s: id not unique", where)
			}
			ids[string(r.id)] = true
			nfproto, l4proto := false, false
			for i, e := range r.exprs {
				switch e := e.(type) {
				case *expr.Meta:
					if e.Key == expr.MetaKeyNFPROTO {
						nfproto = true
					}
					if e.Key == expr.MetaKeyL4PROTO {
						l4proto = true
					}
					if e.Key == expr.MetaKeyMARK && !e.SourceRegister {
						// The mask that follows is host-endian.
						bw := r.exprs[i+1].(*expr.Bitwise)
						if binary.NativeEndian.Uint32(bw.Mask) != 0xfff {
							t.Errorf("%s: mark mask %x not host-endian 0xfff", where, bw.Mask)
						}
					}
				case *expr.Payload:
					if e.Base == expr.PayloadBaseNetworkHeader && !nfproto {
						t.Errorf("%s: network header payload without a meta nfproto guard", where)
					}
					if e.Base == expr.PayloadBaseTransportHeader {
						if !l4proto {
							t.Errorf("%s: transport header payload without a meta l4proto guard", where)
						}
						cmp := r.exprs[i+1].(*expr.Cmp)
						if port := binary.BigEndian.Uint16(cmp.Data); port != 53 && port != 15008 {
							t.Errorf("%s: port %d (%x) not network-endian", where, port, cmp.Data)
						}
					}
				case *expr.Lookup:
					if !slices.ContainsFunc(tb.sets, func(s *set) bool { return s.name == e.SetName }) {
						t.Errorf("%s: set %s not in the table", where, e.SetName)
					}
				case *expr.Redir, *expr.NAT:
					if c.typ != gnft.ChainTypeNAT {
						t.Errorf("%s: NAT in a %s chain", where, c.typ)
					}
				}
			}
		})
		mangle := p.tables[slices.IndexFunc(p.tables, func(t *table) bool { return t.name == TableMangle })]
		if c := mangle.chain("output"); c == nil || c.typ != gnft.ChainTypeRoute {
			t.Errorf("%s: the mangle output chain must be of type route, so a restored mark re-routes", name)
		}
	}
}

// nftRuleset lists the namespace's ruleset as nft prints it.
func nftRuleset(t *testing.T, path string) string {
	t.Helper()
	return dt.Run(t, path, "nft", "list", "ruleset")
}

// TestTextMatchesNetlink loads the nft text rendering with nft in one
// namespace and applies the same configuration over netlink in another:
// nft must list both the same, so the golden text is what runs.
func TestTextMatchesNetlink(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft")
	a := NewApplier(dt.Logger(t))
	t.Cleanup(func() { _ = a.Close() })
	for name, cfg := range goldenConfigs {
		t.Run(name, func(t *testing.T) {
			text, err := PodText(cfg)
			if err != nil {
				t.Fatal(err)
			}
			byText, byNetlink := testnet.NewNS(t), testnet.NewNS(t)
			loadText(t, byText.Path(), text)
			if err := a.Apply(byNetlink.Path(), cfg); err != nil {
				t.Fatal(err)
			}
			if x, y := nftRuleset(t, byText.Path()), nftRuleset(t, byNetlink.Path()); x != y {
				t.Fatalf("nft -f of the text and the netlink apply differ:\n--- text\n%s--- netlink\n%s", x, y)
			}
		})
	}
	t.Run("host-probe", func(t *testing.T) {
		text, err := HostText(ruleset.HostProbeConfig{})
		if err != nil {
			t.Fatal(err)
		}
		byText, byNetlink := testnet.NewNS(t), testnet.NewNS(t)
		loadText(t, byText.Path(), text)
		h := NewHostProbe(dt.Logger(t), byNetlink.Path(), ruleset.HostProbeConfig{})
		t.Cleanup(func() { _ = h.Close() })
		if err := h.Ensure(); err != nil {
			t.Fatal(err)
		}
		if x, y := nftRuleset(t, byText.Path()), nftRuleset(t, byNetlink.Path()); x != y {
			t.Fatalf("nft -f of the text and the netlink ensure differ:\n--- text\n%s--- netlink\n%s", x, y)
		}
	})
}

func loadText(t *testing.T, path, text string) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "rules.nft")
	if err := os.WriteFile(f, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	dt.Run(t, path, "nft", "-f", f)
}

// TestApplierDrift: hand edits of our tables are named, and Apply puts the
// tables back exactly (it replaces them in one batch).
func TestApplierDrift(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft")
	a := NewApplier(dt.Logger(t))
	t.Cleanup(func() { _ = a.Close() })
	cfg := ruleset.PodConfig{}
	for _, tc := range []struct {
		name string
		edit []string // nft commands
		want []string // drift items, in order
	}{
		{"foreign rule in our chain", []string{"insert rule inet istio-ambient-nat output meta l4proto udp return"},
			[]string{`inet istio-ambient-nat output: extra nft rule #1 "rule handle `}},
		{"chain with another priority", []string{"delete chain inet istio-ambient-mangle output",
			"add chain inet istio-ambient-mangle output { type route hook output priority 10; }"},
			[]string{`inet istio-ambient-mangle: changed chain output`, `inet istio-ambient-mangle output: missing nft rule #1 "ct mark & 0x00000fff == 0x00000111 meta mark set ct mark"`}},
		{"extra chain", []string{"add chain inet istio-ambient-nat mine"},
			[]string{`inet istio-ambient-nat: extra chain mine`}},
		{"table gone", []string{"delete table inet istio-ambient-mangle"},
			[]string{`inet istio-ambient-mangle: missing table`}},
		{"rule of another rendering", []string{"flush chain inet istio-ambient-nat prerouting",
			"add rule inet istio-ambient-nat prerouting ip saddr 169.254.7.127 meta l4proto tcp return"},
			[]string{`inet istio-ambient-nat prerouting: changed nft rule #1: want "ip saddr 169.254.7.127 meta l4proto tcp return", have "rule handle `,
				`inet istio-ambient-nat prerouting: missing nft rule #2`, `inet istio-ambient-nat prerouting: missing nft rule #3`, `inet istio-ambient-nat prerouting: missing nft rule #4`}},
		{"table of an option no longer wanted", []string{"add table inet istio-ambient-raw"},
			[]string{`inet istio-ambient-raw: extra table`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := testnet.NewNS(t)
			p := n.Path()
			if err := a.Apply(p, cfg); err != nil {
				t.Fatal(err)
			}
			clean := nftRuleset(t, p)
			for _, c := range tc.edit {
				loadText(t, p, c+"\n")
			}
			d, err := a.Verify(p, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if len(d.Items) != len(tc.want) {
				t.Fatalf("drift:\n%s\nwant %d items: %q", d, len(tc.want), tc.want)
			}
			for i, w := range tc.want {
				if !strings.HasPrefix(d.Items[i].String(), w) {
					t.Errorf("item %d = %s\nwant prefix %s", i, d.Items[i], w)
				}
			}
			if err := a.Apply(p, cfg); err != nil {
				t.Fatal(err)
			}
			if d, err := a.Verify(p, cfg); err != nil || !d.Empty() {
				t.Fatalf("after repair: %v\n%s", err, d)
			}
			if got := nftRuleset(t, p); got != clean {
				t.Fatalf("repair is not the clean state:\n%s\n---\n%s", clean, got)
			}
		})
	}
}

// TestApplyFailureUndone: a batch the kernel refuses leaves no routes and
// no tables behind, fresh or over earlier rules.
func TestApplyFailureUndone(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft", "ip")
	for _, before := range []*ruleset.PodConfig{nil, {DNSCapture: true}} {
		pair := testnet.NewPair(t)
		p := pair.A.NS.Path()
		a := NewApplier(dt.Logger(t))
		t.Cleanup(func() { _ = a.Close() })
		if before != nil {
			if err := a.Apply(p, *before); err != nil {
				t.Fatal(err)
			}
		}
		was := dt.Snapshot(t, p)
		a.beforeFlush = func(c conn) {
			// A rule for a chain that does not exist: the kernel refuses
			// the whole batch.
			c.q.AddRule(&gnft.Rule{Table: &gnft.Table{Name: TableNAT, Family: gnft.TableFamilyINet},
				Chain: &gnft.Chain{Name: "no-such-chain"}, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}})
		}
		if err := a.Apply(p, ruleset.PodConfig{BypassInbound: true}); err == nil {
			t.Fatal("apply succeeded")
		}
		if now := dt.Snapshot(t, p); now != was {
			t.Fatalf("failed apply left changes (after %v):\nbefore:\n%s\nafter:\n%s", before != nil, was, now)
		}
	}
}

// TestRemoveRulesKeepsRoutes: moving a pod to the other backend keeps the
// policy routes both use.
func TestRemoveRulesKeepsRoutes(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "ip")
	pair := testnet.NewPair(t)
	p := pair.A.NS.Path()
	a := NewApplier(dt.Logger(t))
	t.Cleanup(func() { _ = a.Close() })
	if err := a.Apply(p, ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := a.RemoveRules(p); err != nil {
		t.Fatal(err)
	}
	d, err := a.Verify(p, ruleset.PodConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range d.Items {
		if it.Object != "table" {
			t.Errorf("unexpected drift after RemoveRules: %s", it)
		}
	}
	if !strings.Contains(dt.Run(t, p, "ip", "rule"), "lookup 100") {
		t.Error("policy rule gone")
	}
}

// TestHostProbeRepairKeepsMembers: a chain changed by hand is replaced
// without emptying the probe sets.
func TestHostProbeRepairKeepsMembers(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft")
	n := testnet.NewNS(t)
	h := NewHostProbe(dt.Logger(t), n.Path(), ruleset.HostProbeConfig{})
	t.Cleanup(func() { _ = h.Close() })
	if err := h.Ensure(); err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr("10.9.8.7")
	if err := h.AddIP(ip); err != nil {
		t.Fatal(err)
	}
	loadText(t, n.Path(), "delete chain inet ambient-probe-snat postrouting\nadd chain inet ambient-probe-snat postrouting { type nat hook postrouting priority 200; }\n")
	d, err := h.Verify()
	if err != nil || !strings.Contains(d.String(), "changed chain postrouting") {
		t.Fatalf("drift: %v\n%s", err, d)
	}
	if err := h.Ensure(); err != nil {
		t.Fatal(err)
	}
	if d, err := h.Verify(); err != nil || !d.Empty() {
		t.Fatalf("after repair: %v\n%s", err, d)
	}
	if ips, err := h.IPs(); err != nil || !slices.Equal(ips, []netip.Addr{ip}) {
		t.Fatalf("members after repair: %v %v", ips, err)
	}
	// A set replaced by one of another type is repaired too.
	loadText(t, n.Path(), "delete chain inet ambient-probe-snat postrouting\ndelete set inet ambient-probe-snat ambient-probes-v4\n"+
		"add set inet ambient-probe-snat ambient-probes-v4 { type ipv6_addr; }\n")
	if d, err := h.Verify(); err != nil || !strings.Contains(d.String(), `missing set "ambient-probes-v4 ipv4_addr"`) {
		t.Fatalf("drift: %v\n%s", err, d)
	}
	if err := h.Ensure(); err != nil {
		t.Fatal(err)
	}
	if d, err := h.Verify(); err != nil || !d.Empty() {
		t.Fatalf("after repairing the set: %v\n%s", err, d)
	}
	if err := h.Remove(); err != nil {
		t.Fatal(err)
	}
	if out := nftRuleset(t, n.Path()); strings.TrimSpace(out) != "" {
		t.Fatalf("left after Remove:\n%s", out)
	}
	if err := h.Remove(); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if err := h.AddIP(ip); err == nil {
		t.Fatal("AddIP succeeded without the set")
	}
	if err := h.DelIP(ip); err != nil {
		t.Fatalf("DelIP without the set: %v", err)
	}
}

// TestProbe: the kernel check leaves nothing behind.
func TestProbe(t *testing.T) {
	testnet.RequireRoot(t)
	n := testnet.NewNS(t)
	path := n.Path()
	if err := ns.WithNetNSPath(path, func(ns.NetNS) error { return Probe() }); err != nil {
		t.Fatalf("probe: %v", err)
	}
	if out := nftRuleset(t, path); strings.TrimSpace(out) != "" {
		t.Fatalf("probe left:\n%s", out)
	}
}

// TestRuleID: every rule carries its id as a userdata TLV.
func TestRuleID(t *testing.T) {
	if !bytes.HasPrefix(ruleID("t", "c", "r"), []byte{udataRuleID, 8}) {
		t.Error("rule id TLV")
	}
}
