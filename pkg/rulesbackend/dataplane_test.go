package rulesbackend

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/captureproxy"
	dt "github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// Every dataplane scenario runs against every backend as shipped (built by
// New, with the cleanup of the other backends): real netns, veths, TCP and
// UDP, IPv4 and IPv6. A backend whose tools are missing skips (or fails
// under CI=true).

// backendCase is one backend under test and what is specific to it.
type backendCase struct {
	name  string
	value string // the configured value
	tools []string
	// breakRules deletes one capture rule per family by hand and returns
	// the drift Verify must report, in order.
	breakRules func(t *testing.T, netnsPath string) []string
	// breakHost deletes the host's SNAT rule by hand and returns what
	// Verify must report.
	breakHost func(t *testing.T, netnsPath string) string
	// masquerade adds another tool's MASQUERADE of the node's own traffic
	// (src) in the flavour this backend lives next to.
	masquerade func(t *testing.T, netnsPath string, src netip.Addr)
	// acceptAbove has another tool accept the node's IPv4 TCP (src) in
	// nat POSTROUTING ahead of the probe SNAT, after Ensure, and returns
	// the drift Verify must report ("" when the SNAT still wins) and how
	// to undo it.
	acceptAbove func(t *testing.T, netnsPath string, src netip.Addr) (string, func())
}

var backends = []backendCase{
	{
		name: "iptables-nft", value: "nft",
		tools: []string{"iptables-nft", "ip6tables-nft", "iptables-nft-save", "ip6tables-nft-save", "iptables-nft-restore", "ip6tables-nft-restore", "nft"},
		breakRules: func(t *testing.T, p string) []string {
			dt.Run(t, p, "iptables-nft", "-t", "nat", "-D", "ISTIO_OUTPUT", "-o", "lo", "-j", "RETURN")
			dt.Run(t, p, "ip6tables-nft", "-t", "mangle", "-D", "PREROUTING", "-j", "ISTIO_PRERT")
			return []string{
				`ipv4 nat ISTIO_OUTPUT: missing rule #3 "-A ISTIO_OUTPUT -o lo -j RETURN"`,
				`ipv6 mangle PREROUTING: missing rule "-A PREROUTING -j ISTIO_PRERT"`,
			}
		},
		breakHost: func(t *testing.T, p string) string {
			dt.Run(t, p, "iptables-nft", "-t", "nat", "-F", "AMBIENT_PROBE_SNAT")
			return `ipv4 nat AMBIENT_PROBE_SNAT: missing rule #1 "-A AMBIENT_PROBE_SNAT -p tcp -m owner --socket-exists -m set --match-set ambient-probes-v4 dst -j SNAT --to-source 169.254.7.127"`
		},
		masquerade: func(t *testing.T, p string, src netip.Addr) { iptMasquerade(t, p, "nft", src) },
		acceptAbove: func(t *testing.T, p string, src netip.Addr) (string, func()) {
			args := []string{"-t", "nat", "-I", "POSTROUTING", "1", "-s", src.String(), "-p", "tcp", "-j", "ACCEPT"}
			dt.Run(t, p, "iptables-nft", args...)
			return `ipv4 nat POSTROUTING: moved rule #1 "-A POSTROUTING -j AMBIENT_PROBE_SNAT"`, func() {
				args[2] = "-D"
				dt.Run(t, p, "iptables-nft", append(args[:4], args[5:]...)...)
			}
		},
	},
	{
		name: "iptables-legacy", value: "legacy",
		tools: []string{"iptables-legacy", "ip6tables-legacy", "iptables-legacy-save", "ip6tables-legacy-save", "iptables-legacy-restore", "ip6tables-legacy-restore"},
		breakRules: func(t *testing.T, p string) []string {
			dt.Run(t, p, "iptables-legacy", "-t", "nat", "-D", "ISTIO_OUTPUT", "-o", "lo", "-j", "RETURN")
			dt.Run(t, p, "ip6tables-legacy", "-t", "mangle", "-D", "PREROUTING", "-j", "ISTIO_PRERT")
			return []string{
				`ipv4 nat ISTIO_OUTPUT: missing rule #3 "-A ISTIO_OUTPUT -o lo -j RETURN"`,
				`ipv6 mangle PREROUTING: missing rule "-A PREROUTING -j ISTIO_PRERT"`,
			}
		},
		breakHost: func(t *testing.T, p string) string {
			dt.Run(t, p, "iptables-legacy", "-t", "nat", "-F", "AMBIENT_PROBE_SNAT")
			return `ipv4 nat AMBIENT_PROBE_SNAT: missing rule #1 "-A AMBIENT_PROBE_SNAT -p tcp -m owner --socket-exists -m set --match-set ambient-probes-v4 dst -j SNAT --to-source 169.254.7.127"`
		},
		masquerade: func(t *testing.T, p string, src netip.Addr) { iptMasquerade(t, p, "legacy", src) },
		acceptAbove: func(t *testing.T, p string, src netip.Addr) (string, func()) {
			args := []string{"-t", "nat", "-I", "POSTROUTING", "1", "-s", src.String(), "-p", "tcp", "-j", "ACCEPT"}
			dt.Run(t, p, "iptables-legacy", args...)
			return `ipv4 nat POSTROUTING: moved rule #1 "-A POSTROUTING -j AMBIENT_PROBE_SNAT"`, func() {
				args[2] = "-D"
				dt.Run(t, p, "iptables-legacy", append(args[:4], args[5:]...)...)
			}
		},
	},
	{
		name: "nftables", value: "nftables",
		tools: []string{"nft"},
		breakRules: func(t *testing.T, p string) []string {
			nftDelete(t, p, "istio-ambient-nat", "output", `oifname "lo" return`)
			nftDelete(t, p, "istio-ambient-mangle", "prerouting", `meta mark & 0x00000fff == 0x00000539`)
			return []string{
				`inet istio-ambient-mangle prerouting: missing nft rule #1 "meta mark & 0x00000fff == 0x00000539 ct mark set ct mark & 0xfffff000 ^ 0x00000111"`,
				`inet istio-ambient-nat output: missing nft rule #4 "oifname \"lo\" return"`,
			}
		},
		breakHost: func(t *testing.T, p string) string {
			nftDelete(t, p, "ambient-probe-snat", "postrouting", "@ambient-probes-v4")
			return `inet ambient-probe-snat postrouting: missing nft rule #1 "meta l4proto tcp meta skuid >= 0 ip daddr @ambient-probes-v4 snat ip to 169.254.7.127"`
		},
		masquerade: func(t *testing.T, p string, src netip.Addr) {
			// The usual neighbours: kube-proxy's (iptables-nft) and a
			// native nftables chain at the standard srcnat priority.
			iptMasquerade(t, p, "nft", src)
			fam, name := "ip", "saddr"
			if src.Is6() {
				fam = "ip6"
			}
			tbl := "other-" + fam
			dt.Run(t, p, "nft", "add", "table", fam, tbl)
			dt.Run(t, p, "nft", "add", "chain", fam, tbl, "post", "{ type nat hook postrouting priority srcnat; }")
			dt.Run(t, p, "nft", "add", "rule", fam, tbl, "post", fam, name, src.String(), "meta", "l4proto", "tcp", "masquerade")
		},
		acceptAbove: func(t *testing.T, p string, src netip.Addr) (string, func()) {
			// An accept in an earlier nat chain ends only that chain:
			// the SNAT at 90 still runs, nothing to repair.
			dt.Run(t, p, "nft", "add", "table", "ip", "early")
			dt.Run(t, p, "nft", "add", "chain", "ip", "early", "post", "{ type nat hook postrouting priority 50; }")
			dt.Run(t, p, "nft", "add", "rule", "ip", "early", "post", "ip", "saddr", src.String(), "meta", "l4proto", "tcp", "accept")
			return "", func() { dt.Run(t, p, "nft", "delete", "table", "ip", "early") }
		},
	},
}

func iptMasquerade(t *testing.T, p, flavour string, src netip.Addr) {
	bin := "iptables-" + flavour
	if src.Is6() {
		bin = "ip6tables-" + flavour
	}
	dt.Run(t, p, bin, "-t", "nat", "-A", "POSTROUTING", "-s", src.String(), "-p", "tcp", "-j", "MASQUERADE")
}

var nftHandle = regexp.MustCompile(`# handle (\d+)$`)

// nftDelete deletes, by hand, the first rule of the chain containing text.
func nftDelete(t *testing.T, p, table, chain, text string) {
	t.Helper()
	for _, l := range strings.Split(dt.Run(t, p, "nft", "-a", "list", "chain", "inet", table, chain), "\n") {
		if m := nftHandle.FindStringSubmatch(l); m != nil && strings.Contains(l, text) {
			dt.Run(t, p, "nft", "delete", "rule", "inet", table, chain, "handle", m[1])
			return
		}
	}
	t.Fatalf("no rule with %q in %s %s", text, table, chain)
}

func (bc backendCase) require(t *testing.T) {
	t.Helper()
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, append([]string{"ip"}, bc.tools...)...)
}

// build makes the backend as New does for the configured value.
func (bc backendCase) build(t *testing.T, hostNetns string) *Backend {
	t.Helper()
	return bc.buildProbe(t, hostNetns, ruleset.HostProbeConfig{})
}

// buildProbe is build with host probe options.
func (bc backendCase) buildProbe(t *testing.T, hostNetns string, probe ruleset.HostProbeConfig) *Backend {
	t.Helper()
	b, err := New(Config{Backend: mustParse(t, bc.value), HostNetns: hostNetns, Probe: probe, Logger: dt.Logger(t)})
	if err != nil {
		t.Fatalf("backend %s: %v", bc.value, err)
	}
	return b
}

func families() []int { return []int{4, 6} }

func fam(f int) ruleset.Family { return ruleset.Family(f) }

func TestDataplane(t *testing.T) {
	testnet.RequireRoot(t)
	for _, bc := range backends {
		t.Run(bc.name, func(t *testing.T) {
			bc.require(t)
			for _, sc := range []struct {
				name string
				run  func(*testing.T, backendCase)
			}{
				{"scenarios", scenarios},
				{"dns-capture", dnsCapture},
				{"bypass-inbound", bypassInbound},
				{"netns-paths", netnsPaths},
				{"virtual-interfaces", virtualInterfaces},
				{"ipv6-off-on-lo", ipv6OffOnLo},
				{"ipv4-only", ipv4Only},
				{"lo-down", loDown},
				{"host-probe", hostProbe},
				{"host-probe-ipv4-only", hostProbeIPv4Only},
			} {
				t.Run(sc.name, func(t *testing.T) { sc.run(t, bc) })
			}
		})
	}
}

// scenarios is the acceptance list of the in-pod dataplane.
func scenarios(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	dt.AddProbeSource(t, pair)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := bc.build(t, "").Rules
	before := dt.Snapshot(t, A)

	proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 15008, 8080}})
	proxB := dt.StartProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})

	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatalf("apply: %v", err)
	}
	applied := dt.Snapshot(t, A)
	if applied == before {
		t.Fatal("apply changed nothing")
	}

	for _, f := range families() {
		t.Run(fam(f).String(), func(t *testing.T) {
			ipA, ipB := dt.Addr(pair.A, f), dt.Addr(pair.B, f)
			for _, fl := range []dt.Flow{
				{Name: "A->B:8080 captured outbound", From: A, Dst: dt.AP(ipB, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(ipB, 8080)},
				{Name: "B->A:8080 captured inbound", From: B, Dst: dt.AP(ipA, 8080), At: proxA, WantPort: 15006, WantOrig: dt.AP(ipA, 8080)},
				{Name: "B->A:15008 reaches HBONE directly", From: B, Dst: dt.AP(ipA, 15008), At: proxA, WantPort: 15008},
				{Name: "A->B:8080 with ztunnel mark goes direct", From: A, Dst: dt.AP(ipB, 8080), Opt: captureproxy.DialOptions{Mark: ambient.ZtunnelMark}, At: proxB, WantPort: 8080},
				{Name: "probe source ->A:8080 goes direct", From: B, Dst: dt.AP(ipA, 8080), Opt: captureproxy.DialOptions{Source: dt.Probe(f)}, At: proxA, WantPort: 8080, WantPeer: dt.Probe(f)},
				{Name: "loopback in A untouched", From: A, Dst: dt.AP(dt.Loopback(f), 8080), At: proxA, WantPort: 8080},
				{Name: "A to its own address untouched", From: A, Dst: dt.AP(ipA, 8080), At: proxA, WantPort: 8080},
				// ztunnel connects to the app with the client's address
				// (transparent, marked); the app's reply must come back
				// through the connmark and table 100, not leave via eth0.
				{Name: "ztunnel-style spoofed inbound stays local", From: A, Dst: dt.AP(ipA, 8080),
					Opt: captureproxy.DialOptions{Source: ipB, Mark: ambient.ZtunnelMark, Transparent: true}, At: proxA, WantPort: 8080, WantPeer: ipB},
			} {
				fl.Check(t)
			}
			// A packet carrying the connmark's mark is never redirected
			// (Istio's 0x111 exception); table 100 then delivers it in
			// the pod itself, to A's listener. Only IPv6 can show it with
			// a plain listener: IPv4 refuses to route the SYN-ACK from
			// B's (non-local) address. The source is A's own address, as
			// with the mark the kernel would pick B's.
			if f == 6 {
				dt.Flow{Name: "A->B:8080 with mark 0x111 is not redirected", From: A, Dst: dt.AP(ipB, 8080),
					Opt: captureproxy.DialOptions{Mark: ambient.ConnSkipMark, Source: ipA}, At: proxA, WantPort: 8080}.Check(t)
			}
		})
	}

	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatalf("second apply: %v", err)
	}
	if again := dt.Snapshot(t, A); again != applied {
		t.Fatalf("second apply changed state:\n%s\n---\n%s", applied, again)
	}
	if d, err := a.Verify(A, ruleset.PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify after apply: %v\n%s", err, d)
	}
	// Verified by generation: a clean verify's generation skips the next
	// read, and what follows must still show through it.
	gv, ok := a.(ruleset.GenVerifier)
	if !ok {
		t.Fatalf("%T verifies by generation for the verifier", a)
	}
	d, gen, err := gv.VerifyGen(A, ruleset.PodConfig{}, 0)
	if err != nil || !d.Empty() {
		t.Fatalf("verify by generation after apply: %v\n%s", err, d)
	}
	if (gen != 0) == (bc.value == "legacy") {
		t.Fatalf("generation %d: want one exactly when the rules live in nf_tables", gen)
	}
	if d, again, err := gv.VerifyGen(A, ruleset.PodConfig{}, gen); err != nil || !d.Empty() || again != gen {
		t.Fatalf("verify by generation, nothing changed: generation %d then %d, %v\n%s", gen, again, err, d)
	}

	// Delete one rule per family by hand: Verify must name exactly it,
	// read in full or by the generation a clean verify returned.
	want := bc.breakRules(t, A)
	d, err = a.Verify(A, ruleset.PodConfig{})
	if err != nil {
		t.Fatal(err)
	}
	dg, _, err := gv.VerifyGen(A, ruleset.PodConfig{}, gen)
	if err != nil {
		t.Fatal(err)
	}
	if dg.String() != d.String() {
		t.Errorf("verify by generation after hand edits:\n%s\nwant what a full read finds:\n%s", dg, d)
	}
	if len(d.Items) != len(want) {
		t.Fatalf("drift after hand edits:\n%s\nwant:\n%s", d, strings.Join(want, "\n"))
	}
	for i, w := range want {
		if d.Items[i].String() != w {
			t.Errorf("drift item %d = %s, want %s", i, d.Items[i], w)
		}
	}
	// Lost routing is named too, with the netfilter state unchanged since
	// a clean verify by generation: routing has no generation.
	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatalf("repair: %v", err)
	}
	if d, gen, err = gv.VerifyGen(A, ruleset.PodConfig{}, 0); err != nil || !d.Empty() {
		t.Fatalf("verify by generation after repair: %v\n%s", err, d)
	}
	pair.A.Do(t, func() error {
		return netlink.RuleDel(policyroute.IPRule(ruleset.PodRules(ruleset.PodConfig{}, ruleset.IPv4).Routing, ruleset.IPv4))
	})
	lost := `ipv4: missing ip rule "pref 32764 fwmark 0x111/0xfff lookup 100"`
	if d, _ := a.Verify(A, ruleset.PodConfig{}); !strings.Contains(d.String(), lost) {
		t.Errorf("deleted ip rule not named:\n%s", d)
	}
	if d, _, _ := gv.VerifyGen(A, ruleset.PodConfig{}, gen); !strings.Contains(d.String(), lost) {
		t.Errorf("deleted ip rule not named by a verify by generation:\n%s", d)
	}
	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatalf("repair: %v", err)
	}
	if d, err := a.Verify(A, ruleset.PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify after repair: %v\n%s", err, d)
	}

	if err := a.Remove(A); err != nil {
		t.Fatalf("remove: %v", err)
	}
	if after := dt.Snapshot(t, A); after != before {
		t.Fatalf("remove did not restore the namespace:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if err := a.Remove(A); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if d, err := a.Verify(A, ruleset.PodConfig{}); err != nil || d.Empty() {
		t.Fatalf("verify after remove must report everything missing: %v %s", err, d)
	}
	for _, f := range families() {
		ipA, ipB := dt.Addr(pair.A, f), dt.Addr(pair.B, f)
		for _, fl := range []dt.Flow{
			{Name: fam(f).String() + " A->B:8080 direct after remove", From: A, Dst: dt.AP(ipB, 8080), At: proxB, WantPort: 8080},
			{Name: fam(f).String() + " B->A:8080 direct after remove", From: B, Dst: dt.AP(ipA, 8080), At: proxA, WantPort: 8080},
		} {
			fl.Check(t)
		}
		// Negative control: without the connmark and table 100 the
		// spoofed connection cannot complete (its replies leave via eth0).
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := captureproxy.Dial(ctx, A, dt.AP(ipA, 8080), captureproxy.DialOptions{Source: ipB, Mark: ambient.ZtunnelMark, Transparent: true, Timeout: time.Second})
		cancel()
		if err == nil {
			t.Errorf("%s: spoofed inbound completed without policy routing; the positive check proves nothing", fam(f))
		}
	}
}

func dnsCapture(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := bc.build(t, "").Rules
	before := dt.Snapshot(t, A)
	proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15053}, UDPPorts: []uint16{53, 15053}})
	proxB := dt.StartProxy(t, B, captureproxy.Config{UDPPorts: []uint16{53}})
	cfg := ruleset.PodConfig{DNSCapture: true}
	if err := a.Apply(A, cfg); err != nil {
		t.Fatal(err)
	}
	if d, err := a.Verify(A, cfg); err != nil || !d.Empty() {
		t.Fatalf("verify: %v\n%s", err, d)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, f := range families() {
		ipA, ipB := dt.Addr(pair.A, f), dt.Addr(pair.B, f)
		dt.Flow{Name: fam(f).String() + " TCP DNS to 15053", From: A, Dst: dt.AP(ipB, 53), At: proxA, WantPort: 15053, WantOrig: dt.AP(ipB, 53)}.Check(t)
		got, err := captureproxy.ExchangeUDP(ctx, A, dt.AP(ipB, 53), []byte("query"), captureproxy.DialOptions{})
		if err != nil || got.Port != 15053 {
			t.Errorf("%s UDP DNS: %v %v, want answer from 15053", fam(f), got, err)
		}
		// TCP DNS that leaves via lo (to the pod's own address) is captured
		// too; UDP DNS via lo is not (Istio's rules: `! -o lo` for UDP,
		// `! -d <loopback>` for TCP).
		dt.Flow{Name: fam(f).String() + " TCP DNS to own address via lo", From: A, Dst: dt.AP(ipA, 53), At: proxA, WantPort: 15053, WantOrig: dt.AP(ipA, 53)}.Check(t)
		got, err = captureproxy.ExchangeUDP(ctx, A, dt.AP(ipA, 53), []byte("local"), captureproxy.DialOptions{})
		if err != nil || got.Port != 53 {
			t.Errorf("%s UDP DNS to own address: %v %v, want answer from A:53 directly", fam(f), got, err)
		}
		// ztunnel's own (marked) query goes out, in its own conntrack zone.
		got, err = captureproxy.ExchangeUDP(ctx, A, dt.AP(ipB, 53), []byte("upstream"), captureproxy.DialOptions{Mark: ambient.ZtunnelMark})
		if err != nil || got.Port != 53 {
			t.Errorf("%s marked UDP DNS: %v %v, want answer from B:53", fam(f), got, err)
		}
		if _, err := proxB.WaitFor(ctx, func(r captureproxy.Record) bool {
			return string(r.Data) == "upstream" && r.Peer.Addr() == dt.Addr(pair.A, f)
		}); err != nil {
			t.Errorf("%s: B never saw the marked query: %v", fam(f), err)
		}
	}
	// The capture does not touch TCP to other ports: still 15001.
	dt.Flow{Name: "non-DNS TCP still outbound", From: A, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
	if after := dt.Snapshot(t, A); after != before {
		t.Fatalf("remove did not restore:\n%s\n---\n%s", before, after)
	}
}

func bypassInbound(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := bc.build(t, "").Rules
	proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 8080}})
	dt.StartProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})
	cfg := ruleset.PodConfig{BypassInbound: true}
	if err := a.Apply(A, cfg); err != nil {
		t.Fatal(err)
	}
	if d, err := a.Verify(A, cfg); err != nil || !d.Empty() {
		t.Fatalf("verify: %v\n%s", err, d)
	}
	for _, f := range families() {
		ipA, ipB := dt.Addr(pair.A, f), dt.Addr(pair.B, f)
		dt.Flow{Name: fam(f).String() + " inbound bypassed", From: B, Dst: dt.AP(ipA, 8080), At: proxA, WantPort: 8080}.Check(t)
		dt.Flow{Name: fam(f).String() + " outbound still captured", From: A, Dst: dt.AP(ipB, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(ipB, 8080)}.Check(t)
		// ztunnel still reaches the app for HBONE (15008 is never
		// redirected): the replies of its spoofed connections stay local.
		dt.Flow{Name: fam(f).String() + " ztunnel-style spoofed inbound stays local", From: A, Dst: dt.AP(ipA, 8080),
			Opt: captureproxy.DialOptions{Source: ipB, Mark: ambient.ZtunnelMark, Transparent: true}, At: proxA, WantPort: 8080, WantPeer: ipB}.Check(t)
	}
	// Switching the option off converges in place.
	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	dt.Flow{Name: "inbound captured again", From: B, Dst: dt.AP(pair.A.V4, 8080), At: proxA, WantPort: 15006, WantOrig: dt.AP(pair.A.V4, 8080)}.Check(t)
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
}

// netnsPaths: the backend accepts /proc/self/fd/<n> for an fd the caller
// holds and /proc/<pid>/ns/net of a process in the namespace.
func netnsPaths(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	a := bc.build(t, "").Rules
	named := pair.A.NS.Path()

	fd, err := os.Open(named)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	fdPath := fmt.Sprintf("/proc/self/fd/%d", fd.Fd())
	if err := a.Apply(fdPath, ruleset.PodConfig{}); err != nil {
		t.Fatalf("apply via %s: %v", fdPath, err)
	}
	if d, err := a.Verify(named, ruleset.PodConfig{}); err != nil || !d.Empty() {
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
	if d, err := a.Verify(pidPath, ruleset.PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify via %s: %v\n%s", pidPath, err, d)
	}
	proxA := dt.StartProxy(t, named, captureproxy.Config{TCPPorts: []uint16{15001}})
	dt.Flow{Name: "captured after fd-path apply", From: named, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)
	if err := a.Remove(pidPath); err != nil {
		t.Fatalf("remove via %s: %v", pidPath, err)
	}
	if d, _ := a.Verify(fdPath, ruleset.PodConfig{}); d.Empty() {
		t.Fatal("rules still there after remove")
	}
	// Paths that are not network namespaces are refused.
	for _, bad := range []string{t.TempDir(), "/proc/self/fd/99999", "/nonexistent/netns", ""} {
		if err := a.Apply(bad, ruleset.PodConfig{}); err == nil {
			t.Errorf("apply into %q succeeded", bad)
		}
	}
}

// virtualInterfaces: a VM behind a virtual interface of the pod (KubeVirt)
// sends TCP to a remote workload; with the interface named it reaches
// ztunnel's outbound port with the original destination, inbound or not.
func virtualInterfaces(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	vm := testnet.Pod{NS: testnet.NewNS(t), IfName: "eth0", V4: netip.MustParseAddr("192.168.99.2"), V6: netip.MustParseAddr("fd99::2")}
	bridge := testnet.Pod{NS: pair.A.NS, IfName: "k6t-eth0", V4: netip.MustParseAddr("192.168.99.1"), V6: netip.MustParseAddr("fd99::1")}
	dt.JoinPods(t, bridge, vm)
	dt.Route(t, vm, netip.MustParsePrefix("0.0.0.0/0"), bridge.V4)
	dt.Route(t, vm, netip.MustParsePrefix("::/0"), bridge.V6)
	a := bc.build(t, "").Rules
	before := dt.Snapshot(t, A)
	proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 8080}})
	dt.StartProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})

	// Without the option the VM's traffic is taken for inbound.
	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	dt.Flow{Name: "VM traffic without the option", From: vm.NS.Path(), Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15006, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)

	for _, cfg := range []ruleset.PodConfig{
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
		for _, f := range families() {
			ipA, ipB := dt.Addr(pair.A, f), dt.Addr(pair.B, f)
			name := fmt.Sprintf("%s %v", fam(f), cfg.VirtualInterfaces)
			dt.Flow{Name: name + " VM->B:8080 captured as outbound", From: vm.NS.Path(), Dst: dt.AP(ipB, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(ipB, 8080)}.Check(t)
			dt.Flow{Name: name + " A->B:8080 still outbound", From: A, Dst: dt.AP(ipB, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(ipB, 8080)}.Check(t)
			fl := dt.Flow{Name: name + " B->A:8080 inbound", From: B, Dst: dt.AP(ipA, 8080), At: proxA, WantPort: inbound}
			if !cfg.BypassInbound {
				fl.WantOrig = dt.AP(ipA, 8080)
			}
			fl.Check(t)
		}
	}
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
	if after := dt.Snapshot(t, A); after != before {
		t.Fatalf("remove did not restore:\n%s\n---\n%s", before, after)
	}
}

// ipv6OffOnLo: lo has IPv6 disabled while the pod's interfaces have it
// (seen in clusters). The kernel refuses the IPv6 local route; as Istio,
// apply skips it, still captures IPv4, and IPv6 fails closed.
func ipv6OffOnLo(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	dt.Sysctl(t, pair.A, "net.ipv6.conf.lo.disable_ipv6", "1")
	a := bc.build(t, "").Rules
	before := dt.Snapshot(t, A)
	proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006}})
	proxB := dt.StartProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})
	if err := a.Apply(A, ruleset.PodConfig{}); err != nil {
		t.Fatalf("apply: %v", err)
	}
	if d, err := a.Verify(A, ruleset.PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify: %v\n%s", err, d)
	}
	dt.Flow{Name: "ipv4 captured", From: A, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)}.Check(t)
	// IPv6 from the pod never reaches B uncaptured.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	got, err := captureproxy.Dial(ctx, A, dt.AP(pair.B.V6, 8080), captureproxy.DialOptions{Timeout: time.Second})
	cancel()
	if err == nil {
		t.Errorf("IPv6 dial landed on %v; want it to fail closed", got)
	}
	for _, r := range proxB.Records() {
		t.Errorf("B saw a connection: %v", r)
	}
	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
	if after := dt.Snapshot(t, A); after != before {
		t.Fatalf("remove did not restore:\n%s\n---\n%s", before, after)
	}
}

// ipv4Only: with IPv6 left alone (Istio's ambient.ipv6: false) a
// dual-stack pod's IPv6 goes direct while its IPv4 is captured. Switching
// from capturing both removes the IPv6 rules and policy route, a leftover
// IPv6 route shows as drift and goes on the next apply, and switching back
// captures IPv6 again.
func ipv4Only(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	A, B := pair.A.NS.Path(), pair.B.NS.Path()
	a := bc.build(t, "").Rules
	before := dt.Snapshot(t, A)
	proxA := dt.StartProxy(t, A, captureproxy.Config{TCPPorts: []uint16{15001, 15006, 8080}})
	proxB := dt.StartProxy(t, B, captureproxy.Config{TCPPorts: []uint16{8080}})
	both := ruleset.PodConfig{DNSCapture: true}
	v4 := ruleset.PodConfig{DNSCapture: true, IPv4Only: true}
	ipv6Rule := func() bool {
		out, err := dt.Output(A, "ip", "-6", "rule", "show")
		if err != nil {
			t.Fatalf("ip -6 rule: %v", err)
		}
		return strings.Contains(out, "fwmark 0x111/0xfff lookup 100")
	}

	// A previous configuration captured both families.
	if err := a.Apply(A, both); err != nil {
		t.Fatalf("apply both: %v", err)
	}
	if !ipv6Rule() {
		t.Fatal("no IPv6 policy rule with both families captured")
	}
	if err := a.Apply(A, v4); err != nil {
		t.Fatalf("apply IPv4 only: %v", err)
	}
	if d, err := a.Verify(A, v4); err != nil || !d.Empty() {
		t.Fatalf("verify IPv4 only: %v\n%s", err, d)
	}
	if ipv6Rule() {
		t.Error("IPv6 policy rule left after switching to IPv4 only")
	}
	for _, fl := range []dt.Flow{
		{Name: "ipv4 A->B:8080 captured outbound", From: A, Dst: dt.AP(pair.B.V4, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V4, 8080)},
		{Name: "ipv4 B->A:8080 captured inbound", From: B, Dst: dt.AP(pair.A.V4, 8080), At: proxA, WantPort: 15006, WantOrig: dt.AP(pair.A.V4, 8080)},
		{Name: "ipv6 A->B:8080 direct", From: A, Dst: dt.AP(pair.B.V6, 8080), At: proxB, WantPort: 8080},
		{Name: "ipv6 B->A:8080 direct", From: B, Dst: dt.AP(pair.A.V6, 8080), At: proxA, WantPort: 8080},
	} {
		fl.Check(t)
	}

	// An IPv6 policy rule left by hand (or by an older version) is drift,
	// and the next apply removes it.
	dt.Run(t, A, "ip", "-6", "rule", "add", "pref", "32764", "fwmark", "0x111/0xfff", "lookup", "100")
	d, err := a.Verify(A, v4)
	if err != nil {
		t.Fatal(err)
	}
	if want := `ipv6: extra ip rule "pref 32764 fwmark 0x111/0xfff lookup 100"`; d.String() != want {
		t.Errorf("drift with a leftover IPv6 rule:\n%s\nwant:\n%s", d, want)
	}
	if err := a.Apply(A, v4); err != nil {
		t.Fatalf("re-apply IPv4 only: %v", err)
	}
	if d, err := a.Verify(A, v4); err != nil || !d.Empty() || ipv6Rule() {
		t.Fatalf("leftover IPv6 rule not removed: %v\n%s", err, d)
	}

	// Back to both: IPv6 is captured again.
	if err := a.Apply(A, both); err != nil {
		t.Fatalf("apply both again: %v", err)
	}
	if d, err := a.Verify(A, both); err != nil || !d.Empty() {
		t.Fatalf("verify both: %v\n%s", err, d)
	}
	dt.Flow{Name: "ipv6 A->B:8080 captured again", From: A, Dst: dt.AP(pair.B.V6, 8080), At: proxA, WantPort: 15001, WantOrig: dt.AP(pair.B.V6, 8080)}.Check(t)

	if err := a.Remove(A); err != nil {
		t.Fatal(err)
	}
	if after := dt.Snapshot(t, A); after != before {
		t.Fatalf("remove did not restore:\n%s\n---\n%s", before, after)
	}
}

// loDown: with lo down nothing redirected could reach ztunnel; apply
// refuses with a clear error and changes nothing.
func loDown(t *testing.T, bc backendCase) {
	pair := testnet.NewPair(t)
	A := pair.A.NS.Path()
	pair.A.Do(t, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetDown(lo)
	})
	before := dt.Snapshot(t, A)
	err := bc.build(t, "").Rules.Apply(A, ruleset.PodConfig{})
	if err == nil || !strings.Contains(err.Error(), "lo is down") {
		t.Fatalf("apply with lo down: %v", err)
	}
	if after := dt.Snapshot(t, A); after != before {
		t.Fatalf("refused apply changed the namespace:\n%s\n---\n%s", before, after)
	}
}

// hostProbeIPv4Only: with IPv6 left alone the host SNATs IPv4 probes only;
// the IPv6 SNAT and probe set an earlier setting installed are drift and
// go on Ensure, and an IPv6 pod address is never added.
func hostProbeIPv4Only(t *testing.T, bc backendCase) {
	testnet.RequireCommands(t, "ipset")
	top := dt.NewHostTopology(t)
	pod := top.Pair.B
	before := hostSnapshot(t, top.H)

	// An earlier setting captured both families.
	both := bc.buildProbe(t, top.H, ruleset.HostProbeConfig{})
	defer func() { _ = both.Close() }()
	if err := both.Probe.Ensure(); err != nil {
		t.Fatalf("ensure both: %v", err)
	}
	for _, f := range families() {
		if err := both.Probe.AddIP(dt.Addr(pod, f)); err != nil {
			t.Fatal(err)
		}
	}

	b := bc.buildProbe(t, top.H, ruleset.HostProbeConfig{IPv4Only: true})
	defer func() { _ = b.Close() }()
	hp := b.Probe
	if d, err := hp.Verify(); err != nil || d.Empty() {
		t.Fatalf("verify must report the IPv6 leftovers: %v %s", err, d)
	}
	if err := hp.Ensure(); err != nil {
		t.Fatalf("ensure IPv4 only: %v", err)
	}
	if d, err := hp.Verify(); err != nil || !d.Empty() {
		t.Fatalf("verify after ensure: %v\n%s", err, d)
	}
	if err := hp.AddIP(pod.V6); err != nil {
		t.Fatalf("AddIP of an IPv6 address: %v", err)
	}
	if err := hp.AddIP(pod.V4); err != nil {
		t.Fatal(err)
	}
	if sets := dt.Run(t, top.H, "ipset", "list", "-n"); strings.Contains(sets, ruleset.ProbeSetV6) && bc.value != "nft" {
		// iptables-nft's other flavour is legacy, which never ran here,
		// so no backend may keep the IPv6 set.
		t.Errorf("IPv6 probe set left: %s", sets)
	}
	if got := dt.PeerSeen(t, top.H, pod.V4); got != dt.Probe(4) {
		t.Errorf("ipv4 probe: P saw %s, want %s", got, dt.Probe(4))
	}
	if got := dt.PeerSeen(t, top.H, pod.V6); got != top.Pair.A.V6 {
		t.Errorf("ipv6 probe: P saw %s, want H's own address %s", got, top.Pair.A.V6)
	}
	if err := hp.Remove(); err != nil {
		t.Fatal(err)
	}
	if after := hostSnapshot(t, top.H); after != before {
		t.Fatalf("remove did not restore the host:\n%s\n---\n%s", before, after)
	}
}

// hostSnapshot is the host-side state a host probe may change.
func hostSnapshot(t *testing.T, path string) string {
	return dt.Snapshot(t, path) + "== ipset list -n\n" + dt.Run(t, path, "ipset", "list", "-n")
}

// hostProbe: kubelet-style probes from the node (a local socket) to an
// enrolled pod are SNATed to the probe address, ahead of another tool's
// MASQUERADE; forwarded traffic never is; removal restores the node.
func hostProbe(t *testing.T, bc backendCase) {
	testnet.RequireCommands(t, "ipset")
	top := dt.NewHostTopology(t)
	pod := top.Pair.B
	for _, f := range families() {
		bc.masquerade(t, top.H, dt.Addr(top.Pair.A, f))
	}
	before := hostSnapshot(t, top.H)
	hp := bc.build(t, top.H).Probe

	for _, f := range families() {
		if got := dt.PeerSeen(t, top.H, dt.Addr(pod, f)); got != dt.Addr(top.Pair.A, f) {
			t.Fatalf("%s before Ensure: P saw %s, want H's own address", fam(f), got)
		}
	}
	if err := hp.Ensure(); err != nil {
		t.Fatalf("ensure: %v", err)
	}
	ensured := hostSnapshot(t, top.H)
	if err := hp.Ensure(); err != nil {
		t.Fatalf("second ensure: %v", err)
	}
	if again := hostSnapshot(t, top.H); again != ensured {
		t.Fatalf("second Ensure changed state:\n%s\n---\n%s", ensured, again)
	}
	if d, err := hp.Verify(); err != nil || !d.Empty() {
		t.Fatalf("verify: %v\n%s", err, d)
	}
	// Enrolled only after AddIP: the set decides.
	if got := dt.PeerSeen(t, top.H, pod.V4); got != top.Pair.A.V4 {
		t.Fatalf("SNAT before AddIP: P saw %s", got)
	}
	for _, f := range families() {
		if err := hp.AddIP(dt.Addr(pod, f)); err != nil {
			t.Fatal(err)
		}
		if err := hp.AddIP(dt.Addr(pod, f)); err != nil {
			t.Fatalf("second AddIP: %v", err)
		}
	}
	ips, err := hp.IPs()
	if err != nil || !reflect.DeepEqual(ips, []netip.Addr{pod.V4, pod.V6}) {
		t.Fatalf("IPs = %v, %v", ips, err)
	}
	for _, f := range families() {
		if got := dt.PeerSeen(t, top.H, dt.Addr(pod, f)); got != dt.Probe(f) {
			t.Errorf("%s host-originated probe: P saw %s, want %s", fam(f), got, dt.Probe(f))
		}
		// Forwarded traffic has no local socket: never SNATed.
		if got := dt.PeerSeen(t, top.CPath, dt.Addr(pod, f)); got != dt.Addr(top.C, f) {
			t.Errorf("%s forwarded: P saw %s, want the client's %s", fam(f), got, dt.Addr(top.C, f))
		}
	}

	// Another tool's rule ahead of ours, added later: named and repaired
	// (iptables: the jump goes back on top), or harmless (nftables).
	want, undo := bc.acceptAbove(t, top.H, top.Pair.A.V4)
	if d, err := hp.Verify(); err != nil || d.String() != map[bool]string{true: "no drift", false: want}[want == ""] {
		t.Fatalf("rule ahead of the SNAT: %v\n%s\nwant %q", err, d, want)
	}
	if want != "" {
		if got := dt.PeerSeen(t, top.H, pod.V4); got == dt.Probe(4) {
			t.Fatalf("the rule ahead did not take the probe: the check proves nothing")
		}
		if err := hp.Ensure(); err != nil {
			t.Fatal(err)
		}
	}
	if got := dt.PeerSeen(t, top.H, pod.V4); got != dt.Probe(4) {
		t.Errorf("with another tool's rule ahead, P saw %s", got)
	}
	undo()

	// Drift: delete the SNAT rule by hand; Ensure repairs it.
	want = bc.breakHost(t, top.H)
	if d, err := hp.Verify(); err != nil || !strings.Contains(d.String(), want) {
		t.Fatalf("drift not named: %v\n%s\nwant %s", err, d, want)
	}
	if got := dt.PeerSeen(t, top.H, pod.V4); got == dt.Probe(4) {
		t.Fatalf("probe still SNATed without the rule: the check proves nothing")
	}
	if err := hp.Ensure(); err != nil {
		t.Fatal(err)
	}
	if got := dt.PeerSeen(t, top.H, pod.V4); got != dt.Probe(4) {
		t.Errorf("after repair P saw %s", got)
	}
	if ips, err := hp.IPs(); err != nil || len(ips) != 2 {
		t.Errorf("repair lost set members: %v %v", ips, err)
	}
	both := []netip.Addr{pod.V4, pod.V6}
	if lack, err := hp.Lacks(both); err != nil || len(lack) != 0 {
		t.Errorf("Lacks(%v) with both in the sets = %v, %v", both, lack, err)
	}

	for _, f := range families() {
		if err := hp.DelIP(dt.Addr(pod, f)); err != nil {
			t.Fatal(err)
		}
		// Asked again at once: a cached answer would miss it.
		if lack, err := hp.Lacks(both); err != nil || !slices.Contains(lack, dt.Addr(pod, f)) {
			t.Errorf("Lacks(%v) after DelIP(%v) = %v, %v", both, dt.Addr(pod, f), lack, err)
		}
		if err := hp.DelIP(dt.Addr(pod, f)); err != nil {
			t.Fatalf("second DelIP: %v", err)
		}
		if got := dt.PeerSeen(t, top.H, dt.Addr(pod, f)); got != dt.Addr(top.Pair.A, f) {
			t.Errorf("%s after DelIP: P saw %s", fam(f), got)
		}
	}
	for _, bad := range []netip.Addr{{}, netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::"), netip.MustParseAddr("fe80::1%eth0"), netip.MustParseAddr("224.0.0.1")} {
		if err := hp.AddIP(bad); err == nil {
			t.Errorf("AddIP(%v) accepted", bad)
		}
	}
	if err := hp.AddIP(pod.V4); err != nil { // Remove must also drop members
		t.Fatal(err)
	}
	if err := hp.Remove(); err != nil {
		t.Fatalf("remove: %v", err)
	}
	if after := hostSnapshot(t, top.H); after != before {
		t.Fatalf("remove did not restore:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if err := hp.Remove(); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if got := dt.PeerSeen(t, top.H, pod.V4); got != top.Pair.A.V4 {
		t.Errorf("after Remove P saw %s", got)
	}
	if err := hp.AddIP(pod.V4); err == nil {
		t.Error("AddIP succeeded with the set gone")
	}
}
