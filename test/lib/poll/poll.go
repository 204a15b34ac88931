// Package poll waits in unit tests for a condition that another goroutine
// brings about (an informer, a server, a stand-in), polling with a
// generous deadline instead of sleeping a fixed time.
package poll

import (
	"testing"
	"time"
)

// Deadline bounds every wait: only a bug exhausts it, even on a busy
// machine.
const Deadline = 10 * time.Second

// Until polls cond every few milliseconds and fails the test if it does
// not hold within Deadline.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Deadline)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
