package nodeagent

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// Annotator writes the pod's redirection status annotation; value "" removes
// it (pkg/apicalls.Annotator). The pod controller uses it too, to clear
// stale annotations. A pod gone, or replaced by another pod under its
// name, is an error apierrors.IsNotFound reports.
type Annotator interface {
	SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error
}

// PodLister reads this node's pods from the pod cache (pkg/podcache.Cache):
// the annotation writer skips writing a value the pod already carries, and
// a CNI DEL that cannot tell which sandbox it names asks whether the pod
// is going away.
type PodLister interface {
	Pod(namespace, name string) (*corev1.Pod, error)
}

// annotationWorkers is how many annotation writes run at once. The
// writer's own rate limit paces them; a few in flight keep its burst
// busy when many pods are enrolled at once (a namespace label).
const annotationWorkers = 8

// maxAnnotationHold bounds how long holds (annotationWriter.hold) defer
// the writes, counted from the first of a run of holds that follow each
// other: captures that go on and on never starve the annotations.
const maxAnnotationHold = 2 * time.Second

// Backoff of a failed annotation write, per pod.
const (
	annotationRetryMin = 100 * time.Millisecond
	annotationRetryMax = 30 * time.Second
)

// annotationWriter writes the redirection annotation off the capture's
// critical path. It keeps, per pod, only the latest value the agent wants
// (coalescing), writes it with retries and per-pod backoff, and skips a
// write when the pod already carries the value. A pod that is gone
// (NotFound, which the Annotator also reports for a pod replaced under
// its name) drops its write. Nothing is lost while the agent runs; a crash
// loses the queue, and the next agent rewrites what its restored pods need
// (see Agent.Restore and Agent.SnapshotAcked).
type annotationWriter struct {
	ann  Annotator
	pods PodLister // may be nil
	log  *slog.Logger
	// limit paces the writes below the API client's own limit, so that
	// a burst of annotations never holds up a request a capture makes.
	limit *rate.Limiter

	queue workqueue.TypedRateLimitingInterface[types.UID]

	// t holds the pods' lives: each pod's wanted and written values are
	// in its life (podLife.annotation). Its mu guards them and the
	// fields below.
	t *lifeTable
	// wanted counts the pods whose life wants a value written.
	wanted int
	// thens counts the then callbacks running: a retired write is done
	// only once its then ran (a capture record removed, say).
	thens int
	// idle is closed and replaced whenever no pod wants a write and no
	// then runs (for Flush).
	idle chan struct{}
	// holds counts the holds in force; the writes wait while any is, until
	// heldSince + maxAnnotationHold. unheld is closed when the last one
	// ends, at heldUntil.
	holds                int
	heldSince, heldUntil time.Time
	unheld               chan struct{}
	// maxHold is maxAnnotationHold (tests shorten or lengthen it);
	// waiting counts the writes waiting on a hold.
	maxHold time.Duration
	waiting int
}

type wantedAnnotation struct {
	namespace, name, value string
	// then runs once value is on the object (or the pod is gone), unless
	// a newer value replaced it first.
	then func()
}

func newAnnotationWriter(ann Annotator, pods PodLister, t *lifeTable, limit *rate.Limiter, log *slog.Logger) *annotationWriter {
	return &annotationWriter{
		ann: ann, pods: pods, t: t, log: log, limit: limit,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[types.UID](annotationRetryMin, annotationRetryMax),
			workqueue.TypedRateLimitingQueueConfig[types.UID]{Name: "annotations"}),
		idle:    make(chan struct{}),
		maxHold: maxAnnotationHold,
	}
}

// set makes value the pod's wanted annotation ("" removes it); then, if
// not nil, runs once it is written. It never blocks on the API.
func (w *annotationWriter) set(namespace, name string, uid types.UID, value string, then func()) {
	if w.ann == nil {
		if then != nil {
			then()
		}
		return
	}
	w.t.mu.Lock()
	a := &w.t.lifeLocked(uid).annotation
	if a.want == nil {
		w.wanted++
	}
	a.want = &wantedAnnotation{namespace: namespace, name: name, value: value, then: then}
	w.t.mu.Unlock()
	w.queue.Add(uid)
}

// hold defers the writes not yet started until release is called (or
// maxAnnotationHold has passed): a batch of captures (a namespace label's
// running pods) gets the CPU and the API server's cores before the writes
// of its annotations, which then go out paced as always. The ztunnel
// handoff never waits for an annotation, and a pod is annotated enabled
// only once ztunnel acked it, held or not.
func (w *annotationWriter) hold() (release func()) {
	w.t.mu.Lock()
	if w.holds == 0 {
		if now := time.Now(); now.Sub(w.heldUntil) > w.maxHold {
			// Not a continuation of the previous run of holds: a new bound.
			w.heldSince = now
		}
		w.unheld = make(chan struct{})
	}
	w.holds++
	w.t.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			w.t.mu.Lock()
			defer w.t.mu.Unlock()
			if w.holds--; w.holds == 0 {
				w.heldUntil = time.Now()
				close(w.unheld)
			}
		})
	}
}

// waitUnheld returns once no hold is in force, the holds' bound has
// passed, or ctx ends; it reports whether it waited.
func (w *annotationWriter) waitUnheld(ctx context.Context) bool {
	w.t.mu.Lock()
	if w.holds == 0 {
		w.t.mu.Unlock()
		return false
	}
	ch, left := w.unheld, w.maxHold-time.Since(w.heldSince)
	if left <= 0 {
		w.t.mu.Unlock()
		return false
	}
	w.waiting++
	w.t.mu.Unlock()
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
	case <-ctx.Done():
	}
	w.t.mu.Lock()
	w.waiting--
	w.t.mu.Unlock()
	return true
}

// forget drops whatever the pod still wanted written: its sandbox is gone.
func (w *annotationWriter) forget(uid types.UID) {
	w.t.mu.Lock()
	if l := w.t.lives[uid]; l != nil {
		w.dropWantLocked(l)
		l.annotation = podAnnotation{}
		w.t.tidyLocked(l)
	}
	w.notifyIdleLocked()
	w.t.mu.Unlock()
	w.queue.Forget(uid)
}

// forgetWritten drops the value last written on the pod (kept
// otherwise, see doneLocked), so the next write compares with the pod
// cache again; a write still wanted stays. For a pod whose object is
// gone, the wanted write finds it gone and retires itself, running its
// then.
func (w *annotationWriter) forgetWritten(uid types.UID) {
	w.t.mu.Lock()
	defer w.t.mu.Unlock()
	if l := w.t.lives[uid]; l != nil {
		l.annotation.written, l.annotation.hasWritten = "", false
		w.t.tidyLocked(l)
	}
}

// wantLocked is the value the pod wants written, if any. t.mu is held.
func (w *annotationWriter) wantLocked(uid types.UID) *wantedAnnotation {
	if l := w.t.lives[uid]; l != nil {
		return l.annotation.want
	}
	return nil
}

// dropWantLocked retires l's wanted value, if any. t.mu is held.
func (w *annotationWriter) dropWantLocked(l *podLife) {
	if l.annotation.want != nil {
		l.annotation.want = nil
		w.wanted--
	}
}

// pending is how many pods still wait for a write.
func (w *annotationWriter) pending() int {
	w.t.mu.Lock()
	defer w.t.mu.Unlock()
	return w.wanted
}

// flush waits until nothing is left to write, or ctx ends.
func (w *annotationWriter) flush(ctx context.Context) error {
	for {
		w.t.mu.Lock()
		n, ch := w.wanted+w.thens, w.idle
		w.t.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (w *annotationWriter) notifyIdleLocked() {
	if w.wanted == 0 && w.thens == 0 {
		close(w.idle)
		w.idle = make(chan struct{})
	}
}

// run writes until ctx ends; what is still queued then is left to the
// next agent.
func (w *annotationWriter) run(ctx context.Context) {
	var wg sync.WaitGroup
	for range annotationWorkers {
		wg.Go(func() {
			for w.next(ctx) {
			}
		})
	}
	<-ctx.Done()
	w.queue.ShutDown()
	wg.Wait()
}

func (w *annotationWriter) next(ctx context.Context) bool {
	uid, quit := w.queue.Get()
	if quit {
		return false
	}
	defer w.queue.Done(uid)
	w.write(ctx, uid)
	return true
}

// write makes one attempt at the pod's wanted value.
func (w *annotationWriter) write(ctx context.Context, uid types.UID) {
	w.t.mu.Lock()
	want := w.wantLocked(uid)
	if want == nil {
		w.t.mu.Unlock()
		w.queue.Forget(uid)
		return
	}
	a := &w.t.lives[uid].annotation
	have, known := a.written, a.hasWritten
	if !known {
		have, known = w.onObject(want.namespace, want.name, uid)
	}
	if known && have == want.value {
		a.written, a.hasWritten = have, true
		w.doneLocked(uid, want)
		return
	}
	w.t.mu.Unlock()

	if w.waitUnheld(ctx) {
		w.t.mu.Lock()
		stale := w.wantLocked(uid) != want
		w.t.mu.Unlock()
		if stale {
			// Replaced (the queue holds the pod again) or forgotten
			// while held.
			return
		}
	}
	if err := w.limit.Wait(ctx); err != nil {
		// Shutting down: what is still wanted is left to the next agent.
		return
	}
	err := w.ann.SetRedirection(ctx, want.namespace, want.name, uid, want.value)
	gone := apierrors.IsNotFound(err)
	w.t.mu.Lock()
	switch {
	case err == nil:
		a := &w.t.lifeLocked(uid).annotation
		a.written, a.hasWritten = want.value, true
	case gone:
		// Deleted, or replaced by a pod of another UID under the name
		// (the Annotator reports both as NotFound): there is nothing of
		// ours left to mark.
		if l := w.t.lives[uid]; l != nil {
			l.annotation.written, l.annotation.hasWritten = "", false
		}
		w.log.Debug("pod gone; annotation not written", "pod", want.namespace+"/"+want.name, "uid", uid, "value", want.value)
	default:
		w.t.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		w.log.Warn("write redirection annotation; retrying", "pod", want.namespace+"/"+want.name, "uid", uid,
			"value", want.value, "retries", w.queue.NumRequeues(uid), "err", err)
		w.queue.AddRateLimited(uid)
		return
	}
	if w.wantLocked(uid) != want {
		// A newer value came meanwhile (the queue holds the pod again),
		// or the pod was forgotten.
		if l := w.t.lives[uid]; l != nil {
			w.t.tidyLocked(l)
		}
		w.t.mu.Unlock()
		return
	}
	w.doneLocked(uid, want)
}

// doneLocked retires want (the value on the object), the pod's wanted
// value, and runs its then, after unlocking.
func (w *annotationWriter) doneLocked(uid types.UID, want *wantedAnnotation) {
	// written keeps even a removal: the pod cache may still show the old
	// value for a while, and must not be trusted for this pod again.
	l := w.t.lives[uid]
	w.dropWantLocked(l)
	w.t.tidyLocked(l)
	if want.then != nil {
		w.thens++
	}
	w.notifyIdleLocked()
	w.t.mu.Unlock()
	w.queue.Forget(uid)
	if want.then != nil {
		want.then()
		w.t.mu.Lock()
		w.thens--
		w.notifyIdleLocked()
		w.t.mu.Unlock()
	}
}

// onObject reads the value the pod carries from the pod cache, if the
// cache has this very pod. Only a pod this agent has not written yet is
// looked up: for those, the cache is as new as anything the agent knows.
func (w *annotationWriter) onObject(namespace, name string, uid types.UID) (string, bool) {
	if w.pods == nil {
		return "", false
	}
	p, err := w.pods.Pod(namespace, name)
	if err != nil || p == nil || p.UID != uid {
		return "", false
	}
	return p.Annotations[ambient.RedirectionAnnotation], true
}
