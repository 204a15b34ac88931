package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/nodedirs"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// Run starts the agent (startSteps), serves until ctx ends or a component
// fails, then stops (stop, by upgradeSteps or uninstallSteps): servers
// stop, the held netns handles are released (rules stay in the pods), and
// unless this is an upgrade the node goes back to plain networking. Last,
// once every goroutine using them has stopped, the unwind of the start
// runs and the rules backend's connections are closed.
func (a *App) Run(ctx context.Context) (err error) {
	defer func() {
		if cerr := a.rules.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close rules backend: %w", cerr))
		}
	}()
	cs := newComponents(ctx, a.zds, a.log)
	defer cs.release()
	unwind, err := runSteps(ctx, a.withStandby(cs, a.startSteps(cs)), a.beginStep)
	defer unwind()
	switch {
	case errors.Is(err, errStopRequested):
		return a.stop(cs, nil, false)
	case err != nil:
		return err
	}
	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-cs.errs:
		a.log.Error("component failed; shutting down", "err", runErr)
	}
	return a.stop(cs, runErr, true)
}

// startSteps is the start, in order (docs/how-it-works.md "The agent's
// start" lists the same names): node directories and files first, the
// components next, then the steps start-up liveness follows (live), and
// last the plugin's socket and what serves on both. The ZDS socket is
// bound first, but served only after the restore: ztunnel must not get a
// snapshot before the pods enrolled by a previous agent are back in the
// state, or it would drop them all.
func (a *App) startSteps(cs *components) []step {
	c, l := a.cfg, a.layout
	// waitFor ends its step when done is closed; a component's failure
	// fails it, and a stop asked meanwhile ends the start-up.
	waitFor := func(done func() <-chan struct{}) func(context.Context) error {
		return func(ctx context.Context) error {
			select {
			case <-done():
				return nil
			case err := <-cs.errs:
				return err
			case <-ctx.Done():
				return errStopRequested
			}
		}
	}
	return []step{
		{name: "node directories", do: func(context.Context) error {
			// Private directories for the sockets and the node files,
			// noted as found so an uninstall leaves them as they were.
			return nodedirs.Ensure(l.NodeDirsLedger(), l.Dir(), filepath.Dir(c.ZDSSocket))
		}},
		{name: "ZDS socket", undo: cs.stopZtunnel, do: func(context.Context) error {
			// Bound at once, so that a ztunnel that connects meanwhile (after
			// a reboot both start together) waits in the socket's queue
			// rather than backing off (up to 15 s, every ADD failing "no
			// ztunnel connection" until it is back). It gets nothing until
			// "serve", after the restore. Unless another agent serves
			// ztunnel on this node: then "ztunnel's socket free" waits.
			if a.zdsDeferred = a.zdsTaken(); a.zdsDeferred {
				return nil
			}
			if err := a.zds.Listen(); err != nil {
				return fmt.Errorf("zds: %w", err)
			}
			return nil
		}},
		{name: "host probe SNAT", do: func(context.Context) error {
			if a.zdsDeferred {
				return nil // after "ztunnel's socket free", with the socket
			}
			return a.agent.EnsureHostProbe()
		}},
		{name: "plugin files", do: func(ctx context.Context) error {
			// What the plugin decides by while the agent cannot answer, in
			// place before the installer chains it.
			a.writePluginFiles(ctx)
			return nil
		}},
		{name: "capture records", do: func(context.Context) error {
			// What a previous agent recorded it captured; restored with
			// the annotated pods once the pod cache is synced.
			if err := a.agent.LoadRecords(); err != nil {
				a.log.Warn("capture records", "err", err)
			}
			return nil
		}},
		{name: "event recorder", do: func(context.Context) error { a.events.Start(); return nil }, undo: a.events.Shutdown},
		// The first step that starts components: its undo stops them
		// all (they stop together).
		{name: "health and metrics servers", do: func(context.Context) error { return a.serveHealth(cs) }, undo: cs.stop},
		{name: "debug socket", do: func(context.Context) error { return a.serveDebug(cs) }},
		{name: zdsFreeStep, do: a.awaitZDSFree},
		{name: "marker of an uninstall cut short", do: func(context.Context) error {
			// That marker makes the plugin let every pod through while no
			// agent answers; this agent chains the plugin again, so the
			// mesh is back on the node: the marker goes first.
			had, err := nodefiles.ClearUninstalling(l)
			if had {
				a.log.Info("removed the marker of an uninstall cut short; the plugin is chained again", "marker", l.Uninstalling())
			}
			return err
		}},
		{name: "installer and watches", do: func(context.Context) error {
			cs.run("installer", a.installer.Run)
			if a.cred != nil {
				cs.run("plugin-credential", a.cred.Run)
			}
			cs.run("snapshot-refresh", a.refreshSnapshot)
			cs.run("release-signal-watch", a.upgrade.Run)
			return nil
		}},
		{name: "pod cache sync", live: true, waitsOn: a.apiServer(), do: func(ctx context.Context) error {
			cs.run("pod-cache", a.pods.Run)
			cs.run("annotations", a.agent.Run)
			cs.run("controller", a.ctrl.Run)
			cs.run("metrics", func(ctx context.Context) error {
				return a.metrics.RunGauges(ctx, a.agent.StateCounts, a.zds.Connections, a.installer.Ready, a.agent.TableSizes)
			})
			cs.run("host-probe", func(ctx context.Context) error {
				rulesbackend.KeepHostProbe(ctx, a.rules.Probe, hostProbeResync, a.log)
				return nil
			})
			return waitFor(a.ctrl.Synced)(ctx)
		}},
		{name: "restore of the pods captured before", live: true, do: waitFor(a.ctrl.Restored)},
		{name: "enablement snapshot", live: true, do: func(context.Context) error {
			if err := a.agent.RefreshSnapshot(); err != nil {
				a.log.Error("enablement snapshot", "err", err)
			}
			return nil
		}},
		{name: "DEL spool drain", live: true, do: func(context.Context) error {
			if _, err := a.agent.DrainSpool(cs.ctx); err != nil {
				a.log.Warn("drain DEL spool", "err", err)
			}
			return nil
		}},
		{name: "host probe set sync", live: true, do: func(context.Context) error {
			if err := a.agent.SyncHostProbe(); err != nil {
				a.log.Warn("sync host probe set", "err", err)
			}
			return nil
		}},
		{name: "listen", live: true, do: func(context.Context) error {
			if err := a.server.Listen(); err != nil {
				return fmt.Errorf("event server: %w", err)
			}
			return nil
		}},
		{name: "serve", do: func(context.Context) error {
			a.startup.Done()
			cs.runZDS(a.zds.Serve)
			cs.run("event-server", a.server.Serve)
			cs.run("watchdog", a.watchdog)
			cs.run("first-ztunnel", a.timeFirstZtunnel)
			cs.run("spool", a.agent.RunSpoolDrain)
			if a.verifier != nil {
				// Once the pods are restored and the servers listen: a
				// proof before a ztunnel connected would find every pod
				// unheld.
				cs.run("verifier", a.verifier.Run)
			}
			if c.StartupTaint {
				cs.run("startup-taint", nodetaint.Untainter{
					Client: a.opts.Client, Node: c.NodeName, Ready: a.health.CaptureReady,
					Logger: a.log.With("component", "startup-taint"),
				}.Run)
			}
			a.log.Info("node agent ready", "node", c.NodeName, "pods", len(a.agent.Pods()))
			returnStartupGarbage()
			return nil
		}},
	}
}

// timeFirstZtunnel observes the time from the agent's start to its first
// ztunnel connection whose snapshot ztunnel acknowledged (from then on pods
// can be captured), once; it ends then, or with ctx.
func (a *App) timeFirstZtunnel(ctx context.Context) error {
	if err := a.zds.WaitReady(ctx); err != nil {
		return nil // stopped before any ztunnel came
	}
	took := time.Since(a.started)
	a.metrics.StartToZtunnel.Observe(took.Seconds())
	a.log.Info("first ztunnel connected", "since_start", took.Round(time.Millisecond))
	return nil
}

// beginStep tells start-up liveness which step runs (the live ones).
func (a *App) beginStep(s step) {
	if s.live {
		a.startup.Begin(s.name, s.waitsOn)
	}
}

// refreshSnapshot brings the enablement snapshot up to date every
// snapshotRefresh: it lists this node's pods by UID, and pods come and go
// without an enablement change (it is rewritten only when it changed).
func (a *App) refreshSnapshot(ctx context.Context) error {
	t := time.NewTicker(snapshotRefresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if closed(a.ctrl.Restored()) {
				_ = a.agent.RefreshSnapshot()
			}
		}
	}
}

// components are the goroutines Run starts, each until the stop, and the
// ZDS server's, which outlives them: an uninstall releases the pods after
// everything else stopped, and ztunnel must get their Dels before the
// server closes.
type components struct {
	log       *slog.Logger
	zds       *zds.Server
	ctx       context.Context
	cancel    context.CancelFunc
	zdsCtx    context.Context
	stopZDS   context.CancelFunc
	wg, zdsWG sync.WaitGroup
	// errs carries a component's failure; the first stops everything.
	errs chan error
}

func newComponents(ctx context.Context, z *zds.Server, log *slog.Logger) *components {
	cs := &components{log: log, zds: z, errs: make(chan error, 10)}
	cs.ctx, cs.cancel = context.WithCancel(ctx)
	cs.zdsCtx, cs.stopZDS = context.WithCancel(context.WithoutCancel(ctx))
	return cs
}

func (cs *components) start(wg *sync.WaitGroup, ctx context.Context, name string, f func(context.Context) error) {
	wg.Go(func() {
		if err := f(ctx); err != nil && ctx.Err() == nil {
			select {
			case cs.errs <- fmt.Errorf("%s: %w", name, err):
			default: // one failure already stops everything
				cs.log.Error("component failed", "component", name, "err", err)
			}
		}
	})
}

// run starts the component name until the components stop.
func (cs *components) run(name string, f func(context.Context) error) {
	cs.start(&cs.wg, cs.ctx, name, f)
}

// runZDS starts the ZDS server until stopZtunnel.
func (cs *components) runZDS(f func(context.Context) error) { cs.start(&cs.zdsWG, cs.zdsCtx, "zds", f) }

// stop stops every component but the ZDS server and waits for them; a
// second call does nothing more.
func (cs *components) stop() {
	cs.cancel()
	cs.wg.Wait()
}

// stopZtunnel stops the ZDS server (one that never served releases its
// listener) and waits for it.
func (cs *components) stopZtunnel() {
	cs.stopZDS()
	_ = cs.zds.Close()
	cs.zdsWG.Wait()
}

// release frees the contexts of a start that ended before any component.
func (cs *components) release() {
	cs.cancel()
	cs.stopZDS()
}
