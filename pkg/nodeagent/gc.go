package nodeagent

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// GC forgets every CNI-enrolled pod attached through network whose sandbox
// is not in valid (pods the controller enrolled carry no sandbox id and are
// left to it), held or known only by its capture record. The runtime lists
// one network's attachments, so pods of other networks (several conflists,
// as with Multus) and of no known network are left alone; network ""
// (an older plugin) considers every pod. It returns how many it removed.
func (a *Agent) GC(ctx context.Context, network string, valid []string) int {
	mine := func(n string) bool { return network == "" || n == network }
	keep := make(map[string]bool, len(valid))
	for _, id := range valid {
		keep[id] = true
	}
	type stale struct {
		sandbox string
		uid     types.UID
	}
	var drop []stale
	seen := map[types.UID]bool{}
	a.mu.Lock()
	for uid, e := range a.pods {
		seen[uid] = true
		if e.SandboxID != "" && mine(e.Network) && !keep[e.SandboxID] {
			drop = append(drop, stale{e.SandboxID, uid})
		}
	}
	a.mu.Unlock()
	// Pods known only by their record (not restored) too.
	for _, r := range a.records.all() {
		if !seen[r.UID] && r.SandboxID != "" && mine(r.Network) && !keep[r.SandboxID] {
			drop = append(drop, stale{r.SandboxID, r.UID})
		}
	}
	for _, s := range drop {
		_ = a.RemoveSandbox(ctx, SandboxDel{SandboxID: s.sandbox, UID: s.uid})
	}
	if len(drop) > 0 {
		a.log.Info("gc removed stale sandboxes", "count", len(drop))
	}
	return len(drop)
}

// DrainSpool replays the DELs the plugin spooled while the agent was
// unreachable, removing each entry once handled (unusable entries are
// logged and removed). A replayed DEL also cleans a pod the agent did not
// restore: its record, and our rules in its namespace if that still
// exists (see RemoveSandbox). Call it at startup after restoring state,
// then leave it to RunSpoolDrain.
func (a *Agent) DrainSpool(ctx context.Context) (int, error) {
	entries, err := nodefiles.List(a.cfg.Layout.DelSpool())
	if err != nil {
		return 0, err
	}
	n := drainSpool(a.log, "DEL spool", entries, func(ev *ambient.PodEvent) spoolStep {
		del := SandboxDel{SandboxID: ev.SandboxID, UID: types.UID(ev.PodUID), Namespace: ev.PodNamespace, Name: ev.PodName, Netns: ev.Netns, Replayed: true}
		if err := a.RemoveSandbox(ctx, del); err != nil {
			a.log.Warn("replay spooled DEL", "sandbox", ev.SandboxID, "err", err)
			return spoolKeep
		}
		return spoolCounted
	})
	if n > 0 {
		a.log.Info("replayed spooled DELs", "count", n)
	}
	return n, nil
}

// spoolDrainInterval is how often RunSpoolDrain replays spooled DELs.
const spoolDrainInterval = 30 * time.Second

// RunSpoolDrain replays spooled DELs every spoolDrainInterval until ctx
// ends: the plugin also spools a DEL that timed out while the agent stayed
// up, not only while it was away.
func (a *Agent) RunSpoolDrain(ctx context.Context) error {
	t := time.NewTicker(spoolDrainInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if _, err := a.DrainSpool(ctx); err != nil {
				a.log.Warn("drain DEL spool", "err", err)
			}
		}
	}
}
