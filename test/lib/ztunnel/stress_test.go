package ztunnel

import (
	"context"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"

	"github.com/ambient-cni/ambient-cni/pkg/zds"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestMisbehavingStandInsDoNotHurtHealthyOne: a stand-in that never acks,
// acks twice or answers garbage connects as the newest ztunnel; the agent
// keeps disconnecting it while enrollments keep succeeding through the
// healthy one, whose connection is never dropped.
func TestMisbehavingStandInsDoNotHurtHealthyOne(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-restore", "ip6tables-restore")
	pods := newBridge(t, "a", "b")
	a, b := pods["a"], pods["b"]
	a.capture(t)
	b.capture(t)
	ag := startAgent(t, time.Second)
	good := runStandIn(t, Config{SocketPath: ag.srv.SocketPath()})
	waitFor(t, good, "healthy ready", good.Ready)
	ag.enroll(t, a)

	for name, f := range map[string]Faults{
		"never acks": {NeverAck: true},
		"acks twice": {AckTwice: true},
		"garbage":    {Garbage: true},
	} {
		t.Run(name, func(t *testing.T) {
			bad, stop := runStandInStoppable(t, Config{SocketPath: ag.srv.SocketPath()}, f)
			waitFor(t, bad, "the bad stand-in to be disconnected twice", func() bool { return bad.Connections() >= 3 })
			ag.enroll(t, b)
			a.mustGet(t, netip.AddrPortFrom(b.v4, 8080), "b")
			ag.forget(t, b, true)
			stop()
			poll.Until(t, "only the healthy connection left", func() bool { return ag.srv.Connections() == 1 })
		})
	}
	if n := good.Connections(); n != 1 {
		t.Fatalf("healthy stand-in was disconnected: %d connections", n)
	}
	if _, ok := good.Workload(b.uid); ok {
		t.Fatalf("healthy stand-in missed a Del")
	}
}

// TestNoLeaksWithStandIn: 1,000 Add/Del cycles of a real pod through the
// stand-in (listeners opened and closed in the pod netns each time), then
// ztunnel restarts, leave this process's open fds and goroutines (agent
// server and stand-in together) where they started.
func TestNoLeaksWithStandIn(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	ag := startAgent(t, 5*time.Second)
	nsf, err := os.Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer nsf.Close()
	w := zds.Workload{UID: "leak", Info: zds.WorkloadInfo{Name: "p", Namespace: "n"}, Netns: nsf}
	cycle := func() {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := ag.srv.Add(ctx, w); err != nil {
			t.Fatalf("add: %v", err)
		}
		if err := ag.srv.Del(ctx, w.UID); err != nil {
			t.Fatalf("del: %v", err)
		}
	}

	z, stop := runStandInStoppable(t, Config{SocketPath: ag.srv.SocketPath()}, Faults{})
	waitFor(t, z, "ready", z.Ready)
	cycle() // warm-up: lazily created runtime state is not a leak
	g0, fds0 := countGoroutines(), testnet.OpenFDs(t)
	for range 1000 {
		cycle()
	}
	if n := len(z.Workloads()); n != 0 {
		t.Fatalf("stand-in still serves %d workloads", n)
	}
	var fds1, g1 int
	poll.Until(t, "fds and goroutines back after 1000 cycles", func() bool {
		g1, fds1 = countGoroutines(), testnet.OpenFDs(t)
		return fds1 <= fds0 && g1 <= g0
	})
	t.Logf("1000 add/del cycles: fds %d -> %d, goroutines %d -> %d", fds0, fds1, g0, g1)

	// ztunnels come and go: the stand-in stopped and started 20 times.
	stop()
	poll.Until(t, "no connections", func() bool { return ag.srv.Connections() == 0 })
	g0, fds0 = countGoroutines(), testnet.OpenFDs(t)
	for range 20 {
		z, stop := runStandInStoppable(t, Config{SocketPath: ag.srv.SocketPath()}, Faults{})
		waitFor(t, z, "ready", z.Ready)
		cycle()
		stop()
	}
	poll.Until(t, "fds and goroutines back after restarts", func() bool {
		g1, fds1 = countGoroutines(), testnet.OpenFDs(t)
		return ag.srv.Connections() == 0 && fds1 <= fds0 && g1 <= g0
	})
	t.Logf("20 ztunnel restarts: fds %d -> %d, goroutines %d -> %d", fds0, fds1, g0, g1)
}

// countGoroutines first lets the GC and finalizers run, so files that
// only a finalizer closes (other packages' exec pipes) do not blur the fd
// count taken right after it.
func countGoroutines() int {
	runtime.GC()
	time.Sleep(20 * time.Millisecond) // finalizers run on their own goroutine
	runtime.GC()
	return runtime.NumGoroutine()
}
