package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// TestZDSSocketBoundBeforeRestore: a restarting agent binds the ZDS socket
// at the start of its start-up, so a ztunnel that connects meanwhile (after
// a reboot both start together) is queued instead of finding no socket and
// backing off (ztunnel waits up to 15 s between tries, and every ADD fails
// "no ztunnel connection" until it is back). The gate stays: that ztunnel
// gets no snapshot until the pods captured before are restored, then one
// with them, on the connection it made. The ztunnel here never tries twice
// within the test, so only a socket bound while the restore is held lets
// it in.
func TestZDSSocketBoundBeforeRestore(t *testing.T) {
	h := &hangingVerify{release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(h.release) }) }
	n := newNode(t, nodeOptions{Upgrade: true, AgentHook: func(c *nodeagent.Config) { h.Applier = c.Rules; c.Rules = h }})
	t.Cleanup(release) // before the daemon stops
	p := n.runPod(podSpec(n.namespace("shop", ambientLabel), "p", nil, nil))
	n.waitEnrolled(waitLong, p)

	n.stopDaemon()
	h.hung.Store(true)
	n.opts.NoWaitReady = true
	n.startDaemon()
	poll.Within(t, waitLong, "the restore held", func() bool { return h.held.Load() > 0 })

	z := ztunnel.New(ztunnel.Config{SocketPath: n.cfg.ZDSSocket, MinBackoff: time.Hour, MaxBackoff: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = z.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	poll.Within(t, waitLong, "a ztunnel connected while the restore is held", func() bool { return z.Connections() == 1 })
	if z.Ready() {
		t.Fatal("ztunnel got a snapshot before the pods captured before were restored")
	}
	if _, ok := z.Workload(string(p.Obj.UID)); ok {
		t.Fatal("ztunnel was given a pod before the restore")
	}

	release()
	poll.Within(t, waitLong, "the snapshot, with the restored pod", func() bool {
		_, ok := z.Workload(string(p.Obj.UID))
		return z.Ready() && ok
	})
	if c := z.Connections(); c != 1 {
		t.Errorf("ztunnel connected %d times; want the one connection made during the restore served", c)
	}
}
