package plugin

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

// TestLazyHandler: attributes given with With appear, in order, on the
// records written, and below the level nothing is written.
func TestLazyHandler(t *testing.T) {
	var b bytes.Buffer
	base := slog.New(&lazyHandler{h: slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelInfo})}).With("a", 1)
	l1, l2 := base.With("b", 2), base.With("c", 3)
	l1.Debug("hidden")
	l1.Info("one", "x", "y")
	l2.WithGroup("g").Info("two", "z", 0)
	got := b.String()
	for _, want := range []string{`msg=one a=1 b=2 x=y`, `msg=two a=1 c=3 g.z=0`} {
		if !strings.Contains(got, want) {
			t.Errorf("log %q lacks %q", got, want)
		}
	}
	if strings.Contains(got, "hidden") || strings.Count(got, "\n") != 2 {
		t.Errorf("log %q: want exactly the two records at info", got)
	}
}
