package zds

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"

	"github.com/google/go-cmp/cmp"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
)

// TestWireConformance drives a server through snapshot, Add and Del and
// decodes every datagram with the generated types, checking descriptors,
// field numbers on the wire and the size limit.
func TestWireConformance(t *testing.T) {
	ns1, ns2 := selfNetns(t), selfNetns(t)
	wantIno := inode(t, int(ns1.Fd()))
	snap := []Workload{
		{UID: "uid-a", Info: WorkloadInfo{Name: "a", Namespace: "shop", ServiceAccount: "sa-a"}, Netns: ns1},
		{UID: "uid-keep", Info: WorkloadInfo{Name: "k", Namespace: "shop"}},
		{UID: "uid-b", Info: WorkloadInfo{Name: "b", Namespace: "shop", ServiceAccount: "sa-b"}, Netns: ns2},
	}
	s := startServer(t, Config{Snapshot: func() []Workload { return snap }})
	p := dialPeer(t, s)
	p.hello()

	// Snapshot: Add, Keep, Add in the state's order, then SnapshotSent.
	for _, w := range snap {
		d := p.mustRecv()
		if w.Netns != nil {
			add := d.req.GetAdd()
			if add == nil || add.GetUid() != w.UID {
				t.Fatalf("want Add %s, got %v", w.UID, d.req)
			}
			wi := add.GetWorkloadInfo()
			if diff := cmp.Diff(w.Info, WorkloadInfo{Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()}); diff != "" {
				t.Errorf("workload info %v, want %+v", wi, w.Info)
			}
			if len(d.fds) != 1 {
				t.Fatalf("Add carried %d fds, want exactly 1", len(d.fds))
			}
			if got := inode(t, d.fds[0]); got != wantIno {
				t.Errorf("Add fd is inode %d, want the netns %d", got, wantIno)
			}
			checkTags(t, d.raw, 1, map[protowire.Number]bool{1: true, 2: true})
		} else {
			if d.req.GetKeep().GetUid() != w.UID {
				t.Fatalf("want Keep %s, got %v", w.UID, d.req)
			}
			if len(d.fds) != 0 {
				t.Errorf("Keep carried %d fds", len(d.fds))
			}
			checkTags(t, d.raw, 5, map[protowire.Number]bool{1: true})
		}
		d.close()
		p.ack("")
	}
	d := p.mustRecv()
	if d.req.GetSnapshotSent() == nil || len(d.fds) != 0 {
		t.Fatalf("want SnapshotSent without fds, got %v (%d fds)", d.req, len(d.fds))
	}
	checkTags(t, d.raw, 3, nil)
	p.ack("")
	poll.Until(t, "ready connection", func() bool { return s.ReadyConnections() == 1 })

	// Add after the snapshot, with the longest names Kubernetes allows.
	long := WorkloadInfo{Name: strings.Repeat("n", 253), Namespace: strings.Repeat("s", 63), ServiceAccount: strings.Repeat("a", 253)}
	uid := "0123456789abcdef0123456789abcdef0123"
	errc := make(chan error, 1)
	go func() { errc <- s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: uid, Info: long, Netns: ns1}) }()
	d = p.mustRecv()
	if d.req.GetAdd().GetUid() != uid || len(d.fds) != 1 {
		t.Fatalf("want Add %s with one fd, got %v (%d fds)", uid, d.req, len(d.fds))
	}
	t.Logf("largest Add: %d bytes", len(d.raw))
	d.close()
	p.ack("")
	if err := <-errc; err != nil {
		t.Fatalf("Add: %v", err)
	}

	// Del: uid in field 2, no fds.
	go func() { errc <- s.Del(ctxTimeout(t, 5*time.Second), uid) }()
	d = p.mustRecv()
	if d.req.GetDel().GetUid() != uid || len(d.fds) != 0 {
		t.Fatalf("want Del %s without fds, got %v (%d fds)", uid, d.req, len(d.fds))
	}
	checkTags(t, d.raw, 2, map[protowire.Number]bool{2: true})
	p.ack("")
	if err := <-errc; err != nil {
		t.Fatalf("Del: %v", err)
	}

	// An ack with an error is that request's failure; the connection stays.
	go func() { errc <- s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: "refused", Netns: ns1}) }()
	d = p.mustRecv()
	d.close()
	p.ack("no such pod")
	var ae *AckError
	if err := <-errc; !errors.As(err, &ae) || ae.Msg != "no such pod" || ae.UID != "refused" {
		t.Fatalf("Add refused: got %v, want *AckError", err)
	}
	if s.ReadyConnections() != 1 {
		t.Fatalf("an error ack must not drop the connection")
	}

	// Too large: refused before sending, connection untouched.
	huge := Workload{UID: "huge", Info: WorkloadInfo{Name: strings.Repeat("x", 1100)}, Netns: ns1}
	if err := s.Add(ctxTimeout(t, time.Second), huge); !errors.Is(err, ErrMessageTooLarge) {
		t.Fatalf("oversized Add: got %v, want ErrMessageTooLarge", err)
	}
	if err := s.Del(ctxTimeout(t, time.Second), strings.Repeat("u", 1100)); !errors.Is(err, ErrMessageTooLarge) {
		t.Fatalf("oversized Del: got %v, want ErrMessageTooLarge", err)
	}
	p.expectSilence(100 * time.Millisecond)
}

// checkTags parses a WorkloadRequest by hand: exactly one field, number
// outer, holding a message whose field numbers are all in inner.
func checkTags(t *testing.T, b []byte, outer protowire.Number, inner map[protowire.Number]bool) {
	t.Helper()
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || num != outer || typ != protowire.BytesType {
		t.Fatalf("outer field %d (type %d), want %d bytes", num, typ, outer)
	}
	body, m := protowire.ConsumeBytes(b[n:])
	if m < 0 || n+m != len(b) {
		t.Fatalf("request has trailing or broken data")
	}
	for len(body) > 0 {
		num, typ, n := protowire.ConsumeTag(body)
		if n < 0 || !inner[num] {
			t.Fatalf("inner field %d not expected for outer %d", num, outer)
		}
		m := protowire.ConsumeFieldValue(num, typ, body[n:])
		if m < 0 {
			t.Fatalf("broken inner field %d", num)
		}
		body = body[n+m:]
	}
}

func TestHelloRejected(t *testing.T) {
	s := startServer(t, Config{HelloTimeout: 300 * time.Millisecond})
	unversioned, _ := proto.Marshal(&zdspb.ZdsHello{})
	for name, hello := range map[string][]byte{
		"garbage":     {0xff, 0xff, 0xff},
		"unversioned": append(unversioned, 0x08, 0x00), // version NOT_USED spelled out
		"oversized":   make([]byte, 2000),
		"none":        nil,
	} {
		t.Run(name, func(t *testing.T) {
			p := dialPeer(t, s)
			if hello != nil {
				p.send(hello)
			}
			p.expectClosed()
			poll.Until(t, "no connections", func() bool { return s.Connections() == 0 })
		})
	}
}

func TestFutureHelloVersionAccepted(t *testing.T) {
	s := startServer(t, Config{})
	p := dialPeer(t, s)
	b, _ := proto.Marshal(&zdspb.ZdsHello{Version: 2})
	p.send(b)
	if d := p.mustRecv(); d.req.GetSnapshotSent() == nil {
		t.Fatalf("want snapshot after a newer hello, got %v", d.req)
	}
}

// TestMisbehavingPeers: each kind of bad peer, connected as the newest,
// is disconnected while an older healthy connection keeps working.
func TestMisbehavingPeers(t *testing.T) {
	ns := selfNetns(t)
	cases := map[string]func(t *testing.T, s *Server, bad *peer){
		"never acks": func(t *testing.T, s *Server, bad *peer) {
			bad.hello()
			bad.mustRecv() // SnapshotSent, never acked
		},
		"acks twice": func(t *testing.T, s *Server, bad *peer) {
			bad.hello()
			bad.mustRecv()
			bad.ack("")
			bad.ack("")
		},
		"garbage ack": func(t *testing.T, s *Server, bad *peer) {
			bad.hello()
			bad.mustRecv()
			bad.send([]byte{0xde, 0xad, 0xbe, 0xef})
		},
		"ack without payload": func(t *testing.T, s *Server, bad *peer) {
			bad.hello()
			bad.mustRecv()
			b, _ := proto.Marshal(&zdspb.WorkloadResponse{})
			bad.send(append(b, 0x10, 0x01)) // unknown field 2, no ack
		},
		"oversized ack": func(t *testing.T, s *Server, bad *peer) {
			bad.hello()
			bad.mustRecv()
			b, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: strings.Repeat("e", 3000)}}})
			bad.send(b)
		},
		"sends fds": func(t *testing.T, s *Server, bad *peer) {
			bad.hello()
			bad.mustRecv()
			b, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{}}})
			if _, _, err := bad.uc.WriteMsgUnix(b, unix.UnixRights(int(ns.Fd())), nil); err != nil {
				t.Fatal(err)
			}
		},
		"unsolicited while idle": func(t *testing.T, s *Server, bad *peer) {
			bad.handshake()
			poll.Until(t, "bad ready", func() bool { return s.ReadyConnections() == 2 })
			bad.ack("")
		},
		"times out on an Add": func(t *testing.T, s *Server, bad *peer) {
			bad.handshake()
			poll.Until(t, "bad ready", func() bool { return s.ReadyConnections() == 2 })
			errc := make(chan error, 1)
			go func() { errc <- s.Add(ctxTimeout(t, 10*time.Second), Workload{UID: "x", Netns: ns}) }()
			d := bad.mustRecv() // never acked
			d.close()
			// The Add is retried on the healthy connection and succeeds.
			if err := <-errc; err != nil {
				t.Errorf("Add after the newest timed out: %v", err)
			}
		},
	}
	for name, misbehave := range cases {
		t.Run(name, func(t *testing.T) {
			s := startServer(t, Config{AckTimeout: time.Second})
			good := dialPeer(t, s)
			good.handshake()
			waitGood := good.autoAck(nil)
			poll.Until(t, "healthy ready", func() bool { return s.ReadyConnections() == 1 })

			bad := dialPeer(t, s)
			misbehave(t, s, bad)
			bad.expectClosed()
			poll.Until(t, "bad dropped", func() bool { return s.Connections() == 1 })

			if err := s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: "after", Netns: ns}); err != nil {
				t.Fatalf("healthy connection affected: Add: %v", err)
			}
			if err := s.Del(ctxTimeout(t, 5*time.Second), "after"); err != nil {
				t.Fatalf("healthy connection affected: Del: %v", err)
			}
			_ = good.uc.Close()
			waitGood()
		})
	}
}

// TestOneOutstanding: the next request is not sent before the previous
// ack, and a late ack tears the connection down instead of being taken as
// the next request's.
func TestOneOutstanding(t *testing.T) {
	ns := selfNetns(t)
	s := startServer(t, Config{AckTimeout: time.Second})
	p := readyPeer(t, s)

	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, uid := range []string{"one", "two"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.Add(ctxTimeout(t, 1500*time.Millisecond), Workload{UID: uid, Netns: ns})
		}()
		time.Sleep(20 * time.Millisecond) // order the two submissions
	}
	first := p.mustRecv()
	first.close()
	p.expectSilence(200 * time.Millisecond) // second must wait for the first ack
	time.Sleep(time.Second)                 // let the first ack time out
	late, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{}}})
	_, _ = p.uc.Write(late) // may already fail: the server hung up at the timeout
	p.expectClosed()
	wg.Wait()
	for i, err := range errs {
		if err == nil {
			t.Errorf("Add %d succeeded although no ack was matched to it", i)
		}
	}
}

func TestAddWithoutZtunnel(t *testing.T) {
	ns := selfNetns(t)
	s := startServer(t, Config{})
	start := time.Now()
	err := s.Add(ctxTimeout(t, 200*time.Millisecond), Workload{UID: "p", Netns: ns})
	if !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("got %v, want ErrNoZtunnel", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error should also carry the context's: %v", err)
	}
	if time.Since(start) < 200*time.Millisecond {
		t.Errorf("returned before the deadline")
	}

	// A connected peer that has not said hello is not a ztunnel yet.
	silent := dialPeer(t, s)
	poll.Until(t, "accepted", func() bool { return s.Connections() == 1 })
	if err := s.Add(ctxTimeout(t, 100*time.Millisecond), Workload{UID: "p", Netns: ns}); !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("with a silent peer: got %v, want ErrNoZtunnel", err)
	}
	_ = silent.uc.Close()

	// The retry succeeds once a ztunnel connects while Add waits.
	errc := make(chan error, 1)
	go func() { errc <- s.Add(ctxTimeout(t, 10*time.Second), Workload{UID: "p", Netns: ns}) }()
	time.Sleep(50 * time.Millisecond)
	p := dialPeer(t, s)
	p.handshake()
	d := p.mustRecv()
	d.close()
	if d.req.GetAdd().GetUid() != "p" {
		t.Fatalf("want Add p, got %v", d.req)
	}
	p.ack("")
	if err := <-errc; err != nil {
		t.Fatalf("Add once connected: %v", err)
	}
	wait := p.autoAck(nil)
	if err := s.Del(ctxTimeout(t, time.Second), "gone"); err != nil {
		t.Fatal(err)
	}
	_ = p.uc.Close()
	wait()
}

// TestRollingUpgrade: Adds go to the newest ready connection, Dels to all;
// an Add racing a newer connection's snapshot reaches it after the snapshot.
func TestRollingUpgrade(t *testing.T) {
	ns := selfNetns(t)
	s := startServer(t, Config{})
	old := dialPeer(t, s)
	old.handshake()
	poll.Until(t, "old ready", func() bool { return s.ReadyConnections() == 1 })
	newer := dialPeer(t, s)
	newer.handshake()
	poll.Until(t, "new ready", func() bool { return s.ReadyConnections() == 2 })

	errc := make(chan error, 1)
	go func() { errc <- s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: "new-pod", Netns: ns}) }()
	d := newer.mustRecv()
	d.close()
	if d.req.GetAdd().GetUid() != "new-pod" {
		t.Fatalf("newest got %v", d.req)
	}
	newer.ack("")
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	old.expectSilence(100 * time.Millisecond)

	go func() { errc <- s.Del(ctxTimeout(t, 5*time.Second), "new-pod") }()
	for _, p := range []*peer{old, newer} {
		d := p.mustRecv()
		if d.req.GetDel().GetUid() != "new-pod" {
			t.Fatalf("want Del on every connection, got %v", d.req)
		}
		p.ack("")
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}

	// A third connection is mid-snapshot (its SnapshotSent unacked): the
	// Add is awaited on the newest ready one and queued on the third.
	third := dialPeer(t, s)
	third.hello()
	snap := third.mustRecv()
	if snap.req.GetSnapshotSent() == nil {
		t.Fatalf("want SnapshotSent, got %v", snap.req)
	}
	go func() { errc <- s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: "racing", Netns: ns}) }()
	d = newer.mustRecv()
	d.close()
	newer.ack("")
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	third.expectSilence(50 * time.Millisecond) // nothing before its snapshot ack
	third.ack("")
	d = third.mustRecv()
	d.close()
	if d.req.GetAdd().GetUid() != "racing" || len(d.fds) != 1 {
		t.Fatalf("snapshotting connection should get the racing Add after its snapshot, got %v", d.req)
	}
	third.ack("")
}

func TestSnapshotPromptWhileAddsWait(t *testing.T) {
	// A ztunnel that connects while many Adds are blocked on a stuck
	// connection still gets its snapshot at once.
	ns := selfNetns(t)
	s := startServer(t, Config{AckTimeout: 3 * time.Second})
	stuck := dialPeer(t, s)
	stuck.handshake()
	poll.Until(t, "stuck ready", func() bool { return s.ReadyConnections() == 1 })
	for i := range 20 {
		go func() { _ = s.Add(ctxTimeout(t, 2*time.Second), Workload{UID: "p" + string(rune('a'+i)), Netns: ns}) }()
	}
	first := stuck.mustRecv()
	first.close()
	fresh := dialPeer(t, s)
	fresh.hello()
	if d := fresh.mustRecv(); d.req.GetSnapshotSent() == nil {
		t.Fatalf("want snapshot, got %v", d.req)
	}
	fresh.ack("")
}

func TestMaxConnections(t *testing.T) {
	s := startServer(t, Config{MaxConnections: 2})
	a, b := dialPeer(t, s), dialPeer(t, s)
	a.handshake()
	b.handshake()
	poll.Until(t, "two ready", func() bool { return s.ReadyConnections() == 2 })
	c := dialPeer(t, s)
	c.expectClosed()
	if s.Connections() != 2 {
		t.Fatalf("connections = %d, want 2", s.Connections())
	}
}

func TestAcceptRateBounded(t *testing.T) {
	// One connection per 5s after a burst of one: of several quick
	// connects only the first can be accepted right away.
	s := startServer(t, Config{AcceptRate: 0.2, AcceptBurst: 1})
	var ps []*peer
	for range 4 {
		ps = append(ps, dialPeer(t, s)) // sits in the backlog until accepted
	}
	for _, p := range ps {
		p.hello()
	}
	ps[0].mustRecv()
	time.Sleep(100 * time.Millisecond)
	if n := s.Connections(); n > 2 {
		t.Fatalf("accepted %d connections at once, rate allows at most 2", n)
	}
}

func TestListenReplacesStaleSocket(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", "zds.sock")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	_ = ln.Close() // leaves a stale socket file behind
	s := startServer(t, Config{SocketPath: path})
	p := dialPeer(t, s)
	p.handshake()

	// A regular file is not ours to delete.
	reg := filepath.Join(dir, "file")
	if err := os.WriteFile(reg, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := NewServer(Config{SocketPath: reg}).Listen(); err == nil {
		t.Fatalf("Listen replaced a regular file")
	}
	if b, _ := os.ReadFile(reg); string(b) != "keep" {
		t.Fatalf("regular file changed")
	}
}

func TestServeShutdown(t *testing.T) {
	ns := selfNetns(t)
	path := filepath.Join(t.TempDir(), "zds.sock")
	s := NewServer(Config{SocketPath: path})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	poll.Until(t, "listening", func() bool { _, err := os.Stat(path); return err == nil })
	p := readyPeer(t, s)
	addErr := make(chan error, 1)
	go func() { addErr <- s.Add(context.Background(), Workload{UID: "pending", Netns: ns}) }()
	p.mustRecv().close() // in flight when we stop
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	p.expectClosed()
	if err := <-addErr; err == nil {
		t.Fatalf("in-flight Add succeeded after shutdown")
	}
	if err := s.Add(context.Background(), Workload{UID: "late", Netns: ns}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add after shutdown: %v, want ErrClosed", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("socket file left behind: %v", err)
	}
}

func TestShutdownKeepsNewerAgentsSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "zds.sock")
	old := NewServer(Config{SocketPath: path})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- old.Serve(ctx) }()
	poll.Until(t, "listening", func() bool { _, err := os.Stat(path); return err == nil })
	newer := startServer(t, Config{SocketPath: path}) // replaces the file
	cancel()
	<-done
	p := dialPeer(t, newer) // the newer agent's socket must still be there
	p.handshake()
}

func TestNoLeaksAcrossAddDelAndReconnects(t *testing.T) {
	ns := selfNetns(t)
	s := startServer(t, Config{MaxConnections: 64})
	// Warm up once so lazily created runtime state is not counted.
	warm := dialPeer(t, s)
	warm.handshake()
	waitWarm := warm.autoAck(nil)
	if err := s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: "w", Netns: ns}); err != nil {
		t.Fatal(err)
	}
	_ = warm.uc.Close()
	waitWarm()
	poll.Until(t, "warm-up conn gone", func() bool { return s.Connections() == 0 })

	g0, fds0 := goroutines(), testnet.OpenFDs(t)
	p := dialPeer(t, s)
	p.handshake()
	wait := p.autoAck(nil)
	poll.Until(t, "ready", func() bool { return s.ReadyConnections() == 1 })
	for i := range 1000 {
		ctx := ctxTimeout(t, 5*time.Second)
		if err := s.Add(ctx, Workload{UID: "cycle", Info: WorkloadInfo{Name: "p"}, Netns: ns}); err != nil {
			t.Fatalf("cycle %d add: %v", i, err)
		}
		if err := s.Del(ctx, "cycle"); err != nil {
			t.Fatalf("cycle %d del: %v", i, err)
		}
	}
	_ = p.uc.Close()
	wait()
	// ztunnels coming and going, some of them badly.
	for i := range 50 {
		q := dialPeer(t, s)
		switch i % 3 {
		case 0:
			q.handshake()
		case 1:
			q.hello()
			q.send([]byte{0xff})
		}
		_ = q.uc.Close()
	}
	poll.Until(t, "connections gone", func() bool { return s.Connections() == 0 })
	var fds1, g1 int
	poll.Until(t, "fds and goroutines back to where they started", func() bool {
		g1, fds1 = goroutines(), testnet.OpenFDs(t)
		return fds1 <= fds0 && g1 <= g0
	})
	t.Logf("fds %d -> %d, goroutines %d -> %d", fds0, fds1, g0, g1)
}

func TestAddValidates(t *testing.T) {
	s := startServer(t, Config{})
	if err := s.Add(context.Background(), Workload{Netns: selfNetns(t)}); err == nil {
		t.Error("empty uid accepted")
	}
	if err := s.Add(context.Background(), Workload{UID: "x"}); err == nil {
		t.Error("nil netns accepted")
	}
	closed, _ := os.Open("/proc/self/ns/net")
	_ = closed.Close()
	readyPeer(t, s)
	if err := s.Add(ctxTimeout(t, time.Second), Workload{UID: "x", Netns: closed}); err == nil {
		t.Error("closed netns file accepted")
	}
	if err := s.Del(context.Background(), ""); err == nil {
		t.Error("empty uid Del accepted")
	}
}

func TestSnapshotSkipsClosedNetns(t *testing.T) {
	closed, _ := os.Open("/proc/self/ns/net")
	_ = closed.Close()
	s := startServer(t, Config{Snapshot: func() []Workload {
		return []Workload{{UID: "gone", Netns: closed}, {UID: ""}}
	}})
	p := dialPeer(t, s)
	p.hello()
	if d := p.mustRecv(); d.req.GetSnapshotSent() == nil {
		t.Fatalf("closed netns and empty uid should be left out, got %v", d.req)
	}
}

// BenchmarkAddDel measures one Add (with its netns fd) plus one Del
// round trip against an in-process peer that acks at once.
func BenchmarkAddDel(b *testing.B) {
	ns := selfNetns(b)
	s := startServer(b, Config{})
	p := dialPeer(b, s)
	p.handshake()
	wait := p.autoAck(nil)
	poll.Until(b, "ready", func() bool { return s.ReadyConnections() == 1 })
	ctx := context.Background()
	w := Workload{UID: "bench", Info: WorkloadInfo{Name: "p", Namespace: "n", ServiceAccount: "sa"}, Netns: ns}
	b.ResetTimer()
	for b.Loop() {
		if err := s.Add(ctx, w); err != nil {
			b.Fatal(err)
		}
		if err := s.Del(ctx, w.UID); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	_ = p.uc.Close()
	wait()
}

// Drain returns once every Del queued without waiting was acked, and is
// bounded by its context when ztunnel does not answer.
func TestDrain(t *testing.T) {
	s := startServer(t, Config{AckTimeout: 5 * time.Second})
	p := readyPeer(t, s)
	for _, uid := range []string{"one", "two"} {
		if err := s.DelNoWait(uid); err != nil {
			t.Fatal(err)
		}
	}
	// Not answered yet: Drain waits, and gives up with its context.
	first := p.mustRecv()
	if err := s.Drain(ctxTimeout(t, 100*time.Millisecond)); err == nil {
		t.Fatal("Drain returned with a Del still unacked")
	}
	first.close()
	p.ack("")
	second := p.mustRecv()
	second.close()
	if got := second.req.GetDel().GetUid(); got != "two" {
		t.Fatalf("second request %v, want the Del of two", second.req)
	}
	p.ack("")
	if err := s.Drain(ctxTimeout(t, 5*time.Second)); err != nil {
		t.Fatalf("Drain after both acks: %v", err)
	}
	p.expectSilence(100 * time.Millisecond) // the barrier sends nothing
}

// TestSocketPathRequired: no default socket, which would be the real
// node's ztunnel socket.
func TestSocketPathRequired(t *testing.T) {
	if err := NewServer(Config{}).Listen(); err == nil {
		t.Error("a ZDS server with no socket path listened")
	}
}

// TestDelSentAfterCallerGaveUp: a Del queued behind an Add whose ack is
// slow outlives its caller's wait: the caller hears of its deadline, and
// the Del still reaches ztunnel once the Add is acked, on the same
// connection. Dropped, the pod would stay served by a ztunnel whose
// connection lives on (no snapshot to drop it).
func TestDelSentAfterCallerGaveUp(t *testing.T) {
	ns := selfNetns(t)
	s := startServer(t, Config{AckTimeout: 5 * time.Second})
	p := readyPeer(t, s)

	added := make(chan error, 1)
	go func() { added <- s.Add(ctxTimeout(t, 5*time.Second), Workload{UID: "slow", Netns: ns}) }()
	add := p.mustRecv()
	add.close()
	if err := s.Del(ctxTimeout(t, 100*time.Millisecond), "gone"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Del behind an unacked Add = %v, want its deadline", err)
	}
	p.ack("")
	if err := <-added; err != nil {
		t.Fatalf("Add: %v", err)
	}
	del := p.mustRecv()
	del.close()
	if got := del.req.GetDel().GetUid(); got != "gone" {
		t.Fatalf("request after the Add's ack: %v, want the Del of gone", del.req)
	}
	p.ack("")
	if s.ReadyConnections() != 1 {
		t.Fatal("the connection did not live on")
	}
}
