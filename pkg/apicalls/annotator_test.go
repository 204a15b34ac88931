package apicalls

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestAnnotatorReplacedPod runs against a real API server, through the
// agent's ServiceAccount under the shipped RBAC: the patch's uid is a
// precondition. For a pod deleted and recreated under its name the API
// server answers 422 (the uid is immutable), which SetRedirection reports
// as NotFound; the new pod is not touched. Any other 422 stays what it is.
func TestAnnotatorReplacedPod(t *testing.T) {
	env := kubeenv.Start(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	saCfg, _ := env.ServiceAccountClient(t, ns, "ambient-cni", kubeenv.ShippedRBAC(t))
	client, err := kubeclient.NewForConfig(saCfg)
	if err != nil {
		t.Fatal(err)
	}
	ann := Annotator{Client: client}
	pods := env.Client.CoreV1().Pods(ns)
	spec := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}}}
	old, err := pods.Create(ctx, spec, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ann.SetRedirection(ctx, ns, "web", old.UID, ambient.RedirectionEnabled); err != nil {
		t.Fatalf("annotate the pod: %v", err)
	}
	if err := pods.Delete(ctx, "web", *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the old pod gone", func() bool {
		_, err := pods.Get(ctx, "web", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if err := ann.SetRedirection(ctx, ns, "web", old.UID, ""); !apierrors.IsNotFound(err) {
		t.Errorf("pod deleted: SetRedirection = %v, want NotFound", err)
	}
	recreated, err := pods.Create(ctx, spec, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	// What the API server answers, read from its source: the object's uid
	// cannot change (ValidateObjectMetaUpdate), so a patch carrying the
	// old pod's uid is 422 with one cause on metadata.uid.
	raw := []byte(`{"metadata":{"uid":"` + string(old.UID) + `","annotations":{"` + ambient.RedirectionAnnotation + `":null}}}`)
	_, err = client.PatchPodStatus(ctx, ns, "web", "application/merge-patch+json", raw)
	if !apierrors.IsInvalid(err) || !uidRefused(err) {
		t.Fatalf("raw patch with the old uid: %v; want 422 on metadata.uid (field is immutable)", err)
	}

	for _, value := range []string{"", ambient.RedirectionEnabled} {
		err := ann.SetRedirection(ctx, ns, "web", old.UID, value)
		if !apierrors.IsNotFound(err) {
			t.Errorf("pod replaced, value %q: SetRedirection = %v, want NotFound", value, err)
		} else if !strings.Contains(err.Error(), string(old.UID)) {
			t.Errorf("the error does not name the old uid: %v", err)
		}
	}
	got, err := pods.Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := got.Annotations[ambient.RedirectionAnnotation]; ok || got.UID != recreated.UID {
		t.Errorf("the recreated pod (uid %s) was written: %v", got.UID, got.Annotations)
	}

	// Another 422 (an annotation over the API server's size limit) is not
	// a pod gone.
	err = ann.SetRedirection(ctx, ns, "web", recreated.UID, strings.Repeat("x", 300<<10))
	if !apierrors.IsInvalid(err) || apierrors.IsNotFound(err) {
		t.Errorf("oversized annotation: SetRedirection = %v, want the 422 as it is", err)
	}
	if err := ann.SetRedirection(ctx, ns, "web", recreated.UID, ambient.RedirectionEnabled); err != nil {
		t.Errorf("annotate the recreated pod: %v", err)
	}
}

// TestUIDRefused: only the one-cause 422 on metadata.uid is a replaced
// pod.
func TestUIDRefused(t *testing.T) {
	gk := corev1.SchemeGroupVersion.WithKind("Pod").GroupKind()
	uidErr := func(causes ...metav1.StatusCause) error {
		e := apierrors.NewInvalid(gk, "web", nil)
		e.ErrStatus.Details.Causes = causes
		return e
	}
	immutable := metav1.StatusCause{Type: metav1.CauseTypeFieldValueInvalid, Field: "metadata.uid", Message: `Invalid value: "u2": field is immutable`}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"uid immutable", uidErr(immutable), true},
		{"nil", nil, false},
		{"not found", apierrors.NewNotFound(corev1.Resource("pods"), "web"), false},
		{"conflict", apierrors.NewConflict(corev1.Resource("pods"), "web", nil), false},
		{"no causes", uidErr(), false},
		{"another field", uidErr(metav1.StatusCause{Type: metav1.CauseTypeFieldValueInvalid, Field: "metadata.name", Message: immutable.Message}), false},
		{"another message", uidErr(metav1.StatusCause{Type: metav1.CauseTypeFieldValueInvalid, Field: "metadata.uid", Message: "Invalid value: must be a uuid"}), false},
		{"more causes", uidErr(immutable, metav1.StatusCause{Type: metav1.CauseType("FieldValueTooLong"), Field: "metadata.annotations"}), false},
	} {
		if got := uidRefused(tc.err); got != tc.want {
			t.Errorf("%s: uidRefused = %v, want %v", tc.name, got, tc.want)
		}
	}
}
