package iptables

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func TestHostProbeGolden(t *testing.T) {
	for _, f := range ruleset.Families {
		got := HostProbeRules(ruleset.HostProbeConfig{}, f).Render()
		path := filepath.Join("testdata", "golden", "host-probe."+f.String()+".rules")
		if *update {
			if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("read golden (run with -update): %v", err)
		}
		if got != string(want) {
			t.Errorf("%s: render differs from %s:\n%s", f, path, got)
		}
	}
	custom := HostProbeRules(ruleset.HostProbeConfig{ProbeSNATv4: netip.MustParseAddr("169.254.9.9")}, ruleset.IPv4).Render()
	if !strings.Contains(custom, "--to-source 169.254.9.9") {
		t.Errorf("custom probe address ignored:\n%s", custom)
	}
}

func TestHostProbeScopeIsolation(t *testing.T) {
	// Pod planning never touches the host chain and vice versa.
	s, err := ParseSave("*nat\n:POSTROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:AMBIENT_PROBE_SNAT - [0:0]\n" +
		"-A POSTROUTING -j AMBIENT_PROBE_SNAT\nCOMMIT\n")
	if err != nil {
		t.Fatal(err)
	}
	if p := PlanRemove(s); p != "" {
		t.Errorf("pod removal touches the host chain:\n%s", p)
	}
	applied := edit(t, s, PlanApply(PodRules(ruleset.PodConfig{}, ruleset.IPv4), s))
	if p := planRemoveScope(hostScope, applied); strings.Contains(p, "ISTIO") {
		t.Errorf("host removal touches pod chains:\n%s", p)
	}
}

// TestHostProbeJumpFirst: the jump is inserted at the top of POSTROUTING,
// above rules already there, and every plan puts it back there.
func TestHostProbeJumpFirst(t *testing.T) {
	rs := HostProbeRules(ruleset.HostProbeConfig{}, ruleset.IPv4)
	base, err := ParseSave("*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -s 10.0.0.0/8 -j MASQUERADE\nCOMMIT\n")
	if err != nil {
		t.Fatal(err)
	}
	jump := "-j " + ChainProbeSNAT
	wantChain := func(s *Save, want ...string) {
		t.Helper()
		var got []string
		for _, r := range s.Table("nat").Chain("POSTROUTING").Rules {
			got = append(got, r.Spec())
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("POSTROUTING = %q, want %q", got, want)
		}
		if d := rs.Diff(s); !d.Empty() {
			t.Fatalf("drift after plan:\n%s", d)
		}
		if p := PlanApply(rs, s); p != "" {
			t.Fatalf("converged state still plans:\n%s", p)
		}
	}
	applied := edit(t, base, PlanApply(rs, base))
	wantChain(applied, jump, "-s 10.0.0.0/8 -j MASQUERADE")

	for _, tc := range []struct {
		name, snippet string
		drift         []string
		after         []string
	}{
		{"rule inserted above", "*nat\n-I POSTROUTING 1 -p tcp -j ACCEPT\nCOMMIT\n",
			[]string{`ipv4 nat POSTROUTING: moved rule #1 "-A POSTROUTING -j AMBIENT_PROBE_SNAT"`},
			[]string{jump, "-p tcp -j ACCEPT", "-s 10.0.0.0/8 -j MASQUERADE"}},
		{"copy appended", "*nat\n-A POSTROUTING -j AMBIENT_PROBE_SNAT\nCOMMIT\n",
			[]string{`ipv4 nat POSTROUTING: extra rule "-A POSTROUTING -j AMBIENT_PROBE_SNAT"`},
			[]string{jump, "-s 10.0.0.0/8 -j MASQUERADE"}},
		{"moved and copied", "*nat\n-I POSTROUTING 1 -j MASQUERADE\n-A POSTROUTING -j AMBIENT_PROBE_SNAT\nCOMMIT\n",
			[]string{`ipv4 nat POSTROUTING: moved rule #1`, `ipv4 nat POSTROUTING: extra rule "-A POSTROUTING -j AMBIENT_PROBE_SNAT"`},
			[]string{jump, "-j MASQUERADE", "-s 10.0.0.0/8 -j MASQUERADE"}},
		{"jump deleted", "*nat\n-D POSTROUTING -j AMBIENT_PROBE_SNAT\nCOMMIT\n",
			[]string{`ipv4 nat POSTROUTING: missing rule #1 "-A POSTROUTING -j AMBIENT_PROBE_SNAT"`},
			[]string{jump, "-s 10.0.0.0/8 -j MASQUERADE"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := edit(t, applied, tc.snippet)
			d := rs.Diff(s)
			if len(d.Items) != len(tc.drift) {
				t.Fatalf("drift:\n%s\nwant %q", d, tc.drift)
			}
			for i, w := range tc.drift {
				if !strings.HasPrefix(d.Items[i].String(), w) {
					t.Errorf("drift %d = %s, want prefix %s", i, d.Items[i], w)
				}
			}
			wantChain(edit(t, s, PlanApply(rs, s)), tc.after...)
		})
	}
}

func fakeHostProbe() (*HostProbe, *fakeHost, *fakeSets) {
	h, sets := newFakeHost(BackendNFT), newFakeSets()
	return NewHostProbe(nil, BackendNFT, "", ruleset.HostProbeConfig{}, WithExecutor(h), WithRouter(h), WithTableOwner(h), WithIPSets(sets)), h, sets
}

func TestHostProbeFlowWithFake(t *testing.T) {
	hp, h, sets := fakeHostProbe()
	if err := hp.Ensure(); err != nil {
		t.Fatal(err)
	}
	wantLog(t, h.takeLog(), BackendNFT, []string{"save", "restore"}, 1)
	if err := hp.Ensure(); err != nil {
		t.Fatal(err)
	}
	wantLog(t, h.takeLog(), BackendNFT, []string{"save"}, 0)
	if d, err := hp.Verify(); err != nil || !d.Empty() {
		t.Fatalf("verify: %v %s", err, d)
	}
	pod4, pod6 := netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00::5")
	for _, ip := range []netip.Addr{pod4, pod6, pod4, netip.MustParseAddr("::ffff:10.1.0.6")} {
		if err := hp.AddIP(ip); err != nil {
			t.Fatalf("add %s: %v", ip, err)
		}
	}
	if err := hp.DelIP(netip.MustParseAddr("10.1.0.6")); err != nil {
		t.Fatal(err)
	}
	if err := hp.DelIP(netip.MustParseAddr("10.9.9.9")); err != nil {
		t.Fatalf("deleting an absent IP: %v", err)
	}
	ips, err := hp.IPs()
	if err != nil || !reflect.DeepEqual(ips, []netip.Addr{pod4, pod6}) {
		t.Fatalf("IPs = %v, %v", ips, err)
	}
	for _, bad := range []netip.Addr{{}, netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::"), netip.MustParseAddr("fe80::1%eth0"), netip.MustParseAddr("224.0.0.1")} {
		if err := hp.AddIP(bad); err == nil {
			t.Errorf("AddIP(%v) accepted", bad)
		}
	}
	if err := hp.Remove(); err != nil {
		t.Fatal(err)
	}
	if len(sets.sets[""]) != 0 {
		t.Fatalf("sets left: %v", sets.sets[""])
	}
	for _, f := range ruleset.Families {
		if n := len(h.ns[""].saves[f].Tables); n != 0 {
			t.Fatalf("%s tables left: %s", f, h.ns[""].saves[f])
		}
	}
	if err := hp.Remove(); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if d, _ := hp.Verify(); !strings.Contains(d.String(), "missing ipset") || !strings.Contains(d.String(), "missing chain AMBIENT_PROBE_SNAT") {
		t.Fatalf("verify after remove:\n%s", d)
	}
}

func TestApplierRefusesEmptyPath(t *testing.T) {
	a, h := fakeApplier(BackendNFT)
	if err := a.Apply("", ruleset.PodConfig{}); err == nil {
		t.Error("Apply into the caller's own namespace accepted")
	}
	if _, err := a.Verify("", ruleset.PodConfig{}); err == nil {
		t.Error("Verify with empty path accepted")
	}
	if err := a.Remove(""); err == nil {
		t.Error("Remove with empty path accepted")
	}
	if log := h.takeLog(); len(log) != 0 {
		t.Errorf("ran %v", log)
	}
}

// addForeignRule runs the removal's restore, then adds another tool's rule
// to POSTROUTING: what a kube-proxy sync between our look at the ruleset
// and our table deletion would do.
type addForeignRule struct {
	Executor
	b Backend
}

func (e addForeignRule) Run(ctx context.Context, netnsPath string, cmd Cmd) ([]byte, error) {
	out, err := e.Executor.Run(ctx, netnsPath, cmd)
	if err == nil && cmd.Name == e.b.RestoreCmd(ruleset.IPv4) && strings.Contains(string(cmd.Stdin), "-X "+ChainProbeSNAT) {
		_, err = e.Executor.Run(ctx, netnsPath, Cmd{Name: e.b.Cmd(ruleset.IPv4), Args: []string{"-t", "nat", "-A", "POSTROUTING", "-d", "10.99.99.99/32", "-j", "ACCEPT"}})
	}
	return out, err
}

// TestHostProbeRemovesOnlyItsOwn: install + uninstall leave the host's
// rulesets and sets as they were: a nat table that was there before (even
// empty) stays, one Ensure created goes, and a rule another tool adds
// while we remove ours keeps its table.
func TestHostProbeRemovesOnlyItsOwn(t *testing.T) {
	requireBackend(t, BackendNFT)
	testnet.RequireCommands(t, "ipset")
	b := BackendNFT
	snap := func(t *testing.T, path string) string {
		return hostSnapshot(t, path)
	}
	for _, tc := range []struct {
		name  string
		setup []string // nft commands run before Ensure
	}{
		{"no nat table", nil},
		{"empty nat tables", []string{"add table ip nat", "add table ip6 nat"}},
		{"empty nat base chains", []string{"add table ip nat", "add chain ip nat POSTROUTING { type nat hook postrouting priority srcnat; }",
			"add table ip6 nat", "add chain ip6 nat POSTROUTING { type nat hook postrouting priority srcnat; }"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := testnet.NewNS(t)
			H := n.Path()
			for _, c := range tc.setup {
				run(t, H, "nft", strings.Fields(c)...)
			}
			before := snap(t, H)
			hp := NewHostProbe(testLogger(t), b, H, ruleset.HostProbeConfig{})
			if err := hp.Ensure(); err != nil {
				t.Fatal(err)
			}
			if err := hp.AddIP(netip.MustParseAddr("10.1.2.3")); err != nil {
				t.Fatal(err)
			}
			if err := hp.Remove(); err != nil {
				t.Fatal(err)
			}
			if after := snap(t, H); after != before {
				t.Fatalf("install + uninstall changed the host:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
	t.Run("rule added during removal", func(t *testing.T) {
		n := testnet.NewNS(t)
		H := n.Path()
		hp := NewHostProbe(testLogger(t), b, H, ruleset.HostProbeConfig{}, WithExecutor(addForeignRule{NetnsExecutor{}, b}))
		if err := hp.Ensure(); err != nil {
			t.Fatal(err)
		}
		if err := hp.Remove(); err != nil {
			t.Fatal(err)
		}
		if out := run(t, H, b.SaveCmd(ruleset.IPv4)); !strings.Contains(out, "-A POSTROUTING -d 10.99.99.99/32 -j ACCEPT") {
			t.Fatalf("another tool's rule went with our table:\n%s", out)
		}
	})
}
