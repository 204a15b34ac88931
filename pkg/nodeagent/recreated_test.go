package nodeagent

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// countingAnnotator counts the writes it passes on.
type countingAnnotator struct {
	Annotator
	mu    sync.Mutex
	tries int
}

func (c *countingAnnotator) SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error {
	c.mu.Lock()
	c.tries++
	c.mu.Unlock()
	return c.Annotator.SetRedirection(ctx, namespace, name, uid, value)
}

func (c *countingAnnotator) attempts() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tries
}

// TestUnenrollRecreatedPod runs the annotation writer against a real API
// server: a pod unenrolled through its capture record after it was
// deleted and recreated under the same name (the pod cache not showing it
// yet) has its record removed after one write. The API server answers the
// write's uid with 422 (uid is immutable), which means the pod is gone, as
// a 404 does; the new pod is not touched.
func TestUnenrollRecreatedPod(t *testing.T) {
	env := kubeenv.Start(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	pods := env.Client.CoreV1().Pods(ns)
	spec := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}}}
	old, err := pods.Create(ctx, spec, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pods.Delete(ctx, "web", *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the old pod gone", func() bool {
		_, err := pods.Get(ctx, "web", metav1.GetOptions{})
		return err != nil
	})
	recreated, err := pods.Create(ctx, spec, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	client, err := kubeclient.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	ann := &countingAnnotator{Annotator: apicalls.Annotator{Client: client}}
	dir := t.TempDir()
	layout := nodefiles.InDir(dir)
	a, err := NewAgent(Config{Rules: newRecordedRules(), Annotator: ann, Layout: layout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { requireNoInvalidTransitions(t, a) })
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = a.Run(runCtx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; _ = a.Close() })

	if err := a.records.write(Record{UID: old.UID, Namespace: ns, Name: "web"}); err != nil {
		t.Fatal(err)
	}
	recordFile := filepath.Join(layout.Records(), string(old.UID)+recordSuffix)
	if err := a.Unenroll(ctx, old.UID); err != nil {
		t.Fatal(err)
	}
	// A write retried on the 422 shows within a few backoffs.
	poll.Until(t, "the record removed, or the write retried", func() bool {
		_, err := os.Stat(recordFile)
		return os.IsNotExist(err) || ann.attempts() >= 4
	})
	if _, err := os.Stat(recordFile); !os.IsNotExist(err) {
		t.Fatalf("capture record of the replaced pod not removed after %d writes (stat: %v)", ann.attempts(), err)
	}
	if n := ann.attempts(); n != 1 {
		t.Errorf("%d writes for a replaced pod, want 1", n)
	}
	if a.PendingAnnotations() != 0 {
		t.Errorf("%d annotation writes still pending", a.PendingAnnotations())
	}
	got, err := pods.Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.UID != recreated.UID {
		t.Fatalf("pod uid %s, want the recreated %s", got.UID, recreated.UID)
	}
	if v, ok := got.Annotations[ambient.RedirectionAnnotation]; ok {
		t.Errorf("the recreated pod got %s=%q", ambient.RedirectionAnnotation, v)
	}
}
