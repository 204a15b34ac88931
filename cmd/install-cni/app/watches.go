package app

import (
	"context"
	"log/slog"
	"sync"

	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
)

// APIWatches is everything the agent holds open against the API server,
// and the one request it makes at start, built in this one place: New
// wires these into the agent, and the fleet benchmark (test/bench) builds
// them for each simulated node, so what it measures at thousands of nodes
// is the agent's own set of watches (resources, selectors, metadata-only
// flags, content types), not a description of it. Each watch itself is
// defined once in pkg/kubeclient (PodsOfNodeWatch, NamespacesWatch,
// ReleaseSignalWatch) and opened by the component below that owns it. A
// watch the agent gains or loses belongs here.
type APIWatches struct {
	// Pods is the pod cache: the pods bound to the node and every
	// namespace.
	Pods *podcache.Cache
	// Upgrade watches the release's signal Service, metadata only, by
	// name (an uninstall told from an upgrade); no watch without a
	// signal configured.
	Upgrade *apicalls.DaemonSetUpgradeChecker
	// Tokens issues the plugin's credential: one token at start, then one
	// each half lifetime; nil without a plugin ServiceAccount.
	Tokens *apicalls.PluginTokens
}

// NewAPIWatches builds the watches of the agent configured by c, through
// client (built with KubeClientConfig); nothing runs until Run. onEvent
// (may be nil) is told each informer event of the pod cache.
func NewAPIWatches(c *Config, client kubeclient.Interface, onEvent func(string), log *slog.Logger) APIWatches {
	w := APIWatches{
		Upgrade: apicalls.NewDaemonSetUpgradeChecker(client, c.PodNamespace, c.DaemonSet, c.ReleaseSignal, c.NodeName, log),
		Pods: podcache.New(podcache.Config{
			Client: client, NodeName: c.NodeName,
			Policy:  c.EnablementPolicy(),
			OnEvent: onEvent,
			Logger:  log,
		}),
	}
	if c.PluginServiceAccount != "" {
		w.Tokens = &apicalls.PluginTokens{Client: client, Namespace: c.PodNamespace, ServiceAccount: c.PluginServiceAccount, NodeName: c.NodeName}
	}
	return w
}

// Run runs every watch until ctx ends, having asked for the plugin's
// first token as the agent's start does (its error is returned; the
// watches run all the same). The agent runs each as a component of its
// own instead; the fleet benchmark runs them here.
func (w APIWatches) Run(ctx context.Context, c *Config) error {
	var tokenErr error
	if w.Tokens != nil {
		_, tokenErr = w.Tokens.Token(ctx, c.PluginTokenLifetime)
	}
	var wg sync.WaitGroup
	wg.Go(func() { _ = w.Pods.Run(ctx) })
	_ = w.Upgrade.Run(ctx)
	wg.Wait()
	return tokenErr
}
