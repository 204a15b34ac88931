package nodeagent

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestAnnotationBudget: the annotation writes are paced by a budget of
// their own, the kubelet's 50/s with burst 100 unless configured.
func TestAnnotationBudget(t *testing.T) {
	for _, tc := range []struct {
		qps   float64
		burst int
		want  rate.Limit
		wantB int
	}{
		{0, 0, DefaultAnnotationQPS, DefaultAnnotationBurst},
		{7.5, 15, 7.5, 15},
	} {
		dir := t.TempDir()
		a, err := NewAgent(Config{Rules: newRecordedRules(), Annotator: &fakeAnnotator{}, AnnotationQPS: tc.qps, AnnotationBurst: tc.burst,
			Layout: nodefiles.InDir(dir)})
		if err != nil {
			t.Fatal(err)
		}
		if l := a.annotations.limit; l.Limit() != tc.want || l.Burst() != tc.wantB {
			t.Errorf("configured %v/%d: limit %v burst %d, want %v/%d", tc.qps, tc.burst, l.Limit(), l.Burst(), tc.want, tc.wantB)
		}
	}
}

// startWriter runs an annotation writer with an unlimited budget and the
// given hold bound until the test ends.
func startWriter(t *testing.T, ann *fakeAnnotator, maxHold time.Duration) *annotationWriter {
	t.Helper()
	w := newAnnotationWriter(ann, nil, newLifeTable(), rate.NewLimiter(rate.Inf, 1), slog.New(slog.DiscardHandler))
	w.maxHold = maxHold
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return w
}

func (w *annotationWriter) waitingOnHold() int {
	w.t.mu.Lock()
	defer w.t.mu.Unlock()
	return w.waiting
}

// TestAnnotationHold: while a hold is in force a write waits, and goes out
// once the hold is released; releasing twice is harmless.
func TestAnnotationHold(t *testing.T) {
	ann := &fakeAnnotator{}
	w := startWriter(t, ann, time.Hour)
	release := w.hold()
	w.set("shop", "a", "u-a", "enabled", nil)
	poll.Until(t, "the write waiting on the hold", func() bool { return w.waitingOnHold() == 1 })
	if n := ann.attempts("u-a"); n != 0 {
		t.Fatalf("%d writes while held", n)
	}
	release()
	release()
	poll.Until(t, "the write after the release", func() bool { return ann.history("u-a") == "enabled" })
	// No hold: writes go straight out.
	w.set("shop", "b", "u-b", "enabled", nil)
	poll.Until(t, "an unheld write", func() bool { return ann.history("u-b") == "enabled" })
}

// TestAnnotationHoldIsBounded: a hold never released defers the writes
// only for the bound.
func TestAnnotationHoldIsBounded(t *testing.T) {
	ann := &fakeAnnotator{}
	w := startWriter(t, ann, 50*time.Millisecond)
	_ = w.hold()
	w.set("shop", "a", "u-a", "enabled", nil)
	poll.Until(t, "the write past the bound", func() bool { return ann.history("u-a") == "enabled" })
	// A hold that continues the run of holds gets no new bound.
	release := w.hold()
	defer release()
	w.set("shop", "b", "u-b", "enabled", nil)
	poll.Until(t, "a write under a continued hold", func() bool { return ann.history("u-b") == "enabled" })
}

// TestAnnotationHeldWriteForgotten: a pod forgotten while its write waits
// on a hold is not written.
func TestAnnotationHeldWriteForgotten(t *testing.T) {
	ann := &fakeAnnotator{}
	w := startWriter(t, ann, time.Hour)
	release := w.hold()
	w.set("shop", "a", "u-a", "enabled", nil)
	poll.Until(t, "the write waiting on the hold", func() bool { return w.waitingOnHold() == 1 })
	w.forget("u-a")
	release()
	w.set("shop", "b", "u-b", "enabled", nil)
	poll.Until(t, "the next write", func() bool { return ann.history("u-b") == "enabled" })
	poll.Until(t, "the forgotten write retired", func() bool { return w.waitingOnHold() == 0 && w.queue.Len() == 0 })
	if n := ann.attempts("u-a"); n != 0 {
		t.Errorf("%d writes of a pod forgotten while held", n)
	}
}
