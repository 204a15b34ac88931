// Package predelete is what the chart's pre-delete hook runs before helm
// removes a release. helm deletes the DaemonSet and, a moment later, the
// agent's ServiceAccount and RBAC, while the agent pods are still
// stopping: an agent that releases the pods it captured at shutdown would
// find itself without the rights to clear their annotations. So the hook
// deletes the release's signal Service (every agent writes its uninstall
// marker the moment it sees it go), then the DaemonSet, in the
// foreground, and waits until it and its pods are gone: every agent shuts
// down seeing its DaemonSet being deleted (an uninstall, not an upgrade)
// with its RBAC intact, and only then does helm delete the rest.
package predelete

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Client deletes and reads the DaemonSet and deletes the signal
// (kubeclient's verbs).
type Client interface {
	GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error)
	DeleteDaemonSet(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error
	DeleteService(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error
}

// Options say which DaemonSet to remove.
type Options struct {
	Client          Client
	Namespace, Name string
	// ReleaseSignal is the release's signal Service, deleted first (empty:
	// none).
	ReleaseSignal string
	// Poll is how often the DaemonSet is checked (default 1s).
	Poll   time.Duration
	Logger *slog.Logger
}

// DeleteDaemonSet deletes the DaemonSet with foreground propagation (the
// garbage collector removes its pods first and the DaemonSet last) and
// waits until it is gone or ctx ends. A DaemonSet that does not exist is
// done already.
func DeleteDaemonSet(ctx context.Context, o Options) error {
	if o.Poll <= 0 {
		o.Poll = time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.ReleaseSignal != "" {
		// Not fatal: the agents still read their DaemonSet being deleted
		// at SIGTERM, with their RBAC; only the early marker is lost.
		switch err := o.Client.DeleteService(ctx, o.Namespace, o.ReleaseSignal, metav1.DeleteOptions{}); {
		case err == nil:
			o.Logger.Info("release signal deleted: every agent marks its node as being uninstalled", "namespace", o.Namespace, "name", o.ReleaseSignal)
		case apierrors.IsNotFound(err):
		default:
			o.Logger.Warn("delete the release signal", "namespace", o.Namespace, "name", o.ReleaseSignal, "err", err)
		}
	}
	fg := metav1.DeletePropagationForeground
	err := o.Client.DeleteDaemonSet(ctx, o.Namespace, o.Name, metav1.DeleteOptions{PropagationPolicy: &fg})
	if apierrors.IsNotFound(err) {
		o.Logger.Info("daemonset already gone", "namespace", o.Namespace, "name", o.Name)
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete daemonset %s/%s: %w", o.Namespace, o.Name, err)
	}
	o.Logger.Info("deleting daemonset in the foreground; waiting for its pods to release theirs", "namespace", o.Namespace, "name", o.Name)
	start := time.Now()
	for {
		ds, err := o.Client.GetDaemonSet(ctx, o.Namespace, o.Name)
		if apierrors.IsNotFound(err) {
			o.Logger.Info("daemonset and its pods gone", "took", time.Since(start).Round(time.Millisecond))
			return nil
		}
		if err != nil && ctx.Err() == nil {
			o.Logger.Warn("get daemonset", "err", err)
		}
		select {
		case <-ctx.Done():
			pods := int32(-1)
			if ds != nil {
				pods = ds.Status.CurrentNumberScheduled
			}
			return fmt.Errorf("daemonset %s/%s still there after %v (%d pods): %w", o.Namespace, o.Name, time.Since(start).Round(time.Second), pods, ctx.Err())
		case <-time.After(o.Poll):
		}
	}
}
