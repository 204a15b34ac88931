package netns

import (
	"context"
	"encoding/binary"
	"net"
	"os"
	"testing"

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
