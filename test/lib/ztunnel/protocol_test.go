package ztunnel

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

func mustMarshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func addMsg(uid string, withInfo bool) *zdspb.WorkloadRequest {
	a := &zdspb.AddWorkload{Uid: uid}
	if withInfo {
		a.WorkloadInfo = &zdspb.WorkloadInfo{Name: "p", Namespace: "ns", ServiceAccount: "sa"}
	}
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: a}}
}

func keepMsg(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
}

func delMsg(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
}

func snapMsg() *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}
}

func TestJudge(t *testing.T) {
	for _, tc := range []struct {
		name   string
		msg    []byte
		fds    int
		done   bool
		want   verdict
		reason string
	}{
		{"add", mustMarshal(t, addMsg("u", true)), 1, false, accept, ""},
		{"add after snapshot", mustMarshal(t, addMsg("u", true)), 1, true, accept, ""},
		{"add without fd", mustMarshal(t, addMsg("u", true)), 0, true, reject, "exactly one fd"},
		{"add with two fds", mustMarshal(t, addMsg("u", true)), 2, true, reject, "exactly one fd"},
		{"add without info", mustMarshal(t, addMsg("u", false)), 1, true, teardown, "workload_info"},
		{"add without uid", mustMarshal(t, addMsg("", true)), 1, true, reject, "uid"},
		{"keep in snapshot", mustMarshal(t, keepMsg("u")), 0, false, accept, ""},
		{"keep after snapshot", mustMarshal(t, keepMsg("u")), 0, true, teardown, "keep after snapshot"},
		{"keep with fd", mustMarshal(t, keepMsg("u")), 1, false, reject, "no fd"},
		{"del", mustMarshal(t, delMsg("u")), 0, true, accept, ""},
		{"del with fd", mustMarshal(t, delMsg("u")), 1, true, reject, "no fd"},
		{"snapshot", mustMarshal(t, snapMsg()), 0, false, accept, ""},
		{"second snapshot", mustMarshal(t, snapMsg()), 0, true, teardown, "second"},
		{"snapshot with fd", mustMarshal(t, snapMsg()), 1, false, reject, "no fd"},
		{"empty request", []byte{}, 0, false, teardown, "0 bytes"},
		{"no payload", []byte{0x30, 0x01}, 0, false, teardown, "payload"},
		{"garbage", []byte{0xff, 0xff, 0xff}, 0, false, teardown, "undecodable"},
		{"oversized", make([]byte, readBufferSize), 0, false, teardown, "bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, v, why := judge(tc.msg, tc.fds, tc.done)
			if v != tc.want || !strings.Contains(why, tc.reason) {
				t.Fatalf("judge = %v %q, want %v containing %q", v, why, tc.want, tc.reason)
			}
		})
	}
}

func FuzzJudge(f *testing.F) {
	addSeeds(f, "FuzzJudge")
	f.Fuzz(func(t *testing.T, b []byte, nfds uint8, done bool) {
		req, v, why := judge(b, int(nfds), done)
		if v == accept {
			if why != "" || req == nil || len(b) >= readBufferSize {
				t.Fatalf("accepted with reason %q", why)
			}
			if (req.GetAdd() != nil) != (nfds == 1) {
				t.Fatalf("accepted %v with %d fds", req, nfds)
			}
			if done && (req.GetKeep() != nil || req.GetSnapshotSent() != nil) {
				t.Fatalf("accepted %v after the snapshot", req)
			}
		} else if why == "" {
			t.Fatalf("refused without a reason")
		}
	})
}

func TestParseConnectLine(t *testing.T) {
	good := map[string]string{
		"CONNECT 10.1.2.3:8080\n":        "10.1.2.3:8080",
		"CONNECT [fd00::2]:80\n":         "[fd00::2]:80",
		"CONNECT [::ffff:10.0.0.1]:80\n": "10.0.0.1:80",
	}
	for in, want := range good {
		got, err := parseConnectLine([]byte(in))
		if err != nil || got.String() != want {
			t.Errorf("%q: %v, %v; want %s", in, got, err, want)
		}
		if again, err := parseConnectLine(connectLine(got)); err != nil || again != got {
			t.Errorf("round trip of %v: %v %v", got, again, err)
		}
	}
	for _, in := range []string{"", "\n", "CONNECT \n", "CONNECT 10.0.0.1:8080", "GET / HTTP/1.1\n",
		"CONNECT 10.0.0.1:0\n", "CONNECT host:80\n", "CONNECT [fe80::1%eth0]:80\n", "CONNECT " + strings.Repeat("1", 200) + "\n"} {
		if _, err := parseConnectLine([]byte(in)); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

func FuzzParseConnectLine(f *testing.F) {
	addSeeds(f, "FuzzParseConnectLine")
	f.Fuzz(func(t *testing.T, b []byte) {
		ap, err := parseConnectLine(b)
		if err != nil {
			return
		}
		if ap.Port() == 0 || ap.Addr().Is4In6() || ap.Addr().Zone() != "" {
			t.Fatalf("accepted target %v", ap)
		}
		if again, err := parseConnectLine(connectLine(ap)); err != nil || again != ap {
			t.Fatalf("round trip of %v: %v %v", ap, again, err)
		}
	})
}

func addSeeds(f *testing.F, name string) {
	files, _ := filepath.Glob(filepath.Join("testdata", "seeds", name, "*"))
	if len(files) == 0 {
		f.Fatalf("no seeds for %s", name)
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		switch name {
		case "FuzzJudge":
			// Seed files hold: fd count byte, snapshot-done byte, request.
			if len(b) < 2 {
				f.Fatalf("seed %s too short", p)
			}
			f.Add(b[2:], b[0], b[1] != 0)
		default:
			f.Add(b)
		}
	}
}

// rawServer plays the node agent so tests can send the stand-in anything.
type rawServer struct {
	t    *testing.T
	path string
	ln   *net.UnixListener
}

func newRawServer(t *testing.T) *rawServer {
	path := filepath.Join(t.TempDir(), "zds.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return &rawServer{t: t, path: path, ln: ln}
}

type rawConn struct {
	t  *testing.T
	uc *net.UnixConn
}

// accept takes the next connection and checks its hello.
func (s *rawServer) accept() *rawConn {
	s.t.Helper()
	_ = s.ln.SetDeadline(time.Now().Add(10 * time.Second))
	uc, err := s.ln.AcceptUnix()
	if err != nil {
		s.t.Fatalf("accept: %v", err)
	}
	s.t.Cleanup(func() { _ = uc.Close() })
	c := &rawConn{t: s.t, uc: uc}
	b := c.read()
	var h zdspb.ZdsHello
	if err := proto.Unmarshal(b, &h); err != nil || h.GetVersion() != zdspb.Version_V1 {
		s.t.Fatalf("bad hello %x: %v", b, err)
	}
	return c
}

func (c *rawConn) read() []byte {
	c.t.Helper()
	buf := make([]byte, 4096)
	_ = c.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := c.uc.Read(buf)
	if err != nil {
		c.t.Fatalf("read: %v", err)
	}
	return buf[:n]
}

// request sends one datagram with fds and returns the ack's error text.
func (c *rawConn) request(b []byte, fds ...int) string {
	c.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.uc.WriteMsgUnix(b, oob, nil); err != nil {
		c.t.Fatalf("write: %v", err)
	}
	var r zdspb.WorkloadResponse
	if err := proto.Unmarshal(c.read(), &r); err != nil || r.GetAck() == nil {
		c.t.Fatalf("not an ack: %v", err)
	}
	return r.GetAck().GetError()
}

func (c *rawConn) expectHangup() {
	c.t.Helper()
	buf := make([]byte, 4096)
	_ = c.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := c.uc.Read(buf)
	if n == 0 && (err == nil || errors.Is(err, io.EOF)) {
		return
	}
	c.t.Fatalf("expected the stand-in to hang up, got %d bytes, %v", n, err)
}

func runStandIn(t *testing.T, cfg Config) *StandIn {
	t.Helper()
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff, cfg.MaxBackoff = 20*time.Millisecond, 200*time.Millisecond
	}
	z := New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- z.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("stand-in: %v", err)
		}
	})
	return z
}

// TestStandInAcksLikeZtunnel sends the stand-in valid and invalid requests
// and checks each ack and hang-up against the spec.
func TestStandInAcksLikeZtunnel(t *testing.T) {
	srv := newRawServer(t)
	z := runStandIn(t, Config{SocketPath: srv.path})
	c := srv.accept()

	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	defer pw.Close()
	pipeFD := int(pr.Fd())

	if e := c.request(mustMarshal(t, keepMsg("k"))); e != "" {
		t.Errorf("keep during snapshot: %q", e)
	}
	if e := c.request(mustMarshal(t, addMsg("a", true))); !strings.Contains(e, "exactly one fd") {
		t.Errorf("add without fd: %q", e)
	}
	if e := c.request(mustMarshal(t, addMsg("a", true)), pipeFD, pipeFD); !strings.Contains(e, "exactly one fd") {
		t.Errorf("add with two fds: %q", e)
	}
	if e := c.request(mustMarshal(t, addMsg("a", true)), pipeFD); !strings.Contains(e, "not a namespace") {
		t.Errorf("add with a pipe: %q", e)
	}
	if e := c.request(mustMarshal(t, keepMsg("k")), pipeFD); !strings.Contains(e, "no fd") {
		t.Errorf("keep with fd: %q", e)
	}
	if e := c.request(mustMarshal(t, snapMsg())); e != "" {
		t.Errorf("snapshot: %q", e)
	}
	if err := z.Wait(ctxFor(t, 5*time.Second), z.Ready); err != nil {
		t.Fatal("stand-in not ready after the snapshot")
	}
	if e := c.request(mustMarshal(t, delMsg("nobody"))); e != "" {
		t.Errorf("del of an unknown uid: %q", e)
	}
	if e := c.request(mustMarshal(t, delMsg("nobody")), pipeFD); !strings.Contains(e, "no fd") {
		t.Errorf("del with fd: %q", e)
	}
	if len(z.Workloads()) != 0 {
		t.Errorf("workloads after refused adds: %v", z.Workloads())
	}

	// Each protocol error: an error ack, a hang-up, and a reconnect.
	for _, bad := range []struct {
		name string
		msg  []byte
		want string
	}{
		{"keep after snapshot", mustMarshal(t, keepMsg("k")), "keep after snapshot"},
		{"second snapshot", mustMarshal(t, snapMsg()), "second snapshot_sent"},
		{"add without workload_info", mustMarshal(t, addMsg("a", false)), "workload_info"},
		{"garbage", []byte{0xff, 0x00, 0xff}, "undecodable"},
	} {
		if e := c.request(bad.msg); !strings.Contains(e, bad.want) {
			t.Errorf("%s: ack %q, want %q", bad.name, e, bad.want)
		}
		c.expectHangup()
		c = srv.accept()
		if e := c.request(mustMarshal(t, snapMsg())); e != "" {
			t.Fatalf("snapshot after reconnect: %q", e)
		}
	}

	// A datagram that does not fit ztunnel's 1024-byte buffer.
	if _, err := c.uc.Write(make([]byte, 1500)); err != nil {
		t.Fatal(err)
	}
	c.read() // error ack
	c.expectHangup()
	srv.accept()

	msgs := z.Messages()
	if len(msgs) == 0 || msgs[0].Kind != KindKeep || msgs[0].Conn != 1 {
		t.Fatalf("messages not recorded: %+v", msgs)
	}
	if z.Connections() < 6 {
		t.Errorf("connections = %d, want a reconnect after each protocol error", z.Connections())
	}
}

// TestStandInFaults checks the misbehaviour knobs themselves.
func TestStandInFaults(t *testing.T) {
	srv := newRawServer(t)
	z := runStandIn(t, Config{SocketPath: srv.path})
	c := srv.accept()

	z.SetFaults(Faults{AckTwice: true})
	if _, err := c.uc.Write(mustMarshal(t, keepMsg("k"))); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		var r zdspb.WorkloadResponse
		if err := proto.Unmarshal(c.read(), &r); err != nil || r.GetAck() == nil {
			t.Fatalf("want two acks: %v", err)
		}
	}
	z.SetFaults(Faults{Garbage: true})
	if _, err := c.uc.Write(mustMarshal(t, keepMsg("k"))); err != nil {
		t.Fatal(err)
	}
	var r zdspb.WorkloadResponse
	if err := proto.Unmarshal(c.read(), &r); err == nil {
		t.Fatalf("garbage decoded as %v", &r)
	}
	z.SetFaults(Faults{NeverAck: true})
	if _, err := c.uc.Write(mustMarshal(t, keepMsg("k"))); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_ = c.uc.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := c.uc.Read(buf); err == nil {
		t.Fatalf("never-ack answered %d bytes", n)
	}
	z.SetFaults(Faults{RejectAdd: func(string) string { return "nope" }, NoHello: true})
	z.Disconnect()
	_ = srv.ln.SetDeadline(time.Now().Add(10 * time.Second))
	uc, err := srv.ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	_ = uc.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := uc.Read(buf); err == nil {
		t.Fatalf("NoHello sent %d bytes", n)
	}
}

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
