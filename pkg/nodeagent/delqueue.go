package nodeagent

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// delQueue replays the DELs the plugin spooled (Layout.DelSpool) while
// the agent was unreachable, or while a DEL of its timed out: each through
// the same removal as a live DEL (removeSandbox), as a spooled DEL, whose
// namespace the runtime may have left in place. An entry goes once
// handled; unusable entries are logged and removed.
type delQueue struct {
	a *Agent
}

// delSpoolInterval is how often the queue is drained while the agent runs.
const delSpoolInterval = 30 * time.Second

// drain replays every spooled DEL once and returns how many it handled.
func (q delQueue) drain(ctx context.Context) (int, error) {
	entries, err := nodefiles.List(q.a.cfg.Layout.DelSpool())
	if err != nil {
		return 0, err
	}
	n := drainSpool(q.a.log, "DEL spool", entries, func(ev *ambient.PodEvent) spoolStep {
		del := SandboxDel{SandboxID: ev.SandboxID, UID: types.UID(ev.PodUID), Namespace: ev.PodNamespace, Name: ev.PodName, Netns: ev.Netns}
		if err := q.a.removeSandbox(ctx, del, rmSpooledDel); err != nil {
			q.a.log.Warn("replay spooled DEL", "sandbox", ev.SandboxID, "err", err)
			return spoolKeep
		}
		return spoolCounted
	})
	if n > 0 {
		q.a.log.Info("replayed spooled DELs", "count", n)
	}
	return n, nil
}

// run drains the queue every delSpoolInterval until ctx ends.
func (q delQueue) run(ctx context.Context) error {
	t := time.NewTicker(delSpoolInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if _, err := q.drain(ctx); err != nil {
				q.a.log.Warn("drain DEL spool", "err", err)
			}
		}
	}
}

// DrainSpool replays the DELs the plugin spooled (see delQueue). A
// replayed DEL also cleans a pod the agent did not restore: its record,
// and our rules in its namespace if that still exists. Call it at startup
// after restoring state, then leave it to RunSpoolDrain.
func (a *Agent) DrainSpool(ctx context.Context) (int, error) {
	return delQueue{a}.drain(ctx)
}

// RunSpoolDrain replays spooled DELs every 30 seconds until ctx ends: the
// plugin also spools a DEL that timed out while the agent stayed up, not
// only while it was away.
func (a *Agent) RunSpoolDrain(ctx context.Context) error {
	return delQueue{a}.run(ctx)
}
