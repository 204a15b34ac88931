package installer

import (
	"testing"
	"time"
)

func TestRewriteLimit(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newRewriteLimit(2, 3)
	for i := range 3 {
		if w := b.take(t0); w != 0 {
			t.Fatalf("take %d within burst waited %v", i, w)
		}
	}
	w := b.take(t0)
	if w < 400*time.Millisecond || w > 500*time.Millisecond {
		t.Fatalf("empty bucket wait %v, want ~500ms", w)
	}
	if w := b.take(t0.Add(500 * time.Millisecond)); w != 0 {
		t.Fatalf("refilled token not granted, wait %v", w)
	}
	// A long idle period refills only up to the burst.
	later := t0.Add(time.Hour)
	granted := 0
	for b.take(later) == 0 {
		granted++
	}
	if granted != 3 {
		t.Fatalf("after idle granted %d, want burst 3", granted)
	}
}
