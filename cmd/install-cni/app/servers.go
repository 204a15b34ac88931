package app

import (
	"context"
	"fmt"
	"net"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/health"
)

// metricsRetry is how often a metrics address that could not be bound is
// tried again.
// (Options.MetricsRetry overrides it).
const metricsRetry = 30 * time.Second

// serveHealth starts health for kubelet on a TCP address, only if one is
// set (the chart's probes exec `install-cni probe` against the debug
// socket), and metrics for Prometheus on their own TCP address.
func (a *App) serveHealth(cs *components) error {
	c := a.cfg
	if c.HealthAddr != "" {
		ln, err := health.ListenTCP(c.HealthAddr)
		if err != nil {
			return fmt.Errorf("health: %w", err)
		}
		if a.opts.HealthReady != nil {
			a.opts.HealthReady(ln.Addr())
		}
		cs.run("health", func(ctx context.Context) error { return health.ServeListener(ctx, ln, a.health.Handler()) })
	}
	if c.MetricsAddr != "" {
		// A taken port costs the metrics only, never the node's pods.
		cs.run("metrics-server", func(ctx context.Context) error {
			a.serveMetrics(ctx)
			return nil
		})
	}
	return nil
}

// serveDebug starts the debug endpoints (pod names, IPs, netns paths) and
// health as kubelet's exec probes ask it, only on the root-only debug
// socket in the agent's private directory.
func (a *App) serveDebug(cs *components) error {
	ln, err := health.ListenUnix(a.DebugSocket())
	if err != nil {
		return fmt.Errorf("debug socket: %w", err)
	}
	cs.run("debug", func(ctx context.Context) error {
		return health.ServeListener(ctx, ln, health.Debug{
			Pods:       func() any { return a.agent.Pods() },
			Explain:    func(ctx context.Context, ns, name string) (any, error) { return a.explain.Explain(ctx, ns, name) },
			ExplainAll: func(ctx context.Context) any { return a.explain.ExplainAll(ctx) },
			Health:     a.health,
			Logger:     a.log.With("component", "debug"),
		}.Handler())
	})
	return nil
}

// serveMetrics serves /metrics until ctx ends. When the address is taken,
// the agent says so where an operator looks (an error in the log, a
// Warning Event on its own pod) and tries again every metricsRetry; CNI is
// served meanwhile.
func (a *App) serveMetrics(ctx context.Context) {
	addr, every := a.cfg.MetricsAddr, a.opts.MetricsRetry
	if every <= 0 {
		every = metricsRetry
	}
	health.ServeRetrying(ctx, addr, health.MetricsHandler(a.metrics.Registry), health.Retry{
		Every: every,
		Bound: func(bound net.Addr) {
			a.log.Info("serving metrics", "addr", bound.String())
			if a.opts.MetricsReady != nil {
				a.opts.MetricsReady(bound)
			}
		},
		Failed: func(err error, attempt int) {
			a.log.Error("metrics unavailable: cannot serve /metrics; CNI is served without it, retrying", "addr", addr,
				"retry_in", every.String(), "attempt", attempt, "err", err)
			if attempt == 1 {
				a.warnOwnPod(ctx, "MetricsUnavailable",
					fmt.Sprintf("cannot serve /metrics on %s (%v); the node agent serves CNI without metrics and retries every %s", addr, err, every))
			}
		},
	})
}

// warnOwnPod records a Warning Event on the agent's own pod, found in the
// pod cache so the Event carries its UID (kubectl describe matches on it);
// with no pod name configured it only logs.
func (a *App) warnOwnPod(ctx context.Context, reason, msg string) {
	c := a.cfg
	if c.PodName == "" || c.PodNamespace == "" {
		return
	}
	ref := &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: c.PodNamespace, Name: c.PodName}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if a.pods.WaitForSync(wctx) == nil {
		if p, err := a.pods.Pod(c.PodNamespace, c.PodName); err == nil {
			ref.UID = p.UID
		}
	}
	a.events.Event(ref, corev1.EventTypeWarning, reason, msg)
}
