// Package apicalls holds the node agent's Kubernetes API calls that are
// not informers: the redirection annotation patch (used by the agent and
// the pod controller), the event recorder (the pod controller's warnings),
// and the decision whether a shutdown is an upgrade or an uninstall (the
// DaemonSet check, whose answer install-cni hands to the installer's
// Shutdown). Each satisfies a narrow interface its user declares;
// install-cni wires them.
package apicalls

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
)

// Annotator writes the redirection status annotation that istiod reads,
// with a merge patch on the pods/status subresource (the only write the
// agent's RBAC grants on pods).
type Annotator struct {
	Client kubeclient.PodStatusPatcher
}

// SetRedirection sets the annotation to value, or removes it when value is
// "". The patch carries the pod UID as a precondition, so a pod recreated
// under the same name is never marked by mistake. A pod that is gone, or
// replaced under its name, is an error apierrors.IsNotFound reports: for
// the replaced pod the API server answers 422 (the uid is immutable),
// which is turned into that NotFound here; every other error is returned
// as the API server gave it.
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
	_, err = a.Client.PatchPodStatus(ctx, namespace, name, types.MergePatchType, patch)
	if uidRefused(err) {
		return fmt.Errorf("pod %s/%s is no longer uid %s (%v): %w", namespace, name, uid, err,
			apierrors.NewNotFound(corev1.Resource("pods"), name))
	}
	if err != nil {
		return fmt.Errorf("patch %s on pod %s/%s: %w", ambient.RedirectionAnnotation, namespace, name, err)
	}
	return nil
}

// uidRefused reports whether err is the API server refusing the patch's
// uid as a change of an immutable field (422, a FieldValueInvalid cause on
// metadata.uid): the object under the name is another pod. Any other 422,
// or one with further causes, is not this.
func uidRefused(err error) bool {
	var status apierrors.APIStatus
	if !apierrors.IsInvalid(err) || !errors.As(err, &status) {
		return false
	}
	d := status.Status().Details
	if d == nil || len(d.Causes) != 1 {
		return false
	}
	c := d.Causes[0]
	return c.Type == metav1.CauseTypeFieldValueInvalid && c.Field == "metadata.uid" &&
		strings.Contains(c.Message, apivalidation.FieldImmutableErrorMsg)
}

// eventComponent is the source component of the agent's Events.
const eventComponent = "ambient-cni"

// Events records Kubernetes Events as the agent on this node. Record
// through the embedded EventRecorder; Start sends them to the API server
// and Shutdown stops that.
type Events struct {
	record.EventRecorder
	client      kubeclient.Events
	broadcaster record.EventBroadcaster
}

// NewEvents returns a recorder for events from eventComponent on nodeName.
func NewEvents(client kubeclient.Events, nodeName string) *Events {
	b := record.NewBroadcaster()
	return &Events{
		EventRecorder: b.NewRecorder(kubeclient.NewScheme(), corev1.EventSource{Component: eventComponent, Host: nodeName}),
		client:        client,
		broadcaster:   b,
	}
}

// Start sends recorded events to the API server until Shutdown.
func (e *Events) Start() {
	e.broadcaster.StartRecordingToSink(kubeclient.EventSink{Client: e.client})
}

// Shutdown stops sending events.
func (e *Events) Shutdown() { e.broadcaster.Shutdown() }
