package bench

import (
	"bytes"
	"log/slog"
	"testing"
)

// The agent's lines read the same in both log formats.
func TestLogFields(t *testing.T) {
	for _, format := range []string{"text", "json"} {
		var b bytes.Buffer
		var h slog.Handler = slog.NewTextHandler(&b, nil)
		if format == "json" {
			h = slog.NewJSONHandler(&b, nil)
		}
		slog.New(h).Info("rules backend", "backend", "iptables-nft", "note", `a "quoted" value`, "n", 3)
		f := logFields(b.String())
		if f["msg"] != "rules backend" || f["backend"] != "iptables-nft" || f["note"] != `a "quoted" value` || f["n"] != "3" {
			t.Errorf("%s: %q read as %v", format, b.String(), f)
		}
	}
	for _, bad := range []string{"", "not a log line", `msg="unterminated`, "{broken"} {
		if f := logFields(bad); f != nil {
			t.Errorf("%q read as %v, want nil", bad, f)
		}
	}
}
