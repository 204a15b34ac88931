package netns

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// ListeningTCPPorts sees the listeners of the namespace it is given, v4
// and v6, and none of the caller's.
func TestListeningTCPPorts(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	f, err := os.Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	host, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	var lns []net.Listener
	err = Do(pod.Path(), func() error {
		for _, a := range []struct{ network, addr string }{{"tcp4", "0.0.0.0:15001"}, {"tcp6", "[::]:15008"}} {
			ln, err := (&net.ListenConfig{}).Listen(context.Background(), a.network, a.addr)
			if err != nil {
				return err
			}
			lns = append(lns, ln)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	ports, err := ListeningTCPPorts(f)
	if err != nil {
		t.Fatal(err)
	}
	if !ports[15001] || !ports[15008] || len(ports) != 2 {
		t.Fatalf("ports %v, want 15001 and 15008 only", ports)
	}
	_ = lns[0].Close()
	if ports, err = ListeningTCPPorts(f); err != nil || ports[15001] || !ports[15008] {
		t.Fatalf("after closing 15001: ports %v, err %v", ports, err)
	}
}

// TCPListening answers as ListeningTCPPorts would for the ports asked:
// a wildcard listener of either family and a dual-stack one are found by
// the exact lookups, one bound to another address through the dump, and
// the host's listeners never count.
func TestTCPListening(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	if err := testnet.LoopbackUp(pod); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	host, err := net.Listen("tcp4", "127.0.0.1:15020")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	lns := map[uint16]net.Listener{}
	err = Do(pod.Path(), func() error {
		for _, a := range []struct {
			port          uint16
			network, addr string
		}{
			{15001, "tcp4", "0.0.0.0:15001"},
			{15006, "tcp", "[::]:15006"},  // dual-stack
			{15008, "tcp6", "[::]:15008"}, // IPv6 only
			{15010, "tcp4", "127.0.0.2:15010"},
		} {
			ln, err := (&net.ListenConfig{}).Listen(context.Background(), a.network, a.addr)
			if err != nil {
				return err
			}
			lns[a.port] = ln
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	// The exact lookups alone, as the kernel answers them.
	err = Do(pod.Path(), func() error {
		fd, err := diagSocket()
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		v4, v6 := loopbacks()[0], loopbacks()[1]
		for i, c := range []struct {
			at   netip.Addr
			port uint16
			want bool
		}{
			{v4, 15001, true}, {v4, 15006, true}, {v6, 15006, true}, {v4, 15008, false}, {v6, 15008, true},
			{v6, 15001, false}, {v4, 15010, false}, {v4, 15020, false}, {v4, 15099, false},
		} {
			got, err := lookupListener(fd, c.at, c.port, uint32(i+1))
			if err != nil {
				return err
			}
			if got != c.want {
				t.Errorf("lookup %v port %d: %v, want %v", c.at, c.port, got, c.want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ask := []uint16{15001, 15006, 15008, 15010, 15020, 15099}
	check := func(closed uint16) {
		t.Helper()
		got, err := TCPListening(f, ask)
		if err != nil {
			t.Fatal(err)
		}
		all, err := ListeningTCPPorts(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ask {
			want := lns[p] != nil && p != closed
			if got[p] != want || all[p] != want {
				t.Errorf("port %d (closed %d): TCPListening %v, ListeningTCPPorts %v, want %v", p, closed, got[p], all[p], want)
			}
		}
	}
	check(0)
	_ = lns[15006].Close()
	check(15006)
}

func diagMsg(seq uint32, typ uint16, body []byte) []byte {
	l := unix.NLMSG_HDRLEN + len(body)
	b := make([]byte, (l+3)&^3)
	binary.NativeEndian.PutUint32(b[0:], uint32(l))
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint32(b[8:], seq)
	copy(b[unix.NLMSG_HDRLEN:], body)
	return b
}

// The parser takes the kernel's answer apart without trusting it:
// truncated, oversized and foreign messages are errors, never a panic.
func TestParseDiagListening(t *testing.T) {
	listen := make([]byte, sizeofInetDiagMsg)
	listen[1] = tcpListen
	binary.BigEndian.PutUint16(listen[4:], 15006)
	other := make([]byte, sizeofInetDiagMsg)
	other[1] = 1 // ESTABLISHED
	binary.BigEndian.PutUint16(other[4:], 9)
	good := append(diagMsg(7, unix.SOCK_DIAG_BY_FAMILY, listen), diagMsg(7, unix.SOCK_DIAG_BY_FAMILY, other)...)
	out := map[uint16]bool{}
	if done, err := parseDiagListening(good, 7, out); err != nil || done || !out[15006] || out[9] {
		t.Fatalf("good: done %v err %v out %v", done, err, out)
	}
	if done, err := parseDiagListening(diagMsg(7, unix.NLMSG_DONE, make([]byte, 4)), 7, out); err != nil || !done {
		t.Fatalf("done: %v %v", done, err)
	}
	errno := make([]byte, 4)
	e := -int32(unix.EPERM)
	binary.NativeEndian.PutUint32(errno, uint32(e))
	for name, b := range map[string][]byte{
		"short header":  good[:8],
		"long length":   func() []byte { b := append([]byte(nil), good...); binary.NativeEndian.PutUint32(b, 1<<20); return b }(),
		"tiny length":   func() []byte { b := append([]byte(nil), good...); binary.NativeEndian.PutUint32(b, 3); return b }(),
		"short body":    diagMsg(7, unix.SOCK_DIAG_BY_FAMILY, listen[:10]),
		"other request": diagMsg(8, unix.SOCK_DIAG_BY_FAMILY, listen),
		"error":         diagMsg(7, unix.NLMSG_ERROR, errno),
		"short error":   diagMsg(7, unix.NLMSG_ERROR, nil),
	} {
		if _, err := parseDiagListening(b, 7, map[uint16]bool{}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func FuzzParseDiagListening(f *testing.F) {
	fuzzseed.Add(f, "FuzzParseDiagListening")
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = parseDiagListening(b, 1, map[uint16]bool{})
	})
}

// BenchmarkListening measures what the verifier pays per proof to see
// ztunnel's three ports in a pod: the dump of every listener
// (ListeningTCPPorts) against the exact lookups (TCPListening), with the
// pod's six listeners (three ports, IPv4 and IPv6) and, elsewhere on the
// host, none or as many as 600 such pods would hold. cpu-us/op is the
// process's CPU (user and system) per call.
//
//	go test -run '^$' -bench Listening ./pkg/netns
func BenchmarkListening(b *testing.B) {
	testnet.RequireRoot(b)
	ports := []uint16{15001, 15006, 15008}
	pod := testnet.NewNS(b)
	f, err := os.Open(pod.Path())
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	listen := func(path string, ports []uint16) {
		b.Helper()
		err := Do(path, func() error {
			for _, p := range ports {
				for _, network := range []string{"tcp4", "tcp6"} {
					ln, err := (&net.ListenConfig{}).Listen(context.Background(), network, net.JoinHostPort("", fmt.Sprint(p)))
					if err != nil {
						return err
					}
					lns = append(lns, ln)
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	listen(pod.Path(), ports)
	others := testnet.NewNS(b)
	for _, n := range []int{0, 600} {
		if n > 0 {
			var more []uint16
			for i := range 3 * n {
				more = append(more, uint16(20000+i))
			}
			listen(others.Path(), more)
		}
		for _, c := range []struct {
			name string
			fn   func() (map[uint16]bool, error)
		}{
			{"dump", func() (map[uint16]bool, error) { return ListeningTCPPorts(f) }},
			{"lookup", func() (map[uint16]bool, error) { return TCPListening(f, ports) }},
		} {
			b.Run(fmt.Sprintf("%s/other-pods=%d", c.name, n), func(b *testing.B) {
				cpu0 := processCPU(b)
				for b.Loop() {
					got, err := c.fn()
					if err != nil || !got[15001] || !got[15006] || !got[15008] {
						b.Fatal(got, err)
					}
				}
				b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-us/op")
			})
		}
	}
}

// processCPU is the process's CPU time, user and system.
func processCPU(tb testing.TB) time.Duration {
	tb.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
