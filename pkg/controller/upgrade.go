package controller

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// DaemonSetUpgradeChecker tells an upgrade (the agent's DaemonSet still
// exists and is not being deleted: another agent will follow) from an
// uninstall when the agent shuts down.
type DaemonSetUpgradeChecker struct {
	Client          kubernetes.Interface
	Namespace, Name string
}

// IsUpgrade implements installer.UpgradeChecker.
func (d DaemonSetUpgradeChecker) IsUpgrade(ctx context.Context) (bool, error) {
	ds, err := d.Client.AppsV1().DaemonSets(d.Namespace).Get(ctx, d.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	// helm uninstall deletes the ServiceAccount and RBAC right after the
	// DaemonSet, before its pods stop: losing our own identity or rights
	// means the release is going away, not being upgraded.
	if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("get daemonset %s/%s: %w", d.Namespace, d.Name, err)
	}
	return ds.DeletionTimestamp == nil, nil
}
