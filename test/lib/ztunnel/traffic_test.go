package ztunnel

import (
	"context"
	"io"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"

	"github.com/google/go-cmp/cmp"

	"github.com/ambient-cni/ambient-cni/pkg/zds"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func waitFor(t *testing.T, z *StandIn, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := z.Wait(ctx, cond); err != nil {
		t.Fatalf("timed out waiting for %s", what)
	}
}

func hasRecord(z *StandIn, match func(Record) bool) bool {
	return slices.ContainsFunc(z.Records(), match)
}

// TestTrafficThroughStandIn: real pods on a bridge with the project's
// in-pod rules; traffic between enrolled pods is tunneled A:15001 ->
// B:15008, an unenrolled client lands on B:15006, and everything keeps
// working across a stand-in restart, a snapshot that drops a pod, and a
// rolling upgrade with two stand-ins.
func TestTrafficThroughStandIn(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-restore", "ip6tables-restore")
	pods := newBridge(t, "a", "b", "c", "d")
	a, b, c, d := pods["a"], pods["b"], pods["c"], pods["d"]
	for _, p := range []*tpod{a, b, d} {
		p.capture(t)
	}
	ag := startAgent(t, 5*time.Second)
	z1, stop1 := runStandInStoppable(t, Config{SocketPath: ag.srv.SocketPath()})
	waitFor(t, z1, "first snapshot", z1.Ready)
	ag.enroll(t, a)
	ag.enroll(t, b)

	b8080 := netip.AddrPortFrom(b.v4, 8080)
	a.mustGet(t, b8080, "b")
	if !hasRecord(z1, func(r Record) bool {
		return r.UID == a.uid && r.Port == 15001 && r.OrigDst == b8080 && r.Tunneled && r.Upstream == netip.AddrPortFrom(b.v4, 15008)
	}) {
		t.Fatalf("no record of A's 15001 tunneling to B: %+v", z1.Records())
	}
	if !hasRecord(z1, func(r Record) bool {
		return r.UID == b.uid && r.Port == 15008 && r.OrigDst == b8080 && r.Source.Addr() == a.v4
	}) {
		t.Fatalf("no record of B's 15008 from A: %+v", z1.Records())
	}

	c.mustGet(t, b8080, "b")
	if !hasRecord(z1, func(r Record) bool {
		return r.UID == b.uid && r.Port == 15006 && r.OrigDst == b8080 && r.Source.Addr() == c.v4
	}) {
		t.Fatalf("no record of B's 15006 from unenrolled C: %+v", z1.Records())
	}

	c8080 := netip.AddrPortFrom(c.v4, 8080)
	a.mustGet(t, c8080, "c")
	if !hasRecord(z1, func(r Record) bool {
		return r.UID == a.uid && r.Port == 15001 && r.OrigDst == c8080 && !r.Tunneled && r.Upstream == c8080
	}) {
		t.Fatalf("no record of A's 15001 going directly to unenrolled C: %+v", z1.Records())
	}

	b6 := netip.AddrPortFrom(b.v6, 8080)
	a.mustGet(t, b6, "b")
	if !hasRecord(z1, func(r Record) bool {
		return r.UID == b.uid && r.Port == 15008 && r.OrigDst == b6 && r.Source.Addr() == a.v6
	}) {
		t.Fatalf("no IPv6 tunnel record: %+v", z1.Records())
	}

	t.Run("restart gets a snapshot", func(t *testing.T) {
		stop1()
		if _, err := a.get(context.Background(), b8080); err == nil {
			t.Fatalf("traffic flowed with no ztunnel listening")
		}
		z2 := runStandIn(t, Config{SocketPath: ag.srv.SocketPath()})
		waitFor(t, z2, "snapshot after restart", z2.Ready)
		msgs := z2.Messages()
		if len(msgs) != 3 || msgs[2].Kind != KindSnapshotSent {
			t.Fatalf("want Add, Add, SnapshotSent; got %+v", msgs)
		}
		want := map[string]NetnsID{a.uid: netnsOf(t, a), b.uid: netnsOf(t, b)}
		for _, m := range msgs[:2] {
			if diff := cmp.Diff(Message{Kind: KindAdd, FDs: 1, Netns: want[m.UID]}, Message{Kind: m.Kind, FDs: m.FDs, AckError: m.AckError, Netns: m.Netns}); diff != "" {
				t.Errorf("snapshot message %+v, want an acked Add with the pod's netns", m)
			}
			delete(want, m.UID)
		}
		a.mustGet(t, b8080, "b")
		c.mustGet(t, b8080, "b")

		t.Run("keep preserves a pod whose netns the agent lost", func(t *testing.T) {
			ag.lose(b)
			before := z2.Connections()
			z2.Disconnect()
			waitFor(t, z2, "next snapshot", func() bool { return z2.Connections() > before && z2.Ready() })
			var kinds []string
			for _, m := range z2.Messages() {
				if m.Conn == z2.Connections() {
					kinds = append(kinds, m.Kind+":"+m.UID)
				}
			}
			if !slices.Contains(kinds, KindKeep+":"+b.uid) || !slices.Contains(kinds, KindAdd+":"+a.uid) {
				t.Fatalf("snapshot %v, want Add for A and Keep for B", kinds)
			}
			if w, ok := z2.Workload(b.uid); !ok || w.Netns != netnsOf(t, b) {
				t.Fatalf("Keep did not preserve B")
			}
			c.mustGet(t, b8080, "b")
			ag.enroll(t, b)
		})

		t.Run("snapshot drops what the agent no longer has", func(t *testing.T) {
			ag.forget(t, b, false)
			z2.Disconnect()
			waitFor(t, z2, "B dropped", func() bool { _, ok := z2.Workload(b.uid); return !ok && z2.Ready() })
			if _, ok := z2.Workload(a.uid); !ok {
				t.Fatalf("A dropped too")
			}
			if _, err := c.get(context.Background(), b8080); err == nil {
				t.Fatalf("B still served after the snapshot dropped it")
			}
			ag.enroll(t, b)
			c.mustGet(t, b8080, "b")
		})

		t.Run("rolling upgrade", func(t *testing.T) {
			z3 := runStandIn(t, Config{SocketPath: ag.srv.SocketPath()})
			waitFor(t, z3, "second stand-in ready", z3.Ready)
			// The stand-in is ready before its ack reaches the agent.
			poll.Until(t, "two ready connections", func() bool { return ag.srv.ReadyConnections() == 2 })
			before := len(z2.Messages())
			ag.enroll(t, d)
			if _, ok := z3.Workload(d.uid); !ok {
				t.Fatalf("newest stand-in did not get the new pod")
			}
			if _, ok := z2.Workload(d.uid); ok {
				t.Fatalf("older stand-in got the new pod")
			}
			d8080 := netip.AddrPortFrom(d.v4, 8080)
			c.mustGet(t, d8080, "d")
			if !hasRecord(z3, func(r Record) bool { return r.UID == d.uid && r.Port == 15006 }) {
				t.Fatalf("new pod's traffic not through the newest stand-in")
			}
			// Both hold A and B (SO_REUSEPORT): traffic still works.
			a.mustGet(t, b8080, "b")

			ag.forget(t, a, true)
			waitFor(t, z2, "Del on the old stand-in", func() bool { _, ok := z2.Workload(a.uid); return !ok })
			waitFor(t, z3, "Del on the new stand-in", func() bool { _, ok := z3.Workload(a.uid); return !ok })
			for _, m := range z2.Messages()[before:] {
				if m.Kind == KindAdd {
					t.Errorf("older stand-in got %+v after the newer connected", m)
				}
			}
		})
	})
}

// runStandInStoppable runs a stand-in (misbehaving as faults say) that
// the test can stop early.
func runStandInStoppable(t *testing.T, cfg Config, faults ...Faults) (*StandIn, func()) {
	t.Helper()
	cfg.MinBackoff, cfg.MaxBackoff = 20*time.Millisecond, 200*time.Millisecond
	z := New(cfg)
	for _, f := range faults {
		z.SetFaults(f)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- z.Run(ctx) }()
	var stopped bool
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("stand-in: %v", err)
		}
	}
	t.Cleanup(stop)
	return z, stop
}

// TestAgentRestartKeepsConnections: the agent stops and a new one starts
// on the same socket with the same pods; the stand-in reconnects, takes
// the snapshot's Adds for the same netns as no-ops, and a TCP connection
// opened through it before the restart still carries data.
func TestAgentRestartKeepsConnections(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-restore", "ip6tables-restore")
	pods := newBridge(t, "a", "b")
	a, b := pods["a"], pods["b"]
	a.capture(t)
	b.capture(t)
	echo := b.serveEcho(t, 9090)

	path := t.TempDir() + "/zds.sock"
	ag1, stop1 := startAgentAt(t, path, 5*time.Second)
	z := runStandIn(t, Config{SocketPath: path})
	waitFor(t, z, "ready", z.Ready)
	ag1.enroll(t, a)
	ag1.enroll(t, b)
	before := z.Workloads()

	conn := a.dial(t, netip.AddrPortFrom(b.v4, echo))
	roundTrip := func(msg string) {
		t.Helper()
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := conn.Write([]byte(msg)); err != nil {
			t.Fatalf("write %q: %v", msg, err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != msg {
			t.Fatalf("echo of %q: %q, %v", msg, buf, err)
		}
	}
	roundTrip("before restart")
	if !hasRecord(z, func(r Record) bool {
		return r.UID == a.uid && r.Port == 15001 && r.OrigDst == netip.AddrPortFrom(b.v4, echo)
	}) {
		t.Fatalf("echo connection did not go through the stand-in: %+v", z.Records())
	}

	stop1()
	ag2, _ := startAgentAt(t, path, 5*time.Second)
	ag2.mu.Lock()
	for _, p := range []*tpod{a, b} {
		f, err := os.Open(p.ns.Path())
		if err != nil {
			t.Fatal(err)
		}
		ag2.wl[p.uid] = zds.Workload{UID: p.uid, Info: zds.WorkloadInfo{Name: p.name, Namespace: "test"}, Netns: f}
	}
	ag2.mu.Unlock()
	waitFor(t, z, "snapshot from the new agent", func() bool { return z.Connections() >= 2 && z.Ready() })
	poll.Until(t, "agent sees the ready stand-in", func() bool { return ag2.srv.ReadyConnections() == 1 })

	roundTrip("after restart")
	if after := z.Workloads(); !slices.EqualFunc(before, after, func(x, y Workload) bool {
		return x.UID == y.UID && x.Netns == y.Netns && slices.Equal(x.Ports, y.Ports)
	}) {
		t.Fatalf("workloads changed across the agent restart: %+v -> %+v", before, after)
	}
	_ = conn.Close()
}

// TestTunnelToAnotherStandIn: two stand-ins, each serving one pod, as
// ztunnels on two nodes. Without knowing the other's pod, A's stand-in
// sends A's connection to B directly and it lands on B's 15006 in B's
// stand-in; once told B is in the mesh (SetRemote), it tunnels it: an
// HTTP/2 CONNECT to B's 15008, served by B's stand-in, which delivers it
// to B's port inside B.
func TestTunnelToAnotherStandIn(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-restore", "ip6tables-restore")
	pods := newBridge(t, "a", "b")
	a, b := pods["a"], pods["b"]
	a.capture(t)
	b.capture(t)
	agA, agB := startAgent(t, 5*time.Second), startAgent(t, 5*time.Second)
	zA := runStandIn(t, Config{SocketPath: agA.srv.SocketPath()})
	zB := runStandIn(t, Config{SocketPath: agB.srv.SocketPath()})
	waitFor(t, zA, "A's snapshot", zA.Ready)
	waitFor(t, zB, "B's snapshot", zB.Ready)
	agA.enroll(t, a)
	agB.enroll(t, b)

	b8080 := netip.AddrPortFrom(b.v4, 8080)
	a.mustGet(t, b8080, "b")
	waitFor(t, zB, "B's 15006 from A", func() bool {
		return hasRecord(zB, func(r Record) bool {
			return r.UID == b.uid && r.Port == 15006 && r.OrigDst == b8080 && r.Source.Addr() == a.v4
		})
	})
	if !hasRecord(zA, func(r Record) bool {
		return r.UID == a.uid && r.Port == 15001 && r.OrigDst == b8080 && !r.Tunneled
	}) {
		t.Fatalf("A's stand-in did not send A → B directly: %+v", zA.Records())
	}

	zA.SetRemote([]netip.Addr{b.v4})
	a.mustGet(t, b8080, "b")
	waitFor(t, zB, "B's 15008 from A", func() bool {
		return hasRecord(zB, func(r Record) bool {
			return r.UID == b.uid && r.Port == 15008 && r.OrigDst == b8080 && r.Source.Addr() == a.v4 && r.Err == ""
		})
	})
	if !hasRecord(zA, func(r Record) bool {
		return r.UID == a.uid && r.Port == 15001 && r.OrigDst == b8080 && r.Tunneled && r.Upstream == netip.AddrPortFrom(b.v4, 15008)
	}) {
		t.Fatalf("A's stand-in did not tunnel A → B: %+v", zA.Records())
	}
}
