package app

import (
	"context"
	"fmt"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/health"
)

// startupStepBound is how long one start-up step (the pod cache sync, the
// restore of the pods captured before, ..., until the event server
// listens) may run while what it waits on answers; past it, liveness
// fails naming the step, and the chart's probe (a failure every 10 s, 12
// in a row) has kubelet restart a start-up stuck about 3 minutes. A step
// waiting on an API server that does not answer, or fails the agent's
// lists, is waiting, not hung, however long: a restart would only add
// kubelet's back-off. A minute is far above what a step takes on a
// loaded node (a restore of a full node takes seconds; the sync, once
// the API server answers, one list), and with the probe's 2 minutes it
// lets a slow step go on for 3 before a restart.
const startupStepBound = time.Minute

// apiReadyzTimeout bounds start-up liveness's question to the API server,
// inside health.LiveTimeout: no answer in time is no answer.
const apiReadyzTimeout = 2 * time.Second

// apiServer is the API server as the pod cache sync waits on it: not
// available while it does not answer /readyz (in apiReadyzTimeout) or
// while the cache's lists fail (the last failure less than a step's bound
// ago: its retries back off up to half a minute).
func (a *App) apiServer() *health.Dependency {
	return &health.Dependency{Name: "the API server", Answers: func(ctx context.Context) error {
		if at := a.pods.LastListError(); !at.IsZero() && time.Since(at) <= a.startup.Bound() {
			return fmt.Errorf("the agent's list or watch failed %s ago", time.Since(at).Round(time.Second))
		}
		ctx, cancel := context.WithTimeout(ctx, apiReadyzTimeout)
		defer cancel()
		return a.opts.Client.Readyz(ctx)
	}}
}
