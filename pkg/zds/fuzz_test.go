package zds

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"

	"google.golang.org/protobuf/proto"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
)

func FuzzDecodeAck(f *testing.F) {
	fuzzseed.Add(f, "FuzzDecodeAck")
	f.Fuzz(func(t *testing.T, b []byte) {
		ack, err := decodeAck(b)
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("decode error not marked as protocol violation: %v", err)
			}
			return
		}
		if len(b) == 0 || len(b) > MaxMessageSize {
			t.Fatalf("accepted a %d-byte response", len(b))
		}
		// What was accepted must survive a round trip as an ack.
		out, err := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: ack}})
		if err != nil {
			t.Fatal(err)
		}
		again, err := decodeAck(out)
		if err != nil || again.GetError() != ack.GetError() {
			t.Fatalf("round trip changed the ack: %v %v", again, err)
		}
	})
}

func FuzzDecodeHello(f *testing.F) {
	fuzzseed.Add(f, "FuzzDecodeHello")
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHello(b)
		if err != nil {
			return
		}
		if h.GetVersion() < zdspb.Version_V1 || len(b) == 0 || len(b) > MaxMessageSize {
			t.Fatalf("accepted hello %v from %d bytes", h, len(b))
		}
	})
}

// FuzzPeer lets the fuzzer play ztunnel against a live server: its input
// is a length byte, a hello datagram and the ack for SnapshotSent. The
// server must hang up exactly when the hello or the ack is bad, become
// ready exactly when both are good, and keep serving afterwards.
func FuzzPeer(f *testing.F) {
	fuzzseed.Add(f, "FuzzPeer")
	s := startServer(f, Config{AckTimeout: time.Second, HelloTimeout: time.Second, MaxConnections: 64})
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		n := min(int(in[0]), len(in)-1)
		hello, ack := in[1:1+n], in[1+n:]
		c, err := net.Dial("unixpacket", s.SocketPath())
		if err != nil {
			t.Fatal(err)
		}
		p := &peer{t: t, uc: c.(*net.UnixConn)}
		defer func() {
			_ = p.uc.Close()
			poll.Until(t, "connection released", func() bool { return s.Connections() == 0 })
		}()
		if len(hello) > 0 {
			p.send(hello)
		}
		if _, err := decodeHello(hello); err != nil {
			p.expectClosed()
			return
		}
		if d := p.mustRecv(); d.req.GetSnapshotSent() == nil {
			t.Fatalf("want SnapshotSent, got %v", d.req)
		}
		if len(ack) > 0 {
			p.send(ack)
		}
		a, err := decodeAck(ack)
		if err != nil || a.GetError() != "" {
			p.expectClosed()
			return
		}
		poll.Until(t, "ready", func() bool { return s.ReadyConnections() == 1 })
	})
}
