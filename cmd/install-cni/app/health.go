package app

import (
	"context"
	"errors"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/health"
)

// The watchdog: every watchdogPeriod the agent asks its own event server
// for STATUS through the plugin's socket (each bounded by
// health.LiveTimeout); after watchdogFailures failures in a row Run ends
// with an error and install-cni exits non-zero, so kubelet restarts it.
// A hung event server costs pods about half a minute, never more.
const (
	watchdogPeriod   = 10 * time.Second
	watchdogFailures = 3
)

// checkHealth builds start-up liveness and adds the agent's checks to its
// health server: liveness, readiness (the agent's pod) and capture
// readiness (the startup taint).
func (a *App) checkHealth() {
	// Alive is making progress: until the event server listens, no
	// start-up step may overrun its bound while what it waits on answers
	// (startupStepBound); then the event server must answer the plugin's
	// cheapest request through its socket.
	bound := a.opts.StartupStepBound
	if bound <= 0 {
		bound = startupStepBound
	}
	a.startup = health.NewStartup(bound, nil, a.log.With("component", "startup"))
	a.health.AddLiveCheck("startup", a.startup.Check)
	a.health.AddLiveCheck("event-server", func(ctx context.Context) error {
		if !a.server.Listening() {
			return nil
		}
		return a.server.Answering(ctx)
	})
	// Standing by while istio-cni holds the node (standby.go), the agent
	// is ready: started, its options accepted, doing what it should; a
	// rollout of the chart goes on, and helm --wait proves every node got
	// this far before istio-cni leaves any.
	standing := func(check func() error) func() error {
		return func() error {
			if a.standby.Load() {
				return nil
			}
			return check()
		}
	}
	a.health.AddCheck("installer", standing(a.installer.Check))
	// No readiness check for the plugin's credential: the plugin is
	// chained without one (unchained, pods that must be captured would
	// start uncaptured while the agent is up), and an unready agent would
	// hold a rollout and the node's startup taint for a credential only
	// needed while the agent is away. Its metrics and alerts tell.
	a.health.AddCheck("restore", standing(func() error {
		if !closed(a.ctrl.Restored()) {
			return errors.New("startup reconcile not done")
		}
		return nil
	}))
	a.health.AddCheck("sockets", standing(func() error {
		if !a.server.Listening() || !a.zds.Listening() {
			return errors.New("event and ZDS servers not listening yet")
		}
		return nil
	}))
	// Pods can be captured only once a ztunnel has the node's pods; the
	// agent's own pod is ready before (ztunnel may come later).
	a.health.AddCaptureCheck("ztunnel", func() error {
		if a.zds.ReadyConnections() == 0 {
			return errors.New("no ztunnel has acknowledged its snapshot yet")
		}
		return nil
	})
}

// watchdog gives up on an event server that stopped answering (see
// watchdogPeriod): its error ends Run, and Hung is closed.
func (a *App) watchdog(ctx context.Context) error {
	period := a.opts.WatchdogPeriod
	if period <= 0 {
		period = watchdogPeriod
	}
	err := health.Watchdog{
		Name: "the plugin event server", Check: a.server.Answering,
		Period: period, Timeout: health.LiveTimeout, Failures: watchdogFailures,
		Failed: func(err error, inARow int) {
			a.log.Warn("the plugin event server did not answer the watchdog", "in_a_row", inARow, "exit_at", watchdogFailures, "err", err)
		},
	}.Run(ctx)
	if err != nil {
		a.hungOnce.Do(func() { close(a.hung) })
	}
	return err
}

// Hung is closed when the watchdog gave up on the event server; Run then
// shuts down and returns its error.
func (a *App) Hung() <-chan struct{} { return a.hung }
