package app

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
)

// One agent serves ztunnel on a node. Another one found listening on
// ztunnel's socket at the start (istio-cni's, in any of its modes: chained,
// a standalone Multus network as on OpenShift, or still leaving; or a
// second ambient-cni) keeps this one from binding over it: ztunnel would
// reconnect here, and two agents would both redirect the node's pods. The
// agent waits, not ready, saying why, and takes the socket once the other
// has stopped listening. It chains nothing meanwhile (its installer
// starts after): on a node where its plugin is not chained yet, the pods
// start as the other agent has them start. The look is the kernel's list of listening sockets, not
// a dial: istio-cni's server takes each connection it accepts for
// ztunnel's newest.

// zdsFreeStep is the start step that waits for ztunnel's socket.
const zdsFreeStep = "ztunnel's socket free"

// zdsFreePoll is how often a waiting agent looks again.
const zdsFreePoll = 500 * time.Millisecond

// zdsTaken reports whether another process listens on ztunnel's socket.
// A look that fails (a kernel without Unix socket diagnostics) says no,
// so the agent binds as before, and says so.
func (a *App) zdsTaken() bool {
	taken, err := unixsock.Listened(a.cfg.ZDSSocket)
	if err != nil {
		a.log.Warn("cannot tell whether another agent serves ztunnel's socket; binding it", "path", a.cfg.ZDSSocket, "err", err)
		return false
	}
	return taken
}

// awaitZDSFree, with the socket deferred, waits until nothing listens on
// it, then binds it and installs the host probe SNAT. Meanwhile the agent
// is live (its probes answered) and not ready; it says why once, in its
// log and as a Warning Event on its pod.
func (a *App) awaitZDSFree(ctx context.Context) error {
	if !a.zdsDeferred {
		return nil
	}
	why := fmt.Sprintf("another process listens on ztunnel's socket %s (istio-cni's node agent, or a second ambient-cni): two agents would both redirect this node's pods; waiting for it to stop before serving ztunnel and chaining the plugin", a.cfg.ZDSSocket)
	a.log.Warn("not starting: ztunnel's socket is served", "path", a.cfg.ZDSSocket, "why", why)
	a.events.Eventf(a.selfRef(), corev1.EventTypeWarning, "ZtunnelSocketTaken", "%s", why)
	for {
		select {
		case <-ctx.Done():
			return errStopRequested
		case <-time.After(zdsFreePoll):
		}
		if taken, err := unixsock.Listened(a.cfg.ZDSSocket); err != nil || taken {
			continue
		}
		a.log.Info("ztunnel's socket is no longer served: serving it", "path", a.cfg.ZDSSocket)
		if err := a.zds.Listen(); err != nil {
			return fmt.Errorf("zds: %w", err)
		}
		a.zdsDeferred = false
		return a.agent.EnsureHostProbe()
	}
}
