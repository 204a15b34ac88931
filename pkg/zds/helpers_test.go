package zds

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// startServer runs a server on a socket in a temp dir until the test ends.
func startServer(t testing.TB, cfg Config) *Server {
	t.Helper()
	if cfg.SocketPath == "" {
		cfg.SocketPath = filepath.Join(t.TempDir(), "zds.sock")
	}
	if cfg.AckTimeout == 0 {
		cfg.AckTimeout = 2 * time.Second
	}
	if cfg.AcceptRate == 0 {
		cfg.AcceptRate = 10000
		cfg.AcceptBurst = 10000
	}
	s := NewServer(cfg)
	if err := s.Listen(); err != nil {
		t.Fatalf("listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Serve did not return after cancel")
		}
	})
	return s
}

// peer is a raw ZDS client driven step by step by a test.
type peer struct {
	t  testing.TB
	uc *net.UnixConn
}

func dialPeer(t testing.TB, s *Server) *peer {
	t.Helper()
	c, err := net.Dial("unixpacket", s.SocketPath())
	if err != nil {
		t.Fatalf("dial zds: %v", err)
	}
	p := &peer{t: t, uc: c.(*net.UnixConn)}
	t.Cleanup(func() { _ = p.uc.Close() })
	return p
}

func (p *peer) send(b []byte) {
	p.t.Helper()
	if _, err := p.uc.Write(b); err != nil {
		p.t.Fatalf("peer write: %v", err)
	}
}

func (p *peer) hello() {
	p.t.Helper()
	b, _ := proto.Marshal(&zdspb.ZdsHello{Version: zdspb.Version_V1})
	p.send(b)
}

func (p *peer) ack(errText string) {
	p.t.Helper()
	b, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: errText}}})
	p.send(b)
}

// datagram is one message the server sent, with its descriptors.
type datagram struct {
	raw []byte
	req *zdspb.WorkloadRequest
	fds []int
}

func (d datagram) close() {
	for _, fd := range d.fds {
		_ = unix.Close(fd)
	}
}

// recv reads one datagram with a bigger buffer than ztunnel's, so an
// oversized message would be seen rather than truncated.
func (p *peer) recv(timeout time.Duration) (datagram, error) {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4*8))
	_ = p.uc.SetReadDeadline(time.Now().Add(timeout))
	n, oobn, flags, _, err := p.uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return datagram{}, err
	}
	if n == 0 {
		return datagram{}, errEOF
	}
	d := datagram{raw: append([]byte(nil), buf[:n]...)}
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return d, err
		}
		for _, m := range msgs {
			fds, err := unix.ParseUnixRights(&m)
			if err != nil {
				return d, err
			}
			d.fds = append(d.fds, fds...)
		}
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return d, errors.New("truncated datagram")
	}
	var req zdspb.WorkloadRequest
	if err := proto.Unmarshal(d.raw, &req); err != nil {
		return d, err
	}
	d.req = &req
	return d, nil
}

var errEOF = errors.New("peer: connection closed by server")

// mustRecv reads one request, failing the test on error or oversize.
func (p *peer) mustRecv() datagram {
	p.t.Helper()
	d, err := p.recv(5 * time.Second)
	if err != nil {
		p.t.Fatalf("peer recv: %v", err)
	}
	if len(d.raw) > MaxMessageSize {
		p.t.Fatalf("server sent %d bytes, limit %d", len(d.raw), MaxMessageSize)
	}
	return d
}

// expectClosed waits for the server to hang up.
func (p *peer) expectClosed() {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		d, err := p.recv(time.Until(deadline))
		d.close()
		if err == nil {
			continue // drain whatever was queued before the hang-up
		}
		if errors.Is(err, errEOF) || errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET) {
			return
		}
		p.t.Fatalf("expected the server to close the connection, got %v", err)
	}
	p.t.Fatalf("server did not close the connection")
}

// expectSilence asserts nothing arrives within d (a negative check, so a
// short bounded wait is enough).
func (p *peer) expectSilence(d time.Duration) {
	p.t.Helper()
	got, err := p.recv(d)
	if err == nil {
		got.close()
		p.t.Fatalf("unexpected message: %v", got.req)
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		p.t.Fatalf("expected silence, got %v", err)
	}
}

// handshake says hello and acks an empty snapshot.
func (p *peer) handshake() {
	p.t.Helper()
	p.hello()
	d := p.mustRecv()
	if d.req.GetSnapshotSent() == nil {
		p.t.Fatalf("expected SnapshotSent, got %v", d.req)
	}
	p.ack("")
}

// autoAck acks every request (closing descriptors) until the connection
// ends; the returned func waits for that.
func (p *peer) autoAck(errFor func(*zdspb.WorkloadRequest) string) (wait func()) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			d, err := p.recv(time.Hour)
			d.close()
			if err != nil {
				return
			}
			msg := ""
			if errFor != nil {
				msg = errFor(d.req)
			}
			b, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: msg}}})
			if _, err := p.uc.Write(b); err != nil {
				return
			}
		}
	}()
	return wg.Wait
}

// selfNetns opens this process's own network namespace: a real netns fd
// that needs no privileges.
func selfNetns(t testing.TB) *os.File {
	t.Helper()
	f, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatalf("open own netns: %v", err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func inode(t testing.TB, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatalf("fstat: %v", err)
	}
	return st.Ino
}

// goroutines lets the GC and finalizers run first, so an fd count taken
// right after it only sees files that are really held.
func goroutines() int {
	runtime.GC()
	time.Sleep(20 * time.Millisecond) // finalizers run on their own goroutine
	runtime.GC()
	return runtime.NumGoroutine()
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// readyPeer dials s as the first ztunnel, says hello, and waits until the
// server counts the connection ready.
func readyPeer(t testing.TB, s *Server) *peer {
	t.Helper()
	p := dialPeer(t, s)
	p.handshake()
	poll.Until(t, "ready", func() bool { return s.ReadyConnections() == 1 })
	return p
}
