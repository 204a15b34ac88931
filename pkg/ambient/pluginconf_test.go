package ambient

import (
	"testing"
	"time"
)

// TestHandlerTimeout: the agent gives up a margin before the plugin does,
// and never takes all of a short timeout.
func TestHandlerTimeout(t *testing.T) {
	for in, want := range map[time.Duration]time.Duration{
		DefaultPluginTimeout:    29 * time.Second,
		MaxPluginTimeout:        2*time.Minute - time.Second,
		time.Second:             500 * time.Millisecond,
		1500 * time.Millisecond: 750 * time.Millisecond,
	} {
		if got := HandlerTimeout(in); got != want {
			t.Errorf("HandlerTimeout(%s) = %s, want %s", in, got, want)
		}
	}
}
