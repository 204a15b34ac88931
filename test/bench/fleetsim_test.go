package bench

import (
	"context"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// TestQuickFleet is `make bench-fleet`'s smoke run: 20 simulated agents
// of ours (the agent's own watch set, from install-cni's NewAPIWatches)
// against a real kube-apiserver. It asserts only what the agent promises
// (docs/performance.md, "Many agents, one API server"), never a duration:
// at start one request (the plugin's token) and no list (the informers
// get their state over their watches), none at rest, one event per agent
// when a namespace is labelled, and the same watches after every agent
// restarted at once. A DaemonSet status write reaches no agent.
func TestQuickFleet(t *testing.T) {
	kubeenv.RequireTool(t, kubeenv.Etcd)
	kubeenv.RequireTool(t, kubeenv.KubeAPIServer)
	var log strings.Builder
	res, err := RunFleetSim(context.Background(), FleetSimOptions{
		RepoRoot: repoRoot(t), Quick: true, Log: &log,
		IstioMissing: "the quick run simulates ours only",
	})
	t.Logf("progress:\n%s", log.String())
	if res != nil {
		var report strings.Builder
		_ = res.WriteReport(&report)
		t.Logf("report:\n%s", report.String())
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Runs) != 1 || res.Runs[0].Nodes != 20 {
		t.Fatalf("not the quick fleet: %+v", res.Runs)
	}
	r := res.Runs[0]
	n := r.Nodes
	if len(r.WatchesPerAgent) == 0 || r.Start.WatchStarts < n || r.Restart.WatchStarts < n {
		t.Errorf("watches per agent %v, %d established at start, %d at the restart", r.WatchesPerAgent, r.Start.WatchStarts, r.Restart.WatchStarts)
	}
	// The agent's watches as the API server saw them: the release's
	// signal Service among them, no DaemonSet.
	byResource := map[string]int{}
	for k, v := range r.WatchesPerAgent {
		byResource[strings.Fields(k)[0]] += v
	}
	if byResource["services"] != 1 || byResource["daemonsets"] != 0 {
		t.Errorf("watches per agent %v, want one on services (the release's signal) and none on daemonsets", r.WatchesPerAgent)
	}
	for phase, p := range map[string]FleetPhase{"start": r.Start, "restart": r.Restart} {
		if got := p.ByKey["create serviceaccounts/token"]; got != n || p.AgentRequests != n {
			t.Errorf("%s: %d requests (%v), want one token per agent (%d)", phase, p.AgentRequests, p.ByKey, n)
		}
	}
	if r.Rest.AgentRequests != 0 {
		t.Errorf("at rest the agents asked %v", r.Rest.ByKey)
	}
	if r.FlipAgentEvents != int64(n) || r.Flip.AgentRequests != 0 {
		t.Errorf("a namespace labelled: %d events to %d agents (want one each), requests %v", r.FlipAgentEvents, n, r.Flip.ByKey)
	}
	// The agent tells an uninstall by the release's signal Service, not
	// by watching its DaemonSet: a status write reaches no agent.
	if r.StatusWrites == 0 || r.StatusAgentEvents != 0 {
		t.Errorf("%d DaemonSet status writes reached the agents as %d events (%.0f bytes per write to all %d), want none",
			r.StatusWrites, r.StatusAgentEvents, statusBytesPerWrite(r), n)
	}
}
