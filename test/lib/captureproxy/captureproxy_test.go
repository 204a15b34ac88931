package captureproxy

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func TestParseBanner(t *testing.T) {
	r := Record{Proto: "tcp", Port: 15001, Local: netip.MustParseAddrPort("127.0.0.1:15001"),
		OrigDst: netip.MustParseAddrPort("10.0.0.2:8080"), Peer: netip.MustParseAddrPort("10.0.0.1:40000")}
	got, err := ParseBanner(r.banner())
	if err != nil || got.String() != r.String() {
		t.Fatalf("round trip: got %v, %v; want %v", got, err, r)
	}
	r6 := Record{Proto: "udp", Port: 15053, Local: netip.MustParseAddrPort("[::]:15053"), Peer: netip.MustParseAddrPort("[fd00::1]:5353")}
	if got, err := ParseBanner(r6.banner()); err != nil || got.OrigDst.IsValid() || got.String() != r6.String() {
		t.Fatalf("v6 round trip: got %v, %v", got, err)
	}
	for name, in := range map[string]string{
		"empty":         "",
		"other server":  "HTTP/1.1 200 OK\n",
		"missing field": "captureproxy proto=tcp port=1 local=1.2.3.4:5 orig=-\n",
		"extra field":   "captureproxy proto=tcp port=1 local=1.2.3.4:5 orig=- peer=1.2.3.4:6 x=y\n",
		"dup field":     "captureproxy proto=tcp port=1 port=1 orig=- peer=1.2.3.4:6\n",
		"bad port":      "captureproxy proto=tcp port=70000 local=1.2.3.4:5 orig=- peer=1.2.3.4:6\n",
		"bad proto":     "captureproxy proto=sctp port=1 local=1.2.3.4:5 orig=- peer=1.2.3.4:6\n",
		"bad addr":      "captureproxy proto=tcp port=1 local=1.2.3.400:5 orig=- peer=1.2.3.4:6\n",
		"no equals":     "captureproxy proto tcp port=1 local=1.2.3.4:5 orig=- peer=1.2.3.4:6\n",
		"unknown key":   "captureproxy proto=tcp port=1 local=1.2.3.4:5 orig=- zzzz=1.2.3.4:6\n",
		"oversized":     "captureproxy " + strings.Repeat("x", 1000),
		"double spaces": "captureproxy  proto=tcp port=1 local=1.2.3.4:5 orig=- peer=1.2.3.4:6\n",
	} {
		if _, err := ParseBanner(in); err == nil {
			t.Errorf("%s: accepted %q", name, in)
		}
	}
}

func FuzzParseBanner(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/seeds/FuzzParseBanner/*")
	for _, s := range seeds {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(string(b))
	}
	f.Fuzz(func(t *testing.T, in string) {
		r, err := ParseBanner(in)
		if err != nil {
			return
		}
		// Whatever parses must survive a round trip unchanged.
		again, err := ParseBanner(r.banner())
		if err != nil || again.String() != r.String() {
			t.Fatalf("round trip of %q: %v, %v", in, again, err)
		}
	})
}

// startLocal starts a proxy in the caller's namespace on ephemeral ports.
func startLocal(t *testing.T, cfg Config) (*Proxy, map[string]netip.AddrPort) {
	t.Helper()
	p, err := Start("", cfg)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	addrs := map[string]netip.AddrPort{}
	for _, a := range p.Addrs() {
		fam := "4"
		if a.Addr().Is6() {
			fam = "6"
		}
		if _, ok := addrs[fam]; !ok {
			addrs[fam] = a
		}
	}
	return p, addrs
}

func loopbackOf(a netip.AddrPort) netip.AddrPort {
	if a.Addr().Is6() {
		return netip.AddrPortFrom(netip.IPv6Loopback(), a.Port())
	}
	return netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), a.Port())
}

func TestRecordsAndBanner(t *testing.T) {
	p, addrs := startLocal(t, Config{TCPPorts: []uint16{0}, NoIPv6: true})
	dst := loopbackOf(addrs["4"])
	got, err := Dial(context.Background(), "", dst, DialOptions{})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	if diff := cmp.Diff(Record{Port: dst.Port(), Local: dst}, Record{Port: got.Port, Local: got.Local}, cmpopts.EquateComparable(netip.AddrPort{})); diff != "" || got.Redirected() {
		t.Fatalf("banner %v, want port %d local %s, not redirected", got, dst.Port(), dst)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rec, err := p.WaitFor(ctx, func(r Record) bool { return r.Peer == got.Peer })
	if err != nil {
		t.Fatalf("wait: %v (records %v)", err, p.Records())
	}
	if rec.Proto != "tcp" || rec.Port != dst.Port() {
		t.Fatalf("record %v", rec)
	}
	p.Reset()
	if n := len(p.Records()); n != 0 {
		t.Fatalf("reset left %d records", n)
	}
}

func TestUDP(t *testing.T) {
	p, addrs := startLocal(t, Config{UDPPorts: []uint16{0}, NoIPv6: true})
	dst := loopbackOf(addrs["4"])
	big := bytes.Repeat([]byte("q"), 4000)
	got, err := ExchangeUDP(context.Background(), "", dst, big, DialOptions{})
	if err != nil {
		t.Fatalf("exchange: %v", err)
	}
	if got.Proto != "udp" || got.Port != dst.Port() {
		t.Fatalf("banner %v", got)
	}
	recs := p.Records()
	if len(recs) != 1 || len(recs[0].Data) != MaxDatagram {
		t.Fatalf("records %v: want one with %d bytes kept", recs, MaxDatagram)
	}
}

// TestHostileClients: a client that floods, one that never reads and one
// that sends garbage neither block other clients nor survive Close.
func TestHostileClients(t *testing.T) {
	p, addrs := startLocal(t, Config{TCPPorts: []uint16{0}, NoIPv6: true})
	dst := loopbackOf(addrs["4"])
	before := runtime.NumGoroutine()

	flood, err := net.Dial("tcp", dst.String())
	if err != nil {
		t.Fatal(err)
	}
	defer flood.Close()
	// Flooding more than the drain limit gets the connection closed.
	done := make(chan error, 1)
	go func() {
		_, err := flood.Write(make([]byte, 4*maxDrain))
		if err == nil {
			_, err = io.Copy(io.Discard, flood)
		}
		done <- err
	}()

	silent, err := net.Dial("tcp", dst.String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()

	// Another client is served while those two hang around.
	if _, err := Dial(context.Background(), "", dst, DialOptions{Timeout: 2 * time.Second}); err != nil {
		t.Fatalf("third client not served: %v", err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("flooding client never cut off")
	}

	start := time.Now()
	_ = p.Close()
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("Close took %v with a silent client connected", d)
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Errorf("goroutines: %d before, %d after Close", before, n)
	}
	if _, err := Dial(context.Background(), "", dst, DialOptions{Timeout: time.Second}); err == nil {
		t.Fatal("closed proxy still answers")
	}
}

func TestDialRejectsNonBanner(t *testing.T) {
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for i := 0; i < 2; i++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if i == 0 {
				_, _ = c.Write(bytes.Repeat([]byte("A"), 4096)) // no newline, oversized
			} else {
				_, _ = c.Write([]byte("SSH-2.0-OpenSSH\n"))
			}
			_ = c.Close()
		}
	}()
	dst := netip.MustParseAddrPort(l.Addr().String())
	for i := 0; i < 2; i++ {
		if r, err := Dial(context.Background(), "", dst, DialOptions{Timeout: 2 * time.Second}); err == nil {
			t.Errorf("attempt %d: accepted %v", i, r)
		}
	}
}

// TestOriginalDstThroughREDIRECT proves SO_ORIGINAL_DST and its IPv6
// twin against a real NAT redirect in a throwaway namespace.
func TestOriginalDstThroughREDIRECT(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-nft", "ip6tables-nft")
	n := testnet.NewNS(t)
	p, err := Start(n.Path(), Config{TCPPorts: []uint16{15001}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, tc := range []struct {
		bin, dst string
	}{
		{"iptables-nft", "192.0.2.10:8080"},
		{"ip6tables-nft", "[2001:db8::10]:8080"},
	} {
		dst := netip.MustParseAddrPort(tc.dst)
		err := n.Do(func(ns.NetNS) error {
			if out, err := exec.Command(tc.bin, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", dst.Addr().String(),
				"-j", "REDIRECT", "--to-ports", "15001").CombinedOutput(); err != nil {
				t.Fatalf("%s: %v: %s", tc.bin, err, out)
			}
			// A route so the connect is attempted at all.
			if out, err := exec.Command("ip", "route", "add", "local", dst.Addr().String(), "dev", "lo").CombinedOutput(); err != nil {
				t.Fatalf("ip route: %v: %s", err, out)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		got, err := Dial(context.Background(), n.Path(), dst, DialOptions{Mark: 0x539})
		if err != nil {
			t.Fatalf("dial %s: %v", dst, err)
		}
		if got.Port != 15001 || got.OrigDst != dst || !got.Redirected() {
			t.Errorf("dial %s: banner %v, want port 15001 orig %s", dst, got, dst)
		}
	}
}
