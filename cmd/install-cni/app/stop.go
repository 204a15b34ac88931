package app

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/nodedirs"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
)

// shutdownTimeout bounds the upgrade decision with the unchaining that
// follows it, the startup taint, and the installer's stop.
const shutdownTimeout = 10 * time.Second

// annotationFlushTimeout bounds the wait for queued annotation writes at
// shutdown.
const annotationFlushTimeout = 2 * time.Second

// releaseTimeout bounds releasing the captured pods on an uninstall.
const releaseTimeout = 12 * time.Second

// ztunnelDelTimeout bounds the wait for ztunnel's acks of the released
// pods' Dels on an uninstall.
const ztunnelDelTimeout = 3 * time.Second

// stop stops a started agent. The decision (apicalls's DaemonSet check:
// upgrade or uninstall) is taken first, while every component still runs
// (the event server answers, the annotation writer writes); then the
// decision's list runs (upgradeSteps, uninstallSteps), every step whatever
// an earlier one did. flush: the annotation writes queued by the last
// captures get a moment on an upgrade (not for a component's failure, nor
// a stop during the start-up).
func (a *App) stop(cs *components, runErr error, flush bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	upgrade := apicalls.IsUpgrade(ctx, a.upgrade, a.log)
	giveBack := errors.Is(runErr, errIstioCNIReturns)
	var steps []step
	switch {
	case giveBack:
		// The node goes back to istio-cni (standby.go).
		upgrade = false
		steps = a.giveBackSteps(cs)
	case upgrade:
		steps = a.upgradeSteps(cs, flush && runErr == nil)
	default:
		steps = a.uninstallSteps(ctx, cs)
	}
	_, err := runSteps(ctx, steps, nil)
	// An operator reading the log tells the three stops apart.
	a.log.Info("install-cni stopped", "upgrade", upgrade, "gaveBack", giveBack)
	return errors.Join(runErr, err)
}

// upgradeSteps is the stop when the next agent takes over: pods keep their
// rules, the plugin stays chained and new pods wait for that agent.
func (a *App) upgradeSteps(cs *components, flush bool) []step {
	return []step{
		{name: "uninstall marker the watch wrote removed", goOn: true, do: func(context.Context) error {
			// The watch may have written it for a signal the decision
			// overruled (deleted by hand while the DaemonSet lives and
			// schedules here): the next agent takes the node over, and a
			// marker left behind would let every pod through in any later
			// outage.
			if seen := a.upgrade.Seen(); seen == "being deleted" || seen == "deleted" {
				if had, err := nodefiles.ClearUninstalling(a.layout); err != nil {
					a.log.Error("upgrade: cannot remove the uninstall marker the release signal's watch wrote", "err", err)
				} else if had {
					a.log.Info("upgrade: the uninstall marker the release signal's watch wrote removed")
				}
			}
			return nil
		}},
		a.annotationsFlushedStep(flush),
		{name: "components stopped", goOn: true, do: stopped(cs.stop)},
		{name: "startup taint", goOn: true, do: func(context.Context) error {
			if !a.cfg.StartupTaintOnShutdown {
				return nil
			}
			// Before the ZDS server and the installer stop, so that
			// nothing is scheduled onto the node while it has no agent.
			ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
			defer cancel()
			added, err := nodetaint.Add(ctx, a.opts.Client, a.cfg.NodeName)
			if err != nil {
				return fmt.Errorf("startup taint: %w", err)
			}
			if added {
				a.log.Info("startup taint put back until the next agent is ready", "node", a.cfg.NodeName)
			}
			return nil
		}},
		{name: "ZDS server stopped", goOn: true, do: stopped(cs.stopZtunnel)},
		{name: "agent closed", goOn: true, do: a.closeAgent},
		a.pluginKeptStep(),
	}
}

// annotationsFlushedStep gives the annotation writes queued by the last
// captures a moment (none when !flush): the next agent, ours or
// istio-cni's, finds the pods it adopts by their annotation.
func (a *App) annotationsFlushedStep(flush bool) step {
	return step{name: "annotation writes flushed", goOn: true, do: func(context.Context) error {
		if !flush {
			return nil
		}
		// Whatever is left the next agent repairs.
		fctx, fcancel := context.WithTimeout(context.Background(), annotationFlushTimeout)
		defer fcancel()
		if err := a.agent.FlushAnnotations(fctx); err != nil {
			a.log.Info("annotation writes left to the next agent", "pending", a.agent.PendingAnnotations())
		}
		return nil
	}}
}

// pluginKeptStep stops the installer and leaves the plugin chained.
func (a *App) pluginKeptStep() step {
	return step{name: "installer stopped, the plugin kept", goOn: true, do: func(context.Context) error {
		ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
		defer cancel()
		if err := a.installer.Shutdown(ctx, true); err != nil {
			return fmt.Errorf("installer shutdown: %w", err)
		}
		return nil
	}}
}

// giveBackSteps is the stop that gives the node back to istio-cni, whose
// pod is scheduled onto it again (standby.go). The pods are handed over,
// not released: they keep their annotation, their in-pod rules (under
// istio-cni's own names, which its agent adopts at its start as it adopts
// those of a pod it captured itself) and their workload in ztunnel (kept
// while ztunnel reconnects to istio-cni's socket, and named again by
// istio-cni's snapshot), so no running pod has a moment outside the mesh.
// The host probe SNAT stays for istio-cni's agent to start behind it. The
// plugin stays chained with the node files it decides by and no uninstall
// marker: a pod set up before istio-cni's plugin is chained finds no agent
// of ours, and waits if it must be captured, then goes on to istio-cni's
// plugin once that one has been chained a while and its agent answers. The
// next start, standing by, forgets the handed-over pods, removes the host
// probe SNAT and withdraws the plugin once istio-cni's agent answers in
// the chain (awaitIstioCNI).
func (a *App) giveBackSteps(cs *components) []step {
	return []step{
		a.annotationsFlushedStep(true),
		{name: "components stopped", goOn: true, do: stopped(cs.stop)},
		{name: "ZDS server stopped", goOn: true, do: stopped(cs.stopZtunnel)},
		{name: "agent closed", goOn: true, do: a.closeAgent},
		a.pluginKeptStep(),
	}
}

// uninstallSteps is the stop that puts the node back to plain networking,
// in the order docs/deploy.md "Uninstall" gives: the uninstall marker,
// then the plugin unchained (both while every component still runs), then
// the pods released, then the rest and, last, the marker. The marker comes
// first so that a kill at any later step leaves a plugin that, finding no
// agent, lets pods through; it goes last, and only once no config names
// the plugin. Every step runs whatever an earlier one did: an unchaining
// that failed is tried again once the agent is closed. decided bounds the
// unchaining with the decision.
func (a *App) uninstallSteps(decided context.Context, cs *components) []step {
	unchain := func(ctx context.Context) error {
		if a.unchained {
			return nil
		}
		if err := a.installer.Shutdown(ctx, false); err != nil {
			return fmt.Errorf("installer shutdown: %w", err)
		}
		a.unchained = true
		return nil
	}
	return []step{
		{name: "uninstall marker written", goOn: true, do: func(context.Context) error {
			// From here the release signal's watch no longer clears the marker.
			a.leaving.Store(true)
			note := fmt.Sprintf("uninstall of ambient-cni from node %s begun by agent pod %s/%s", a.cfg.NodeName, a.cfg.PodNamespace, a.cfg.PodName)
			if err := nodefiles.MarkUninstalling(a.layout, note); err != nil {
				// Unchain anyway: a plugin left chained without an agent
				// blocks the node's pods for good.
				a.log.Error("uninstall: cannot write the uninstall marker; unchaining the plugin without it", "err", err)
				return nil
			}
			a.log.Info("uninstall: marker written", "marker", a.layout.Uninstalling())
			return nil
		}},
		{name: "plugin unchained", goOn: true, do: func(context.Context) error {
			if err := unchain(decided); err != nil {
				return err
			}
			a.log.Info("uninstall: plugin unchained; releasing the pods")
			return nil
		}},
		{name: "components stopped", goOn: true, do: stopped(cs.stop)},
		a.releaseStep(),
		a.delAcksStep(),
		{name: "ZDS server stopped", goOn: true, do: stopped(cs.stopZtunnel)},
		{name: "agent closed", goOn: true, do: a.closeAgent},
		{name: "plugin unchained, second try", goOn: true, do: func(context.Context) error {
			ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
			defer cancel()
			return unchain(ctx)
		}},
		a.hostProbeRemovedStep(),
		{name: "node files removed", goOn: true, do: func(context.Context) error {
			// The agent is closed and the plugin unchained: neither reads
			// them any more.
			return nodefiles.RemoveForUninstall(a.layout)
		}},
		{name: "node directories put back", goOn: true, do: func(context.Context) error {
			return nodedirs.Restore(a.layout.NodeDirsLedger())
		}},
		{name: "uninstall marker removed", goOn: true, do: func(context.Context) error {
			// Only once no config names the plugin: until then the marker
			// is what lets pods through.
			if !a.unchained {
				return nil
			}
			_, err := nodefiles.ClearUninstalling(a.layout)
			return err
		}},
	}
}

// releaseStep releases every captured pod: its rules, ztunnel's Del, its
// annotation.
func (a *App) releaseStep() step {
	return step{name: "pods released", goOn: true, do: func(context.Context) error {
		// Its own budget (within the chart's 30 s grace period): one
		// API call and one rule removal per pod.
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		defer cancel()
		if err := a.agent.ReleaseAll(ctx); err != nil {
			return fmt.Errorf("release pods: %w", err)
		}
		return nil
	}}
}

// delAcksStep waits a moment for ztunnel's acks of the released pods.
func (a *App) delAcksStep() step {
	return step{name: "ztunnel's acks of the Dels", goOn: true, do: func(context.Context) error {
		ctx, cancel := context.WithTimeout(context.Background(), ztunnelDelTimeout)
		defer cancel()
		if err := a.zds.Drain(ctx); err != nil {
			a.log.Warn("ztunnel did not ack every Del of the released pods; it drops them when it reconnects or stops", "err", err)
		}
		return nil
	}}
}

// hostProbeRemovedStep removes the host probe SNAT.
func (a *App) hostProbeRemovedStep() step {
	return step{name: "host probe SNAT removed", goOn: true, do: func(context.Context) error { return a.agent.RemoveHostProbe() }}
}

func (a *App) closeAgent(context.Context) error {
	_ = a.agent.Close()
	return nil
}

// stopped is a step's do that runs f.
func stopped(f func()) func(context.Context) error {
	return func(context.Context) error {
		f()
		return nil
	}
}

// releaseSignalChanged follows the watch on the release's signal: the
// signal being deleted or gone means an uninstall (helm's pre-delete hook
// deletes it before the DaemonSet, helm's uninstall before the DaemonSet
// and the RBAC), so the marker is written at once and a kill anywhere in
// the shutdown to come finds it there; a signal that comes back (deleted
// by hand, then restored by helm upgrade) takes the marker away, unless
// this agent already decided to uninstall.
func (a *App) releaseSignalChanged(prev, next string) {
	layout := a.layout
	switch {
	case next == "being deleted" || next == "deleted":
		note := fmt.Sprintf("release signal %s/%s %s, seen by agent pod %s/%s on node %s", a.cfg.PodNamespace, a.cfg.ReleaseSignal, next, a.cfg.PodNamespace, a.cfg.PodName, a.cfg.NodeName)
		if err := nodefiles.MarkUninstalling(layout, note); err != nil {
			a.log.Error("uninstall: cannot write the uninstall marker", "err", err)
			return
		}
		a.log.Info("uninstall: marker written", "why", "release signal "+next, "marker", layout.Uninstalling())
	case next == "present" && (prev == "being deleted" || prev == "deleted") && !a.leaving.Load():
		if had, err := nodefiles.ClearUninstalling(layout); err != nil {
			a.log.Error("cannot remove the uninstall marker of a release signal that is back", "err", err)
		} else if had {
			a.log.Info("release signal is back: uninstall marker removed")
		}
	}
}
