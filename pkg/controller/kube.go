package controller

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
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

// redirectionState returns the pod's current annotation value.
func redirectionState(pod *corev1.Pod) string {
	return pod.Annotations[ambient.RedirectionAnnotation]
}
