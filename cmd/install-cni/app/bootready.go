package app

import (
	"context"
	"fmt"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// The plugin's CNI STATUS fails from the node's boot until the agent is
// first ready on it (nodefiles.BootReady), so that the runtime, which asks
// before it starts a pod, starts none the agent cannot capture yet; then
// it passes for the rest of the boot, so that an agent restart or upgrade
// never makes the node NotReady. The agent is hostNetwork: kubelet starts
// it whatever the runtime's network says.

// bootReadyPoll is how often the agent looks at its readiness until it
// marks the boot ready: kubelet asks the runtime every 5 s, so the node
// is held no longer than that after the agent is ready.
const bootReadyPoll = 100 * time.Millisecond

// markBootBeforeChaining is the start step "boot-ready marker": a STATUS
// that passes must never start failing under an agent that comes. When
// the plugin the runtime would run is not already this agent's, chained
// (a first install, an upgrade from another version, an uninstall cut
// short, a primary that dropped our entry), nothing held the node's pods,
// so the boot is marked ready before the installer chains the plugin: a
// helm install or upgrade never makes a node NotReady. After a reboot the
// plugin is already ours, chained, and the mark waits for the agent's
// readiness (markBootReady).
func (a *App) markBootBeforeChaining(context.Context) error {
	if nodefiles.BootReady(a.layout, nodefiles.BootIDFile) == nil {
		return nil
	}
	if a.installer.RunsOurs() {
		a.log.Info("the node's CNI STATUS fails until this agent is ready: its first start since the node booted", "marker", a.layout.BootReady())
		return nil
	}
	if err := nodefiles.MarkBootReady(a.layout, nodefiles.BootIDFile); err != nil {
		return err
	}
	a.log.Info("marked the boot ready before chaining: the plugin in place (none, or another version's) held no pod back", "marker", a.layout.BootReady())
	return nil
}

// markBootReady marks the boot ready once the agent is first ready (every
// readiness check of its pod passes); it ends then, or with ctx.
func (a *App) markBootReady(ctx context.Context) error {
	if nodefiles.BootReady(a.layout, nodefiles.BootIDFile) == nil {
		return nil
	}
	t := time.NewTicker(bootReadyPoll)
	defer t.Stop()
	for {
		if len(a.health.Ready()) == 0 {
			if err := nodefiles.MarkBootReady(a.layout, nodefiles.BootIDFile); err != nil {
				return fmt.Errorf("the node's CNI STATUS stays failing: %w", err)
			}
			a.log.Info("ready: marked the boot ready, the node's CNI STATUS passes from now on", "marker", a.layout.BootReady())
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
