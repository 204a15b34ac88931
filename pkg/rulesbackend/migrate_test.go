package rulesbackend

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/captureproxy"
	dt "github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func TestParse(t *testing.T) {
	for in, want := range map[string][2]string{
		"": {"auto", ""}, "auto": {"auto", ""}, " AUTO ": {"auto", ""}, "nftables": {"nftables", ""},
		"iptables": {"iptables", ""}, "nft": {"iptables", "nft"}, "iptables-legacy": {"iptables", "legacy"},
	} {
		sel, err := Parse(in)
		if err != nil || string(sel.Choice) != want[0] || string(sel.Flavour) != want[1] {
			t.Errorf("Parse(%q) = %+v %v, want %q", in, sel, err, want)
		}
		if again, err := Parse(sel.String()); err != nil || again != sel {
			t.Errorf("Parse(%q.String()) = %+v %v, want %+v", in, again, err, sel)
		}
	}
	for _, in := range []string{"ebpf", "nf_tables2", "ipvs"} {
		if _, err := Parse(in); err == nil {
			t.Errorf("Parse(%q) accepted", in)
		}
	}
}

// mustParse is Parse for values a test knows to be valid.
func mustParse(tb testing.TB, s string) Selection {
	tb.Helper()
	sel, err := Parse(s)
	if err != nil {
		tb.Fatal(err)
	}
	return sel
}

// TestAuto: on a kernel with nf_tables (this one), auto picks nftables,
// and the probe leaves nothing in the caller's namespace.
func TestAuto(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft")
	n := testnet.NewNS(t)
	before := dt.Snapshot(t, n.Path())
	b, err := New(Config{Backend: mustParse(t, "auto"), HostNetns: n.Path()})
	if err != nil {
		t.Fatal(err)
	}
	if b.Name != "nftables" {
		t.Fatalf("auto chose %s", b.Name)
	}
	if after := dt.Snapshot(t, n.Path()); after != before {
		t.Fatalf("choosing changed a namespace:\n%s\n---\n%s", before, after)
	}
}

// TestMigration: a pod enrolled by one backend is taken over by another:
// Verify names the other backend's rules, Apply replaces them (capture
// holds), and Remove clears both; the host probe moves likewise.
func TestMigration(t *testing.T) {
	testnet.RequireRoot(t)
	for _, from := range backends {
		for _, to := range backends {
			if from.name == to.name {
				continue
			}
			t.Run(from.name+"->"+to.name, func(t *testing.T) {
				from.require(t)
				to.require(t)
				old, cur := from.build(t, ""), to.build(t, "")
				cfg := ruleset.PodConfig{DNSCapture: true}

				want := aloneSnapshot(t, cur, cfg)

				pair := testnet.NewPair(t)
				A := pair.A.NS.Path()
				before := dt.Snapshot(t, A)
				proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001}})
				if err := old.Rules.Apply(A, cfg); err != nil {
					t.Fatal(err)
				}
				d, err := cur.Rules.Verify(A, cfg)
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(d.String(), "("+from.name+" backend)") {
					t.Fatalf("the other backend's rules are not named:\n%s", d)
				}
				if err := cur.Rules.Apply(A, cfg); err != nil {
					t.Fatal(err)
				}
				if d, err := cur.Rules.Verify(A, cfg); err != nil || !d.Empty() {
					t.Fatalf("verify after taking over: %v\n%s", err, d)
				}
				if got := dt.Snapshot(t, A); got != want {
					t.Fatalf("after taking over, the pod holds more than the new backend's rules:\n%s\n--- want\n%s", got, want)
				}
				dt.Flow{Name: "captured after the move", From: A, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)

				// Remove by the new backend clears the old one's rules too.
				if err := old.Rules.Apply(A, cfg); err != nil {
					t.Fatal(err)
				}
				if err := cur.Rules.Remove(A); err != nil {
					t.Fatal(err)
				}
				if after := dt.Snapshot(t, A); after != before {
					t.Fatalf("remove left rules:\n%s\n---\n%s", before, after)
				}
			})
		}
	}
}

// TestHostMigration: the first Ensure of a backend removes the other's
// host probe SNAT and sets.
func TestHostMigration(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "ipset")
	for _, from := range backends {
		for _, to := range backends {
			if from.name == to.name {
				continue
			}
			t.Run(from.name+"->"+to.name, func(t *testing.T) {
				from.require(t)
				to.require(t)
				n := testnet.NewNS(t)
				H := n.Path()
				before := hostSnapshot(t, H)
				old, cur := from.build(t, H), to.build(t, H)
				ref := testnet.NewNS(t)
				curRef := to.build(t, ref.Path())
				if err := curRef.Probe.Ensure(); err != nil {
					t.Fatal(err)
				}
				want := hostSnapshot(t, ref.Path())
				if err := curRef.Probe.Remove(); err != nil {
					t.Fatal(err)
				}

				if err := old.Probe.Ensure(); err != nil {
					t.Fatal(err)
				}
				if err := old.Probe.AddIP(netip.MustParseAddr("10.1.2.3")); err != nil {
					t.Fatal(err)
				}
				if err := cur.Probe.Ensure(); err != nil {
					t.Fatal(err)
				}
				// Enrolled pods keep their probe SNAT through the switch.
				if ips, err := cur.Probe.IPs(); err != nil || len(ips) != 1 || ips[0] != netip.MustParseAddr("10.1.2.3") {
					t.Fatalf("probe set after the move: %v %v", ips, err)
				}
				if err := cur.Probe.DelIP(netip.MustParseAddr("10.1.2.3")); err != nil {
					t.Fatal(err)
				}
				if got := hostSnapshot(t, H); got != want {
					t.Fatalf("after the move the host holds:\n%s\n--- want\n%s", got, want)
				}
				if err := cur.Probe.Remove(); err != nil {
					t.Fatal(err)
				}
				if after := hostSnapshot(t, H); after != before {
					t.Fatalf("remove left:\n%s\n---\n%s", before, after)
				}
			})
		}
	}
}

// TestIstioCNIRulesLeaveNothing: a pod istio-cni captured with its
// iptables-nft rules (testdata: as Istio's agent wrote them on the real
// node) is taken over by each backend with capture holding, and removal
// leaves the pod as it was before istio-cni: the nf_tables tables
// istio-cni's iptables made go once nothing but empty built-in chains is
// left in them, whichever backend emptied them.
func TestIstioCNIRulesLeaveNothing(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-nft-restore", "ip6tables-nft-restore", "nft")
	for _, bc := range backends {
		t.Run(bc.name, func(t *testing.T) {
			bc.require(t)
			cur := bc.build(t, "")
			cfg := ruleset.PodConfig{DNSCapture: true}

			want := aloneSnapshot(t, cur, cfg)

			pair := testnet.NewPair(t)
			A := pair.A.NS.Path()
			before := dt.Snapshot(t, A)
			restoreFile(t, A, "iptables-nft-restore", "testdata/istio-cni-inpod-v4.rules")
			restoreFile(t, A, "ip6tables-nft-restore", "testdata/istio-cni-inpod-v6.rules")
			proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001}})
			dt.Flow{Name: "captured by istio-cni", From: A, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)

			if err := cur.Rules.Apply(A, cfg); err != nil {
				t.Fatal(err)
			}
			if d, err := cur.Rules.Verify(A, cfg); err != nil || !d.Empty() {
				t.Fatalf("verify after taking over: %v\n%s", err, d)
			}
			// The nftables backend leaves nothing of istio-cni's; the
			// iptables ones fill its tables with their own rules.
			if bc.value == "nftables" {
				if got := dt.Snapshot(t, A); got != want {
					t.Fatalf("after taking over, the pod holds more than the backend's rules:\n%s\n--- want\n%s", got, want)
				}
			}
			dt.Flow{Name: "captured after the move", From: A, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)

			if err := cur.Rules.Remove(A); err != nil {
				t.Fatal(err)
			}
			if after := dt.Snapshot(t, A); after != before {
				t.Fatalf("remove left something:\n%s\n--- want\n%s", after, before)
			}
		})
	}
}

// aloneSnapshot is what backend b alone leaves in a new pod.
func aloneSnapshot(t *testing.T, b *Backend, cfg ruleset.PodConfig) string {
	t.Helper()
	ref := testnet.NewPair(t)
	if err := b.Rules.Apply(ref.A.NS.Path(), cfg); err != nil {
		t.Fatal(err)
	}
	return dt.Snapshot(t, ref.A.NS.Path())
}

// restoreFile feeds a rules file to an iptables-restore in the namespace.
func restoreFile(t *testing.T, netnsPath, restore, file string) {
	t.Helper()
	in, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	err = ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		c := exec.Command(restore)
		c.Stdin = bytes.NewReader(in)
		if out, err := c.CombinedOutput(); err != nil {
			return fmt.Errorf("%s < %s: %w: %s", restore, file, err, out)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
