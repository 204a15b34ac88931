package app

import (
	"bytes"
	"runtime/pprof"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestNewBuildsOneEventRecorder: New builds one event recorder, the one
// Run starts and stops; a second one, dropped with its broadcaster's
// goroutine running, would be left behind by every App.
func TestNewBuildsOneEventRecorder(t *testing.T) {
	broadcasters := func() int {
		var b bytes.Buffer
		if err := pprof.Lookup("goroutine").WriteTo(&b, 2); err != nil {
			t.Fatal(err)
		}
		return strings.Count(b.String(), "watch.(*Broadcaster).loop")
	}
	before := broadcasters()
	const n = 5
	for range n {
		a := testApp(t)
		a.events.Shutdown() // as the unwind of Run's start does
	}
	if err := poll.Wait(t.Context(), poll.Deadline, func() bool { return broadcasters() <= before }); err != nil {
		t.Errorf("%d Apps built, their event recorders shut down: %d event broadcasters left running (%v)", n, broadcasters()-before, err)
	}
}
