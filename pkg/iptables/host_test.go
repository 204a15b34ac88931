package iptables

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/internal/captureproxy"
	"github.com/ambient-cni/ambient-cni/internal/testnet"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/vishvananda/netlink"
)

func TestHostProbeGolden(t *testing.T) {
	for _, f := range Families {
		got := HostProbeRules(HostProbeConfig{}, f).Render()
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
	custom := HostProbeRules(HostProbeConfig{ProbeSNATv4: netip.MustParseAddr("169.254.9.9")}, IPv4).Render()
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
	applied := edit(t, s, PlanApply(PodRules(PodConfig{}, IPv4), s))
	if p := planRemoveScope(hostScope, applied); strings.Contains(p, "ISTIO") {
		t.Errorf("host removal touches pod chains:\n%s", p)
	}
}

// TestHostProbeJumpFirst: the jump is inserted at the top of POSTROUTING,
// above rules already there, and every plan puts it back there.
func TestHostProbeJumpFirst(t *testing.T) {
	rs := HostProbeRules(HostProbeConfig{}, IPv4)
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
	return NewHostProbe(nil, BackendNFT, "", HostProbeConfig{}, WithExecutor(h), WithRouter(h), WithTableOwner(h), WithIPSets(sets)), h, sets
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
	for _, f := range Families {
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
	if err := a.Apply("", PodConfig{}); err == nil {
		t.Error("Apply into the caller's own namespace accepted")
	}
	if _, err := a.Verify("", PodConfig{}); err == nil {
		t.Error("Verify with empty path accepted")
	}
	if err := a.Remove(""); err == nil {
		t.Error("Remove with empty path accepted")
	}
	if log := h.takeLog(); len(log) != 0 {
		t.Errorf("ran %v", log)
	}
}

// hostTopology: H stands in for the node (the HostProbe's namespace), P is
// a pod behind it, C a remote client whose traffic H forwards to P.
type hostTopology struct {
	pair   *testnet.Pair // A = H, B = P
	c      testnet.Pod
	hOnC   testnet.Pod // H's side of the H–C link
	H, P   string
	cPath  string
	proxyP *captureproxy.Proxy
}

func link(t *testing.T, pod testnet.Pod, dst netip.Prefix, via netip.Addr) {
	t.Helper()
	pod.Do(t, func() error {
		return netlink.RouteAdd(&netlink.Route{Dst: prefixNet(dst), Gw: via.AsSlice()})
	})
}

// joinPods links two namespaces with a veth pair, each end named and
// addressed (/24 and /64) as its Pod says.
func joinPods(t *testing.T, x, y testnet.Pod) {
	t.Helper()
	tmpX, tmpY := testnet.RandName("tjx", 8), testnet.RandName("tjy", 8)
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: tmpX}, PeerName: tmpY}); err != nil {
		t.Fatal(err)
	}
	for _, side := range []struct {
		tmp string
		pod testnet.Pod
	}{{tmpX, x}, {tmpY, y}} {
		l, err := netlink.LinkByName(side.tmp)
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetNsFd(l, int(side.pod.NS.Fd())); err != nil {
			_ = netlink.LinkDel(l)
			t.Fatal(err)
		}
		side.pod.Do(t, func() error {
			l, err := netlink.LinkByName(side.tmp)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetName(l, side.pod.IfName); err != nil {
				return err
			}
			for _, a := range []netip.Prefix{netip.PrefixFrom(side.pod.V4, 24), netip.PrefixFrom(side.pod.V6, 64)} {
				addr := &netlink.Addr{IPNet: prefixNet(a)}
				if a.Addr().Is6() {
					addr.Flags = 0x02 // IFA_F_NODAD
				}
				if err := netlink.AddrAdd(l, addr); err != nil {
					return err
				}
			}
			return netlink.LinkSetUp(l)
		})
	}
}

func newHostTopology(t *testing.T) *hostTopology {
	t.Helper()
	pair := testnet.NewPair(t)
	c := testnet.Pod{NS: testnet.NewNS(t), IfName: "eth0", V4: netip.MustParseAddr("192.168.77.2"), V6: netip.MustParseAddr("fd77::2")}
	hOnC := testnet.Pod{NS: pair.A.NS, IfName: "eth1", V4: netip.MustParseAddr("192.168.77.1"), V6: netip.MustParseAddr("fd77::1")}
	joinPods(t, hOnC, c)
	pair.A.Do(t, func() error {
		for _, k := range []string{"/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"} {
			if err := os.WriteFile(k, []byte("1"), 0o644); err != nil {
				return err
			}
		}
		return nil
	})
	// C reaches P through H; P answers C and the probe addresses through H
	// (a pod's default route points at the node in real clusters).
	link(t, c, netip.MustParsePrefix("0.0.0.0/0"), hOnC.V4)
	link(t, c, netip.MustParsePrefix("::/0"), hOnC.V6)
	link(t, pair.B, netip.MustParsePrefix("192.168.77.0/24"), pair.A.V4)
	link(t, pair.B, netip.MustParsePrefix("fd77::/64"), pair.A.V6)
	link(t, pair.B, netip.PrefixFrom(ambient.DefaultProbeSNATv4, 32), pair.A.V4)
	link(t, pair.B, netip.PrefixFrom(ambient.DefaultProbeSNATv6, 128), pair.A.V6)
	top := &hostTopology{pair: pair, c: c, hOnC: hOnC, H: pair.A.NS.Path(), P: pair.B.NS.Path(), cPath: c.NS.Path()}
	top.proxyP = startProxy(t, top.P, captureproxy.Config{TCPPorts: []uint16{8080}})
	return top
}

// peerSeen dials P:8080 from the namespace and returns the source P saw.
func peerSeen(t *testing.T, from string, dst netip.Addr) netip.Addr {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := captureproxy.Dial(ctx, from, netip.AddrPortFrom(dst, 8080), captureproxy.DialOptions{})
	if err != nil {
		t.Fatalf("dial %s from %s: %v", dst, from, err)
	}
	return r.Peer.Addr()
}

func hostSnapshot(t *testing.T, b Backend, path string) string {
	t.Helper()
	var sb strings.Builder
	for _, f := range Families {
		sb.WriteString(normSave(run(t, path, b.SaveCmd(f)), b == BackendLegacy) + "\n")
	}
	sb.WriteString(run(t, path, "ipset", "list", "-n"))
	return sb.String()
}

func TestHostProbe(t *testing.T) {
	testnet.RequireRoot(t)
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		t.Run(string(b), func(t *testing.T) {
			requireBackend(t, b)
			testnet.RequireCommands(t, "ipset")
			top := newHostTopology(t)
			// Another tool's MASQUERADE of the node's own traffic, already
			// in place: the probe SNAT must still win (its jump goes in
			// first).
			for _, f := range Families {
				run(t, top.H, b.Cmd(f), "-t", "nat", "-A", "POSTROUTING", "-s", podAddr(top.pair.A, f).String(), "-p", "tcp", "-j", "MASQUERADE")
			}
			before := hostSnapshot(t, b, top.H)
			hp := NewHostProbe(testLogger(t), b, top.H, HostProbeConfig{})
			pod := top.pair.B

			for _, f := range Families {
				if got := peerSeen(t, top.H, podAddr(pod, f)); got != podAddr(top.pair.A, f) {
					t.Fatalf("%s before Ensure: P saw %s, want H's own address", f, got)
				}
			}
			if err := hp.Ensure(); err != nil {
				t.Fatalf("ensure: %v", err)
			}
			ensured := hostSnapshot(t, b, top.H)
			if err := hp.Ensure(); err != nil {
				t.Fatalf("second ensure: %v", err)
			}
			if again := hostSnapshot(t, b, top.H); again != ensured {
				t.Fatalf("second Ensure changed state:\n%s\n---\n%s", ensured, again)
			}
			if d, err := hp.Verify(); err != nil || !d.Empty() {
				t.Fatalf("verify: %v\n%s", err, d)
			}
			// Enrolled only after AddIP: the set decides.
			if got := peerSeen(t, top.H, pod.V4); got != top.pair.A.V4 {
				t.Fatalf("SNAT before AddIP: P saw %s", got)
			}
			for _, f := range Families {
				if err := hp.AddIP(podAddr(pod, f)); err != nil {
					t.Fatal(err)
				}
			}
			ips, err := hp.IPs()
			if err != nil || !reflect.DeepEqual(ips, []netip.Addr{pod.V4, pod.V6}) {
				t.Fatalf("IPs = %v, %v", ips, err)
			}
			for _, f := range Families {
				if got := peerSeen(t, top.H, podAddr(pod, f)); got != probeAddr(f) {
					t.Errorf("%s host-originated probe: P saw %s, want %s", f, got, probeAddr(f))
				}
				// Forwarded traffic has no local socket: never SNATed.
				if got := peerSeen(t, top.cPath, podAddr(pod, f)); got != podAddr(top.c, f) {
					t.Errorf("%s forwarded: P saw %s, want the client's %s", f, got, podAddr(top.c, f))
				}
			}

			// A rule another tool inserts above ours later is drift, and
			// the next Ensure puts the jump back on top.
			accept := []string{"-t", "nat", "-I", "POSTROUTING", "1", "-s", top.pair.A.V4.String(), "-p", "tcp", "-j", "ACCEPT"}
			run(t, top.H, b.Cmd(IPv4), accept...)
			if got := peerSeen(t, top.H, pod.V4); got != top.pair.A.V4 {
				t.Fatalf("an ACCEPT above the jump did not take the probe (P saw %s): the check proves nothing", got)
			}
			d, err := hp.Verify()
			if err != nil || d.String() != `ipv4 nat POSTROUTING: moved rule #1 "-A POSTROUTING -j AMBIENT_PROBE_SNAT"` {
				t.Fatalf("jump below another rule not named: %v\n%s", err, d)
			}
			if err := hp.Ensure(); err != nil {
				t.Fatal(err)
			}
			if got := peerSeen(t, top.H, pod.V4); got != probeAddr(IPv4) {
				t.Errorf("after Ensure moved the jump back P saw %s", got)
			}
			accept[2] = "-D"
			run(t, top.H, b.Cmd(IPv4), append(accept[:4], accept[5:]...)...)

			// Drift: delete the SNAT rule by hand.
			run(t, top.H, b.Cmd(IPv4), "-t", "nat", "-F", ChainProbeSNAT)
			d, err = hp.Verify()
			if err != nil || !strings.Contains(d.String(), `ipv4 nat AMBIENT_PROBE_SNAT: missing rule #1 "-A AMBIENT_PROBE_SNAT -p tcp -m owner --socket-exists -m set --match-set ambient-probes-v4 dst -j SNAT --to-source 169.254.7.127"`) {
				t.Fatalf("drift not named: %v\n%s", err, d)
			}
			if err := hp.Ensure(); err != nil {
				t.Fatal(err)
			}
			if got := peerSeen(t, top.H, pod.V4); got != probeAddr(IPv4) {
				t.Errorf("after repair P saw %s", got)
			}

			for _, f := range Families {
				if err := hp.DelIP(podAddr(pod, f)); err != nil {
					t.Fatal(err)
				}
				if err := hp.DelIP(podAddr(pod, f)); err != nil {
					t.Fatalf("second DelIP: %v", err)
				}
				if got := peerSeen(t, top.H, podAddr(pod, f)); got != podAddr(top.pair.A, f) {
					t.Errorf("%s after DelIP: P saw %s", f, got)
				}
			}
			if err := hp.AddIP(pod.V4); err != nil { // Remove must also drop members
				t.Fatal(err)
			}
			if err := hp.Remove(); err != nil {
				t.Fatalf("remove: %v", err)
			}
			if after := hostSnapshot(t, b, top.H); after != before {
				t.Fatalf("remove did not restore:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			if err := hp.Remove(); err != nil {
				t.Fatalf("second remove: %v", err)
			}
			if got := peerSeen(t, top.H, pod.V4); got != top.pair.A.V4 {
				t.Errorf("after Remove P saw %s", got)
			}
			if err := hp.AddIP(pod.V4); err == nil {
				t.Error("AddIP succeeded with the set gone")
			}
		})
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
	if err == nil && cmd.Name == e.b.RestoreCmd(IPv4) && strings.Contains(string(cmd.Stdin), "-X "+ChainProbeSNAT) {
		_, err = e.Executor.Run(ctx, netnsPath, Cmd{Name: e.b.Cmd(IPv4), Args: []string{"-t", "nat", "-A", "POSTROUTING", "-d", "10.99.99.99/32", "-j", "ACCEPT"}})
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
		return hostSnapshot(t, b, path) + run(t, path, "nft", "list", "ruleset")
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
			hp := NewHostProbe(testLogger(t), b, H, HostProbeConfig{})
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
		hp := NewHostProbe(testLogger(t), b, H, HostProbeConfig{}, WithExecutor(addForeignRule{NetnsExecutor{}, b}))
		if err := hp.Ensure(); err != nil {
			t.Fatal(err)
		}
		if err := hp.Remove(); err != nil {
			t.Fatal(err)
		}
		if out := run(t, H, b.SaveCmd(IPv4)); !strings.Contains(out, "-A POSTROUTING -d 10.99.99.99/32 -j ACCEPT") {
			t.Fatalf("another tool's rule went with our table:\n%s", out)
		}
	})
}
