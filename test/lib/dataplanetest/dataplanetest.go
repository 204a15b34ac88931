// Package dataplanetest holds what the dataplane tests of both rules
// backends share: real TCP/UDP flows through network namespaces checked
// against where they must land, topologies (a pod, a VM behind it, a host
// in front of it), and snapshots of everything a backend may change in a
// namespace (iptables of both flavours and families, the nf_tables
// ruleset, policy routing). It needs root, like the tests using it.
package dataplanetest

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/captureproxy"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
)

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// Logger logs to the test at debug level.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// Output runs a command inside the namespace ("" = the test's) and returns
// its standard output and error.
func Output(netnsPath, name string, args ...string) (string, error) {
	var out []byte
	run := func() error {
		c := exec.CommandContext(context.Background(), name, args...)
		c.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C"}
		var err error
		out, err = c.Output()
		if ee, ok := err.(*exec.ExitError); ok {
			return fmt.Errorf("%s %v: %w: %s", name, args, err, strings.TrimSpace(string(ee.Stderr)))
		}
		return err
	}
	if netnsPath == "" {
		err := run()
		return string(out), err
	}
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error { return run() })
	return string(out), err
}

// Run runs a command inside the namespace and returns its output, failing
// the test on error.
func Run(t testing.TB, netnsPath, name string, args ...string) string {
	t.Helper()
	out, err := Output(netnsPath, name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var (
	counters   = regexp.MustCompile(`\[\d+:\d+\]`)
	nftCounter = regexp.MustCompile(`counter packets \d+ bytes \d+`)
)

// normSave drops iptables-save's timestamp comments and zeroes counters.
// With dropEmpty it also drops tables holding nothing but empty built-in
// chains with ACCEPT policy: legacy x_tables instantiates a table in a
// namespace on first use and offers no way to unregister it, so such an
// inert table is the one trace removal cannot undo with that flavour.
func normSave(s string, dropEmpty bool) string {
	var out, block []string
	empty := true
	for _, l := range strings.Split(s, "\n") {
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		l = counters.ReplaceAllString(l, "[0:0]")
		block = append(block, l)
		switch {
		case strings.HasPrefix(l, "*"):
			empty = true
		case strings.HasPrefix(l, ":"):
			if !strings.Contains(l, " ACCEPT ") {
				empty = false
			}
		case l == "COMMIT":
			if !(dropEmpty && empty) {
				out = append(out, block...)
			}
			block = nil
		default:
			empty = false
		}
	}
	return strings.Join(append(out, block...), "\n")
}

// normNft zeroes counters and lists each table's chains and sets in name
// order: nft lists them in creation order, which means nothing to the
// kernel, and a chain deleted and created again moves.
func normNft(s string) string {
	s = nftCounter.ReplaceAllString(s, "counter")
	var out []string
	var blocks []string // a table's chains and sets, each a block of lines
	var cur []string
	flush := func() {
		if len(cur) > 0 {
			blocks = append(blocks, strings.Join(cur, "\n"))
			cur = nil
		}
	}
	for _, l := range strings.Split(s, "\n") {
		switch {
		case strings.HasPrefix(l, "table "):
			out = append(out, l)
		case l == "}":
			flush()
			slices.Sort(blocks)
			out = append(out, blocks...)
			out = append(out, l)
			blocks = nil
		case strings.HasPrefix(l, "\tchain ") || strings.HasPrefix(l, "\tset "):
			flush()
			cur = append(cur, l)
		case strings.TrimSpace(l) == "":
		default:
			if cur != nil {
				cur = append(cur, l)
			} else {
				out = append(out, l) // table attributes (comment, flags)
			}
		}
	}
	return strings.Join(out, "\n") + "\n"
}

// Snapshot renders, as text, everything a rules backend may change in a
// namespace: iptables (nft and legacy flavours, both families), the
// nf_tables ruleset, ip rules, and the routes of table 100. Counters are
// zeroed; a flavour whose binaries are missing is left out.
func Snapshot(t testing.TB, netnsPath string) string {
	t.Helper()
	var sb strings.Builder
	for _, save := range []string{"iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save"} {
		if _, err := exec.LookPath(save); err != nil {
			continue
		}
		fmt.Fprintf(&sb, "== %s\n%s\n", save, normSave(Run(t, netnsPath, save), strings.Contains(save, "legacy")))
	}
	if _, err := exec.LookPath("nft"); err == nil {
		fmt.Fprintf(&sb, "== nft list ruleset\n%s", normNft(Run(t, netnsPath, "nft", "list", "ruleset")))
	}
	for _, fam := range []string{"-4", "-6"} {
		fmt.Fprintf(&sb, "== ip %s rule\n%s", fam, Run(t, netnsPath, "ip", fam, "rule", "show"))
		// A FIB table, once created, stays until the namespace dies; before
		// first use `ip route show table 100` fails instead of printing
		// nothing, so only the listing itself is compared.
		out, _ := Output(netnsPath, "ip", fam, "route", "show", "table", "100")
		fmt.Fprintf(&sb, "== ip %s route show table 100\n%s", fam, out)
	}
	return sb.String()
}

// StartProxy starts a capture proxy in the namespace, closed at cleanup.
func StartProxy(t testing.TB, netnsPath string, cfg captureproxy.Config) *captureproxy.Proxy {
	t.Helper()
	p, err := captureproxy.Start(netnsPath, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// PrefixNet converts a prefix for netlink.
func PrefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// AddProbeSource gives B the probe SNAT addresses and A routes back to
// them, standing in for the host's probe SNAT.
func AddProbeSource(t testing.TB, pair *testnet.Pair) {
	t.Helper()
	for _, a := range []netip.Addr{ambient.DefaultProbeSNATv4, ambient.DefaultProbeSNATv6} {
		pfx := netip.PrefixFrom(a, a.BitLen())
		pair.B.Do(t, func() error {
			l, err := netlink.LinkByName(pair.B.IfName)
			if err != nil {
				return err
			}
			addr := &netlink.Addr{IPNet: PrefixNet(pfx)}
			if a.Is6() {
				addr.Flags = 0x02 // IFA_F_NODAD
			}
			return netlink.AddrAdd(l, addr)
		})
		pair.A.Do(t, func() error {
			l, err := netlink.LinkByName(pair.A.IfName)
			if err != nil {
				return err
			}
			return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: PrefixNet(pfx), Scope: netlink.SCOPE_LINK})
		})
	}
	// A resolves the IPv6 probe address on B's link when it answers it.
	testnet.WaitLinkReady(t, pair.B.NS, pair.B.IfName)
}

// JoinPods links two namespaces with a veth pair, each end named and
// addressed (/24 and /64) as its Pod says.
func JoinPods(t testing.TB, x, y testnet.Pod) {
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
				addr := &netlink.Addr{IPNet: PrefixNet(a)}
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
	testnet.WaitLinkReady(t, x.NS, x.IfName)
	testnet.WaitLinkReady(t, y.NS, y.IfName)
}

// Route adds a route to dst via gw in the pod's namespace.
func Route(t testing.TB, pod testnet.Pod, dst netip.Prefix, via netip.Addr) {
	t.Helper()
	pod.Do(t, func() error {
		return netlink.RouteAdd(&netlink.Route{Dst: PrefixNet(dst), Gw: via.AsSlice()})
	})
}

// Sysctl writes a sysctl (dotted name) inside the pod's namespace.
func Sysctl(t testing.TB, p testnet.Pod, key, value string) {
	t.Helper()
	p.Do(t, func() error {
		return os.WriteFile("/proc/sys/"+strings.ReplaceAll(key, ".", "/"), []byte(value), 0o644)
	})
}

// Flow is one connection attempt and where it must land.
type Flow struct {
	Name     string
	From     string // netns path
	Dst      netip.AddrPort
	Opt      captureproxy.DialOptions
	At       *captureproxy.Proxy // proxy that must record it
	WantPort uint16
	WantOrig netip.AddrPort // zero: must not be redirected
	WantPeer netip.Addr     // zero: not checked
}

// Check dials and checks where the connection landed.
func (fl Flow) Check(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := captureproxy.Dial(ctx, fl.From, fl.Dst, fl.Opt)
	if err != nil {
		t.Errorf("%s: %v", fl.Name, err)
		return
	}
	if got.Port != fl.WantPort {
		t.Errorf("%s: landed on port %d (%v), want %d", fl.Name, got.Port, got, fl.WantPort)
		return
	}
	if fl.WantOrig.IsValid() {
		if got.OrigDst != fl.WantOrig || !got.Redirected() {
			t.Errorf("%s: original destination %s (%v), want %s", fl.Name, got.OrigDst, got, fl.WantOrig)
		}
	} else if got.Redirected() {
		t.Errorf("%s: redirected (%v), want direct", fl.Name, got)
	}
	if fl.WantPeer.IsValid() && got.Peer.Addr() != fl.WantPeer {
		t.Errorf("%s: peer %s, want %s", fl.Name, got.Peer.Addr(), fl.WantPeer)
	}
	// The listener that answered is the one in the namespace we expect.
	if _, err := fl.At.WaitFor(ctx, func(r captureproxy.Record) bool { return r.Peer == got.Peer && r.Port == got.Port }); err != nil {
		t.Errorf("%s: not recorded by the expected proxy: %v", fl.Name, err)
	}
}

// AP builds an address and port.
func AP(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// Addr is the pod's address of the family (4 or 6).
func Addr(p testnet.Pod, family int) netip.Addr {
	if family == 6 {
		return p.V6
	}
	return p.V4
}

// Loopback is the loopback address of the family.
func Loopback(family int) netip.Addr {
	if family == 6 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

// Probe is the default probe SNAT address of the family.
func Probe(family int) netip.Addr {
	if family == 6 {
		return ambient.DefaultProbeSNATv6
	}
	return ambient.DefaultProbeSNATv4
}

// PeerSeen dials dst:8080 from the namespace and returns the source the
// listener saw.
func PeerSeen(t testing.TB, from string, dst netip.Addr) netip.Addr {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := captureproxy.Dial(ctx, from, netip.AddrPortFrom(dst, 8080), captureproxy.DialOptions{})
	if err != nil {
		t.Fatalf("dial %s from %s: %v", dst, from, err)
	}
	return r.Peer.Addr()
}

// HostTopology: H stands in for the node (where the host probe lives), P
// is a pod behind it (listening on 8080), C a remote client whose traffic
// H forwards to P.
type HostTopology struct {
	Pair   *testnet.Pair // A = H, B = P
	C      testnet.Pod
	H, P   string
	CPath  string
	ProxyP *captureproxy.Proxy
}

// NewHostTopology builds H, P and C.
func NewHostTopology(t testing.TB) *HostTopology {
	t.Helper()
	pair := testnet.NewPair(t)
	c := testnet.Pod{NS: testnet.NewNS(t), IfName: "eth0", V4: netip.MustParseAddr("192.168.77.2"), V6: netip.MustParseAddr("fd77::2")}
	hOnC := testnet.Pod{NS: pair.A.NS, IfName: "eth1", V4: netip.MustParseAddr("192.168.77.1"), V6: netip.MustParseAddr("fd77::1")}
	JoinPods(t, hOnC, c)
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
	Route(t, c, netip.MustParsePrefix("0.0.0.0/0"), hOnC.V4)
	Route(t, c, netip.MustParsePrefix("::/0"), hOnC.V6)
	Route(t, pair.B, netip.MustParsePrefix("192.168.77.0/24"), pair.A.V4)
	Route(t, pair.B, netip.MustParsePrefix("fd77::/64"), pair.A.V6)
	Route(t, pair.B, netip.PrefixFrom(ambient.DefaultProbeSNATv4, 32), pair.A.V4)
	Route(t, pair.B, netip.PrefixFrom(ambient.DefaultProbeSNATv6, 128), pair.A.V6)
	top := &HostTopology{Pair: pair, C: c, H: pair.A.NS.Path(), P: pair.B.NS.Path(), CPath: c.NS.Path()}
	top.ProxyP = StartProxy(t, top.P, captureproxy.Config{TCPPorts: []uint16{8080}})
	return top
}
