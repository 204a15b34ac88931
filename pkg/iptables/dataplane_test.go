package iptables

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/internal/captureproxy"
	"github.com/ambient-cni/ambient-cni/internal/testnet"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
)

// These tests drive real iptables (both backends), real netlink and real
// TCP/UDP through two network namespaces joined by a veth pair. They need
// root; without it they skip (or fail under CI=true).

// requireBackend skips unless b's binaries (and what the tests use) exist.
func requireBackend(t *testing.T, b Backend) {
	t.Helper()
	testnet.RequireRoot(t)
	cmds := []string{"ip"}
	for _, f := range Families {
		cmds = append(cmds, b.Cmd(f), b.SaveCmd(f), b.RestoreCmd(f))
	}
	if b == BackendNFT {
		cmds = append(cmds, "nft")
	}
	testnet.RequireCommands(t, cmds...)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// run runs a command inside the namespace and returns its stdout.
func run(t *testing.T, netnsPath string, name string, args ...string) string {
	t.Helper()
	out, err := NetnsExecutor{}.Run(context.Background(), netnsPath, Cmd{Name: name, Args: args})
	if err != nil {
		t.Fatalf("%s %v: %v", name, args, err)
	}
	return string(out)
}

var counters = regexp.MustCompile(`\[\d+:\d+\]`)

// normSave drops iptables-save's timestamp comments and zeroes counters.
// With dropEmpty it also drops tables holding nothing but empty built-in
// chains with ACCEPT policy: legacy x_tables instantiates a table in a
// namespace on first use and offers no way to unregister it, so such an
// inert table is the one trace removal cannot undo with that backend.
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

// snapshot is everything Remove must restore, as text.
func snapshot(t *testing.T, b Backend, netnsPath string) string {
	t.Helper()
	var sb strings.Builder
	for _, f := range Families {
		fmt.Fprintf(&sb, "== %s\n%s\n", b.SaveCmd(f), normSave(run(t, netnsPath, b.SaveCmd(f)), b == BackendLegacy))
		fam := "-4"
		if f == IPv6 {
			fam = "-6"
		}
		fmt.Fprintf(&sb, "== ip %s rule\n%s", fam, run(t, netnsPath, "ip", fam, "rule", "show"))
		// A FIB table, once created, stays until the namespace dies; before
		// first use `ip route show table 100` fails instead of printing
		// nothing, so only the listing itself is compared.
		out, _ := NetnsExecutor{}.Run(context.Background(), netnsPath, Cmd{Name: "ip", Args: []string{fam, "route", "show", "table", "100"}})
		fmt.Fprintf(&sb, "== ip %s route show table 100\n%s", fam, out)
	}
	return sb.String()
}

func startProxy(t *testing.T, netnsPath string, cfg captureproxy.Config) *captureproxy.Proxy {
	t.Helper()
	p, err := captureproxy.Start(netnsPath, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// addProbeSource gives B the probe SNAT addresses and A routes back to
// them, standing in for the host's probe SNAT.
func addProbeSource(t *testing.T, pair *testnet.Pair) {
	t.Helper()
	for _, a := range []netip.Addr{ambient.DefaultProbeSNATv4, ambient.DefaultProbeSNATv6} {
		pfx := netip.PrefixFrom(a, a.BitLen())
		pair.B.Do(t, func() error {
			l, err := netlink.LinkByName(pair.B.IfName)
			if err != nil {
				return err
			}
			addr := &netlink.Addr{IPNet: prefixNet(pfx)}
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
			return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: prefixNet(pfx), Scope: netlink.SCOPE_LINK})
		})
	}
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// flow is one connection attempt and where it must land.
type flow struct {
	name     string
	from     string // netns path
	dst      netip.AddrPort
	opt      captureproxy.DialOptions
	at       *captureproxy.Proxy // proxy that must record it
	wantPort uint16
	wantOrig netip.AddrPort // zero: must not be redirected
	wantPeer netip.Addr     // zero: not checked
}

func (fl flow) check(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := captureproxy.Dial(ctx, fl.from, fl.dst, fl.opt)
	if err != nil {
		t.Errorf("%s: %v", fl.name, err)
		return
	}
	if got.Port != fl.wantPort {
		t.Errorf("%s: landed on port %d (%v), want %d", fl.name, got.Port, got, fl.wantPort)
		return
	}
	if fl.wantOrig.IsValid() {
		if got.OrigDst != fl.wantOrig || !got.Redirected() {
			t.Errorf("%s: original destination %s (%v), want %s", fl.name, got.OrigDst, got, fl.wantOrig)
		}
	} else if got.Redirected() {
		t.Errorf("%s: redirected (%v), want direct", fl.name, got)
	}
	if fl.wantPeer.IsValid() && got.Peer.Addr() != fl.wantPeer {
		t.Errorf("%s: peer %s, want %s", fl.name, got.Peer.Addr(), fl.wantPeer)
	}
	// The listener that answered is the one in the namespace we expect.
	if _, err := fl.at.WaitFor(ctx, func(r captureproxy.Record) bool { return r.Peer == got.Peer && r.Port == got.Port }); err != nil {
		t.Errorf("%s: not recorded by the expected proxy: %v", fl.name, err)
	}
}

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

func podAddr(p testnet.Pod, f Family) netip.Addr {
	if f == IPv6 {
		return p.V6
	}
	return p.V4
}

func loopback(f Family) netip.Addr {
	if f == IPv6 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

func probeAddr(f Family) netip.Addr {
	if f == IPv6 {
		return ambient.DefaultProbeSNATv6
	}
	return ambient.DefaultProbeSNATv4
}

func TestDataplane(t *testing.T) {
	testnet.RequireRoot(t)
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		t.Run(string(b), func(t *testing.T) {
			requireBackend(t, b)
			t.Run("scenarios", func(t *testing.T) { scenarios(t, b) })
			t.Run("dns-capture", func(t *testing.T) { dnsCapture(t, b) })
			t.Run("bypass-inbound", func(t *testing.T) { bypassInbound(t, b) })
			t.Run("netns-paths", func(t *testing.T) { netnsPaths(t, b) })
			t.Run("virtual-interfaces", func(t *testing.T) { virtualInterfaces(t, b) })
		})
	}
}

// scenarios is the acceptance list of the in-pod dataplane.
func scenarios(t *testing.T, b Backend) {
	pair := testnet.NewPair(t)
	addProbeSource(t, pair)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := NewApplier(testLogger(t), b)
	before := snapshot(t, b, A)

	proxA := startProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 15008, 8080}})
	proxB := startProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})

	if err := a.Apply(A, PodConfig{}); err != nil {
		t.Fatalf("apply: %v", err)
	}
	applied := snapshot(t, b, A)
	if applied == before {
		t.Fatal("apply changed nothing")
	}

	for _, f := range Families {
		t.Run(f.String(), func(t *testing.T) {
			ipA, ipB := podAddr(pair.A, f), podAddr(pair.B, f)
			for _, fl := range []flow{
				{name: "A->B:8080 captured outbound", from: A, dst: ap(ipB, 8080), at: proxA, wantPort: 15001, wantOrig: ap(ipB, 8080)},
				{name: "B->A:8080 captured inbound", from: B, dst: ap(ipA, 8080), at: proxA, wantPort: 15006, wantOrig: ap(ipA, 8080)},
				{name: "B->A:15008 reaches HBONE directly", from: B, dst: ap(ipA, 15008), at: proxA, wantPort: 15008},
				{name: "A->B:8080 with ztunnel mark goes direct", from: A, dst: ap(ipB, 8080), opt: captureproxy.DialOptions{Mark: ambient.ZtunnelMark}, at: proxB, wantPort: 8080},
				{name: "probe source ->A:8080 goes direct", from: B, dst: ap(ipA, 8080), opt: captureproxy.DialOptions{Source: probeAddr(f)}, at: proxA, wantPort: 8080, wantPeer: probeAddr(f)},
				{name: "loopback in A untouched", from: A, dst: ap(loopback(f), 8080), at: proxA, wantPort: 8080},
				{name: "A to its own address untouched", from: A, dst: ap(ipA, 8080), at: proxA, wantPort: 8080},
				// ztunnel connects to the app with the client's address
				// (transparent, marked); the app's reply must come back
				// through the connmark and table 100, not leave via eth0.
				{name: "ztunnel-style spoofed inbound stays local", from: A, dst: ap(ipA, 8080),
					opt: captureproxy.DialOptions{Source: ipB, Mark: ambient.ZtunnelMark, Transparent: true}, at: proxA, wantPort: 8080, wantPeer: ipB},
			} {
				fl.check(t)
			}
			// A packet carrying the connmark's mark is never redirected
			// (Istio's 0x111 exception); table 100 then delivers it in
			// the pod itself, to A's listener. Only IPv6 can show it with
			// a plain listener: IPv4 refuses to route the SYN-ACK from
			// B's (non-local) address. The source is A's own address, as
			// with the mark the kernel would pick B's.
			if f == IPv6 {
				flow{name: "A->B:8080 with mark 0x111 is not redirected", from: A, dst: ap(ipB, 8080),
					opt: captureproxy.DialOptions{Mark: ambient.ConnSkipMark, Source: ipA}, at: proxA, wantPort: 8080}.check(t)
			}
		})
	}

	if err := a.Apply(A, PodConfig{}); err != nil {
		t.Fatalf("second apply: %v", err)
	}
	if again := snapshot(t, b, A); again != applied {
		t.Fatalf("second apply changed state:\n%s\n---\n%s", applied, again)
	}
	if d, err := a.Verify(A, PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify after apply: %v\n%s", err, d)
	}

	// Delete one rule per family by hand: Verify must name exactly it.
	run(t, A, b.Cmd(IPv4), "-t", "nat", "-D", ChainOutput, "-o", "lo", "-j", "RETURN")
	run(t, A, b.Cmd(IPv6), "-t", "mangle", "-D", "PREROUTING", "-j", ChainPrerouting)
	d, err := a.Verify(A, PodConfig{})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		`ipv4 nat ISTIO_OUTPUT: missing rule #3 "-A ISTIO_OUTPUT -o lo -j RETURN"`,
		`ipv6 mangle PREROUTING: missing rule "-A PREROUTING -j ISTIO_PRERT"`,
	}
	if len(d.Items) != len(want) {
		t.Fatalf("drift after hand edits:\n%s\nwant:\n%s", d, strings.Join(want, "\n"))
	}
	for i, w := range want {
		if d.Items[i].String() != w {
			t.Errorf("drift item %d = %s, want %s", i, d.Items[i], w)
		}
	}
	// Lost routing is named too.
	pair.A.Do(t, func() error {
		return netlink.RuleDel(policyroute.IPRule(PodRules(PodConfig{}, IPv4).Routing, IPv4))
	})
	if d, _ := a.Verify(A, PodConfig{}); !strings.Contains(d.String(), `ipv4: missing ip rule "pref 32764 fwmark 0x111/0xfff lookup 100"`) {
		t.Errorf("deleted ip rule not named:\n%s", d)
	}
	if err := a.Apply(A, PodConfig{}); err != nil {
		t.Fatalf("repair: %v", err)
	}
	if d, err := a.Verify(A, PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify after repair: %v\n%s", err, d)
	}

	if err := a.Remove(A); err != nil {
		t.Fatalf("remove: %v", err)
	}
	if after := snapshot(t, b, A); after != before {
		t.Fatalf("remove did not restore the namespace:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if err := a.Remove(A); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if d, err := a.Verify(A, PodConfig{}); err != nil || d.Empty() {
		t.Fatalf("verify after remove must report everything missing: %v %s", err, d)
	}
	for _, f := range Families {
		ipA, ipB := podAddr(pair.A, f), podAddr(pair.B, f)
		for _, fl := range []flow{
			{name: f.String() + " A->B:8080 direct after remove", from: A, dst: ap(ipB, 8080), at: proxB, wantPort: 8080},
			{name: f.String() + " B->A:8080 direct after remove", from: B, dst: ap(ipA, 8080), at: proxA, wantPort: 8080},
		} {
			fl.check(t)
		}
		// Negative control: without the connmark and table 100 the
		// spoofed connection cannot complete (its replies leave via eth0).
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := captureproxy.Dial(ctx, A, ap(ipA, 8080), captureproxy.DialOptions{Source: ipB, Mark: ambient.ZtunnelMark, Transparent: true, Timeout: time.Second})
		cancel()
		if err == nil {
			t.Errorf("%s: spoofed inbound completed without policy routing; the positive check proves nothing", f)
		}
	}
}

func dnsCapture(t *testing.T, b Backend) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := NewApplier(testLogger(t), b)
	before := snapshot(t, b, A)
	proxA := startProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15053}, UDPPorts: []uint16{53, 15053}})
	proxB := startProxy(t, B, captureproxy.Config{UDPPorts: []uint16{53}})
	cfg := PodConfig{DNSCapture: true}
	if err := a.Apply(A, cfg); err != nil {
		t.Fatal(err)
	}
	if d, err := a.Verify(A, cfg); err != nil || !d.Empty() {
		t.Fatalf("verify: %v\n%s", err, d)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, f := range Families {
		ipB := podAddr(pair.B, f)
		flow{name: f.String() + " TCP DNS to 15053", from: A, dst: ap(ipB, 53), at: proxA, wantPort: 15053, wantOrig: ap(ipB, 53)}.check(t)
		got, err := captureproxy.ExchangeUDP(ctx, A, ap(ipB, 53), []byte("query"), captureproxy.DialOptions{})
		if err != nil || got.Port != 15053 {
			t.Errorf("%s UDP DNS: %v %v, want answer from 15053", f, got, err)
		}
		// TCP DNS that leaves via lo (to the pod's own address) is captured
		// too; UDP DNS via lo is not (Istio's rules: `! -o lo` for UDP,
		// `! -d <loopback>` for TCP).
		ipA := podAddr(pair.A, f)
		flow{name: f.String() + " TCP DNS to own address via lo", from: A, dst: ap(ipA, 53), at: proxA, wantPort: 15053, wantOrig: ap(ipA, 53)}.check(t)
		got, err = captureproxy.ExchangeUDP(ctx, A, ap(ipA, 53), []byte("local"), captureproxy.DialOptions{})
		if err != nil || got.Port != 53 {
			t.Errorf("%s UDP DNS to own address: %v %v, want answer from A:53 directly", f, got, err)
		}
		// ztunnel's own (marked) query goes out, in its own conntrack zone.
		got, err = captureproxy.ExchangeUDP(ctx, A, ap(ipB, 53), []byte("upstream"), captureproxy.DialOptions{Mark: ambient.ZtunnelMark})
		if err != nil || got.Port != 53 {
			t.Errorf("%s marked UDP DNS: %v %v, want answer from B:53", f, got, err)
		}
		if _, err := proxB.WaitFor(ctx, func(r captureproxy.Record) bool {
			return string(r.Data) == "upstream" && r.Peer.Addr() == podAddr(pair.A, f)
		}); err != nil {
			t.Errorf("%s: B never saw the marked query: %v", f, err)
		}
	}
	// The capture does not touch TCP to other ports: still 15001.
	flow{name: "non-DNS TCP still outbound", from: A, dst: ap(pair.B.V4, 8080), at: proxA, wantPort: 15001, wantOrig: ap(pair.B.V4, 8080)}.check(t)
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, b, A); after != before {
		t.Fatalf("remove did not restore:\n%s\n---\n%s", before, after)
	}
}

func bypassInbound(t *testing.T, b Backend) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := NewApplier(testLogger(t), b)
	proxA := startProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 8080}})
	startProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})
	cfg := PodConfig{BypassInbound: true}
	if err := a.Apply(A, cfg); err != nil {
		t.Fatal(err)
	}
	if d, err := a.Verify(A, cfg); err != nil || !d.Empty() {
		t.Fatalf("verify: %v\n%s", err, d)
	}
	for _, f := range Families {
		ipA, ipB := podAddr(pair.A, f), podAddr(pair.B, f)
		flow{name: f.String() + " inbound bypassed", from: B, dst: ap(ipA, 8080), at: proxA, wantPort: 8080}.check(t)
		flow{name: f.String() + " outbound still captured", from: A, dst: ap(ipB, 8080), at: proxA, wantPort: 15001, wantOrig: ap(ipB, 8080)}.check(t)
		// ztunnel still reaches the app for HBONE (15008 is never
		// redirected): the replies of its spoofed connections stay local.
		flow{name: f.String() + " ztunnel-style spoofed inbound stays local", from: A, dst: ap(ipA, 8080),
			opt: captureproxy.DialOptions{Source: ipB, Mark: ambient.ZtunnelMark, Transparent: true}, at: proxA, wantPort: 8080, wantPeer: ipB}.check(t)
	}
	// Switching the option off converges in place.
	if err := a.Apply(A, PodConfig{}); err != nil {
		t.Fatal(err)
	}
	flow{name: "inbound captured again", from: B, dst: ap(pair.A.V4, 8080), at: proxA, wantPort: 15006, wantOrig: ap(pair.A.V4, 8080)}.check(t)
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
}

// netnsPaths: the applier accepts /proc/self/fd/<n> for an fd the caller
// holds and /proc/<pid>/ns/net of a process in the namespace.
func netnsPaths(t *testing.T, b Backend) {
	pair := testnet.NewPair(t)
	a := NewApplier(testLogger(t), b)
	named := pair.A.NS.Path()

	fd, err := os.Open(named)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	fdPath := fmt.Sprintf("/proc/self/fd/%d", fd.Fd())
	if err := a.Apply(fdPath, PodConfig{}); err != nil {
		t.Fatalf("apply via %s: %v", fdPath, err)
	}
	if d, err := a.Verify(named, PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify via named path after fd apply: %v\n%s", err, d)
	}

	// A process living in the namespace.
	var cmd *exec.Cmd
	if err := pair.A.NS.Do(func(ns.NetNS) error {
		cmd = exec.Command("sleep", "60")
		return cmd.Start()
	}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	pidPath := fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)
	if d, err := a.Verify(pidPath, PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify via %s: %v\n%s", pidPath, err, d)
	}
	proxA := startProxy(t, named, captureproxy.Config{TCPPorts: []uint16{15001}})
	flow{name: "captured after fd-path apply", from: named, dst: ap(pair.B.V4, 8080), at: proxA, wantPort: 15001, wantOrig: ap(pair.B.V4, 8080)}.check(t)
	if err := a.Remove(pidPath); err != nil {
		t.Fatalf("remove via %s: %v", pidPath, err)
	}
	if d, _ := a.Verify(fdPath, PodConfig{}); d.Empty() {
		t.Fatal("rules still there after remove")
	}
	// Paths that are not network namespaces are refused.
	for _, bad := range []string{t.TempDir(), "/proc/self/fd/99999", "/nonexistent/netns"} {
		if err := a.Apply(bad, PodConfig{}); err == nil {
			t.Errorf("apply into %s succeeded", bad)
		}
	}
}

// virtualInterfaces: a VM behind a virtual interface of the pod (KubeVirt)
// sends TCP to a remote workload; with the interface named it reaches
// ztunnel's outbound port with the original destination, inbound or not.
func virtualInterfaces(t *testing.T, b Backend) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	vm := testnet.Pod{NS: testnet.NewNS(t), IfName: "eth0", V4: netip.MustParseAddr("192.168.99.2"), V6: netip.MustParseAddr("fd99::2")}
	bridge := testnet.Pod{NS: pair.A.NS, IfName: "k6t-eth0", V4: netip.MustParseAddr("192.168.99.1"), V6: netip.MustParseAddr("fd99::1")}
	joinPods(t, bridge, vm)
	link(t, vm, netip.MustParsePrefix("0.0.0.0/0"), bridge.V4)
	link(t, vm, netip.MustParsePrefix("::/0"), bridge.V6)
	a := NewApplier(testLogger(t), b)
	before := snapshot(t, b, A)
	proxA := startProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 8080}})
	startProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})

	// Without the option the VM's traffic is taken for inbound.
	if err := a.Apply(A, PodConfig{}); err != nil {
		t.Fatal(err)
	}
	flow{name: "VM traffic without the option", from: vm.NS.Path(), dst: ap(pair.B.V4, 8080), at: proxA, wantPort: 15006, wantOrig: ap(pair.B.V4, 8080)}.check(t)

	for _, cfg := range []PodConfig{
		{VirtualInterfaces: []string{"k6t-eth0"}},
		{VirtualInterfaces: []string{"tap0", "k6t+"}, BypassInbound: true},
	} {
		if err := a.Apply(A, cfg); err != nil {
			t.Fatalf("%+v: %v", cfg, err)
		}
		if d, err := a.Verify(A, cfg); err != nil || !d.Empty() {
			t.Fatalf("%+v: verify: %v\n%s", cfg, err, d)
		}
		inbound := uint16(15006)
		if cfg.BypassInbound {
			inbound = 8080
		}
		for _, f := range Families {
			ipA, ipB := podAddr(pair.A, f), podAddr(pair.B, f)
			name := fmt.Sprintf("%s %v", f, cfg.VirtualInterfaces)
			flow{name: name + " VM->B:8080 captured as outbound", from: vm.NS.Path(), dst: ap(ipB, 8080), at: proxA, wantPort: 15001, wantOrig: ap(ipB, 8080)}.check(t)
			flow{name: name + " A->B:8080 still outbound", from: A, dst: ap(ipB, 8080), at: proxA, wantPort: 15001, wantOrig: ap(ipB, 8080)}.check(t)
			fl := flow{name: name + " B->A:8080 inbound", from: B, dst: ap(ipA, 8080), at: proxA, wantPort: inbound}
			if !cfg.BypassInbound {
				fl.wantOrig = ap(ipA, 8080)
			}
			fl.check(t)
		}
	}
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, b, A); after != before {
		t.Fatalf("remove did not restore:\n%s\n---\n%s", before, after)
	}
}
