package app

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
	"github.com/ambient-cni/ambient-cni/pkg/kubeadapter"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// fallbackBinaryName is the plugin's second tier, beside the plugin
// binary in the image.
const fallbackBinaryName = "ambient-cni-fallback"

// writePluginFiles puts into the state directory what the plugin decides
// by while the agent cannot answer: the fallback binary and a first
// credential. It returns the rotator that keeps the credential fresh, or
// nil when there is none to keep. Failures are logged, not fatal: the
// plugin then decides by the snapshot alone, failing closed.
func (a *App) writePluginFiles(ctx context.Context) *plugincred.Rotator {
	c := a.cfg
	layout := c.Layout()
	if err := os.MkdirAll(layout.StateDir(), 0o700); err != nil {
		a.log.Error("state directory", "err", err)
		return nil
	}
	if err := os.Chmod(layout.StateDir(), 0o700); err != nil {
		a.log.Error("state directory", "err", err)
	}
	src := filepath.Join(filepath.Dir(c.PluginBinary), fallbackBinaryName)
	if err := copyBinary(src, layout.FallbackBinary()); err != nil {
		a.log.Warn("the plugin's fallback binary is not in place; while the agent cannot answer the plugin decides by the snapshot alone", "err", err)
	}
	if c.PluginServiceAccount == "" || a.opts.APIServer == "" {
		a.log.Info("no plugin credential configured; while the agent cannot answer the plugin decides by the snapshot alone")
		_ = os.Remove(layout.PluginCredential())
		return nil
	}
	r := &plugincred.Rotator{
		Path: layout.PluginCredential(),
		Base: plugincred.File{Server: a.opts.APIServer, CA: string(a.opts.APICA), NodeName: c.NodeName,
			Policy: plugincred.Policy{ExcludedNamespaces: nonNil(c.ExcludedNamespaces), DataPlaneNamespaces: c.EnablementPolicy().DataPlaneNamespaces,
				EnablementSelectors: c.EnablementSelectorText},
			DaemonSet: daemonSetRef(c)},
		Source:   kubeadapter.PluginTokens{Client: a.opts.Client, Namespace: c.PodNamespace, ServiceAccount: c.PluginServiceAccount, NodeName: c.NodeName},
		Lifetime: c.PluginTokenLifetime,
		Logger:   a.log.With("component", "plugin-credential"),
	}
	wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := r.WriteOnce(wctx); err != nil {
		a.log.Warn("first plugin credential; renewing in the background", "err", err)
	} else {
		a.log.Info("plugin credential written", "path", r.Path, "serviceAccount", c.PluginServiceAccount)
	}
	return r
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

// copyBinary replaces dst with src's content, mode 0700, atomically.
func copyBinary(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(dst, b, atomicfile.Options{Mode: 0o700}); err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return nil
}
