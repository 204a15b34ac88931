// Package kubeadapter holds the node agent's Kubernetes API calls that are
// not informers: the redirection annotation patch (used by the agent and
// the pod controller), the event recorder (the pod controller's warnings),
// and the DaemonSet check that tells an upgrade from an uninstall at
// shutdown (the installer's). Each satisfies a narrow interface its user
// declares; install-cni wires them.
package kubeadapter

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// Annotator writes the redirection status annotation that istiod reads,
// with a merge patch on the pods/status subresource (the only write the
// agent's RBAC grants on pods).
type Annotator struct {
	Client kubernetes.Interface
}

// SetRedirection sets the annotation to value, or removes it when value is
// "". The patch carries the pod UID as a precondition, so a pod recreated
// under the same name is never marked by mistake.
func (a Annotator) SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error {
	var v any
	if value != "" {
		v = value
	}
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{
			"uid":         uid,
			"annotations": map[string]any{ambient.RedirectionAnnotation: v},
		},
	})
	if err != nil {
		return err
	}
	_, err = a.Client.CoreV1().Pods(namespace).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		return fmt.Errorf("patch %s on pod %s/%s: %w", ambient.RedirectionAnnotation, namespace, name, err)
	}
	return nil
}

// eventComponent is the source component of the agent's Events.
const eventComponent = "ambient-cni"

// Events records Kubernetes Events as the agent on this node. Record
// through the embedded EventRecorder; Start sends them to the API server
// and Shutdown stops that.
type Events struct {
	record.EventRecorder
	client      kubernetes.Interface
	broadcaster record.EventBroadcaster
}

// NewEvents returns a recorder for events from eventComponent on nodeName.
func NewEvents(client kubernetes.Interface, nodeName string) *Events {
	b := record.NewBroadcaster()
	return &Events{
		EventRecorder: b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: eventComponent, Host: nodeName}),
		client:        client,
		broadcaster:   b,
	}
}

// Start sends recorded events to the API server until Shutdown.
func (e *Events) Start() {
	e.broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: e.client.CoreV1().Events("")})
}

// Shutdown stops sending events.
func (e *Events) Shutdown() { e.broadcaster.Shutdown() }

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
