package app

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// pluginRotator builds the rotator of the plugin's own API credential, or
// nil when none is configured (no plugin ServiceAccount, or no API
// server URL to put in it).
func (a *App) pluginRotator() *plugincred.Rotator {
	c := a.cfg
	if a.tokens == nil || a.opts.APIServer == "" {
		return nil
	}
	m := a.metrics
	return &plugincred.Rotator{
		Path: a.layout.PluginCredential(),
		Base: plugincred.File{Server: a.opts.APIServer, CA: string(a.opts.APICA), NodeName: c.NodeName,
			Policy:    credentialPolicy(c),
			DaemonSet: daemonSetRef(c)},
		Source:       *a.tokens,
		Lifetime:     c.PluginTokenLifetime,
		Retry:        a.opts.PluginCredentialRetry,
		Logger:       a.log.With("component", "plugin-credential"),
		OnCredential: m.ObservePluginCredential,
		OnFailure:    func(error) { m.PluginCredentialFailures.Inc() },
	}
}

// writePluginFiles puts into the state directory what the plugin decides
// by while the agent cannot answer: the fallback binary and a first
// credential. When no new token can be had, a still valid credential a
// previous agent left is kept; with neither, the rotator retries in the
// background and the plugin is chained all the same (pods that must be
// captured never start uncaptured; while the agent is away, pods the
// snapshot cannot vouch for wait). Failures are logged, not fatal.
func (a *App) writePluginFiles(ctx context.Context) {
	c, layout := a.cfg, a.layout
	if err := os.MkdirAll(layout.StateDir(), 0o700); err != nil {
		a.log.Error("state directory", "err", err)
		return
	}
	if err := os.Chmod(layout.StateDir(), 0o700); err != nil {
		a.log.Error("state directory", "err", err)
	}
	// The fallback binary is beside the plugin binary in the image, under
	// the name it has in the state directory.
	src := filepath.Join(filepath.Dir(c.PluginBinary), filepath.Base(layout.FallbackBinary()))
	if err := atomicfile.CopyFile(src, layout.FallbackBinary(), atomicfile.Options{Mode: 0o700}); err != nil {
		a.log.Warn("the plugin's fallback binary is not in place; while the agent cannot answer the plugin decides by the snapshot alone", "err", err)
	}
	r := a.cred
	if r == nil {
		a.log.Info("no plugin credential configured; while the agent cannot answer the plugin decides by the snapshot alone, and pods it cannot vouch for wait")
		_ = os.Remove(layout.PluginCredential())
		return
	}
	wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	err := r.WriteOnce(wctx)
	if err == nil {
		_, exp, _ := r.InPlace()
		a.log.Info("plugin credential written", "path", r.Path, "serviceAccount", c.PluginServiceAccount, "expires", exp)
		return
	}
	if exp, kerr := r.KeepValid(); kerr == nil {
		a.log.Warn("no new plugin credential; kept the one on disk, still valid, and renewing in the background", "err", err, "expires", exp)
		return
	} else if !errors.Is(kerr, fs.ErrNotExist) {
		a.log.Warn("the plugin credential on disk cannot be kept", "err", kerr)
	}
	a.log.Error("no plugin credential (retrying in the background): while the agent cannot answer, the plugin cannot ask the API server and pods it cannot vouch for wait",
		"err", err, "serviceAccount", c.PluginServiceAccount)
}

// credentialPolicy is the agent's enablement policy (EnablementPolicy) as
// the credential carries it to the fallback binary, which decides by it
// with the same function the agent does.
func credentialPolicy(c *Config) plugincred.Policy {
	p := c.EnablementPolicy()
	out := plugincred.Policy{ExcludedNamespaces: nonNil(p.ExcludedNamespaces), DataPlaneNamespaces: p.DataPlaneNamespaces,
		EnablementSelectors: c.EnablementSelectorText}
	if p.Self.Name != "" {
		out.Self = &plugincred.ObjectRef{Namespace: p.Self.Namespace, Name: p.Self.Name}
	}
	return out
}

// daemonSetRef names the agent's DaemonSet for the fallback, which checks
// before a pod waits for an agent that one can still come; nil when the
// agent does not know its namespace.
func daemonSetRef(c *Config) *plugincred.ObjectRef {
	if c.PodNamespace == "" || c.DaemonSet == "" {
		return nil
	}
	return &plugincred.ObjectRef{Namespace: c.PodNamespace, Name: c.DaemonSet}
}
