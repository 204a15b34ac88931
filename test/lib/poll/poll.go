// Package poll waits in tests for a condition that another goroutine or
// process brings about (an informer, a server, a stand-in, the agent),
// polling with a generous deadline instead of sleeping a fixed time.
package poll

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// Deadline bounds every wait of Until: only a bug exhausts it, even on a
// busy machine.
const Deadline = 10 * time.Second

// The interval between two looks grows from first to most: a condition
// that holds soon is seen soon, and a long wait does not spin (a look can
// be an API request).
const (
	first = 5 * time.Millisecond
	most  = 100 * time.Millisecond
)

// Until polls cond and fails the test if it does not hold within Deadline.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Within(t, Deadline, what, cond)
}

// Within polls cond and fails the test if it does not hold within d, for
// a wait that a suite bounds itself (a restart, an API server outage).
func Within(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	if err := Wait(context.Background(), d, cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

// Wait polls cond until it holds, d passes or ctx ends, for code that
// reports instead of failing a test (a harness, a benchmark run). The
// caller's message says what did not happen.
func Wait(ctx context.Context, d time.Duration, cond func() bool) error {
	deadline := time.Now().Add(d)
	every := first
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("gave up after %v", d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(every):
		}
		every = min(2*every, most)
	}
	return nil
}
