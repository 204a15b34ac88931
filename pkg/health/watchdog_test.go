package health

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestLivezRunsLiveChecks: /livez and /healthz fail while a liveness
// check fails, and a check that hangs is cut off at LiveTimeout and
// reported, within the time the exec probe waits.
func TestLivezRunsLiveChecks(t *testing.T) {
	s := New()
	var mode atomic.Int32 // 0 answers, 1 fails, 2 hangs until its ctx ends
	s.AddLiveCheck("event-server", func(ctx context.Context) error {
		switch mode.Load() {
		case 1:
			return errors.New("connection refused")
		case 2:
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	})
	// Readiness has nothing to do with liveness.
	s.AddCheck("restore", func() error { return errors.New("not done") })
	url := serveTCP(t, s.Handler())
	for _, path := range []string{"/livez", "/healthz"} {
		if code, body := get(t, url+path); code != http.StatusOK {
			t.Errorf("%s answering: %d %q", path, code, body)
		}
	}
	mode.Store(1)
	if code, body := get(t, url+"/livez"); code != http.StatusServiceUnavailable || !strings.Contains(body, "event-server: connection refused") {
		t.Errorf("/livez failing: %d %q", code, body)
	}
	mode.Store(2)
	code, body := get(t, url+"/healthz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "event-server: context deadline exceeded") {
		t.Errorf("/healthz hanging: %d %q", code, body)
	}
	mode.Store(0)
	if code, _ := get(t, url+"/livez"); code != http.StatusOK {
		t.Errorf("/livez answering again: %d", code)
	}
}

// runWatchdog runs w until it returns, or fails the test after a minute.
func runWatchdog(t *testing.T, ctx context.Context, w Watchdog) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		t.Fatal("watchdog did not return")
		return nil
	}
}

// TestWatchdogTrips: Failures failed checks in a row end Run with an error
// naming the part and the last failure; a check that hangs fails at its
// Timeout; an answer in between starts the count again.
func TestWatchdogTrips(t *testing.T) {
	var calls atomic.Int32
	var told []int
	err := runWatchdog(t, context.Background(), Watchdog{
		Name: "the event server", Period: time.Millisecond, Timeout: 10 * time.Millisecond, Failures: 3,
		Check: func(ctx context.Context) error {
			switch n := calls.Add(1); {
			case n == 3:
				return nil // breaks the first run of failures
			case n%2 == 0:
				<-ctx.Done() // hangs
				return ctx.Err()
			}
			return errors.New("connection refused")
		},
		Failed: func(_ error, inARow int) { told = append(told, inARow) },
	})
	if err == nil || !strings.Contains(err.Error(), "the event server did not answer 3 checks in a row") {
		t.Fatalf("Run = %v", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) && !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("the error does not carry the last failure: %v", err)
	}
	// Checks 1, 2 fail, 3 answers, 4, 5, 6 fail: the sixth trips.
	if n := calls.Load(); n != 6 {
		t.Errorf("%d checks, want 6", n)
	}
	if got := told; len(got) != 4 || got[0] != 1 || got[1] != 2 || got[2] != 1 || got[3] != 2 {
		t.Errorf("Failed told %v, want [1 2 1 2]", got)
	}
}

// TestWatchdogSlowButAnswering: checks that answer slowly, within the
// Timeout, never trip it; Run returns nil when ctx ends.
func TestWatchdogSlowButAnswering(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int32
	err := runWatchdog(t, ctx, Watchdog{
		Name: "the event server", Period: time.Millisecond, Timeout: time.Minute, Failures: 1,
		Check: func(ctx context.Context) error {
			if calls.Add(1) == 20 {
				cancel()
			}
			time.Sleep(5 * time.Millisecond) // a slow answer
			return nil
		},
	})
	if err != nil {
		t.Errorf("Run = %v, want nil once ctx ended", err)
	}
	if n := calls.Load(); n < 20 {
		t.Errorf("%d checks", n)
	}
}

// TestWatchdogNeedsCheck: a watchdog without a check or a period refuses
// to run instead of spinning or never checking.
func TestWatchdogNeedsCheck(t *testing.T) {
	if err := (Watchdog{Period: time.Second}).Run(context.Background()); err == nil {
		t.Error("no Check: Run = nil")
	}
	if err := (Watchdog{Check: func(context.Context) error { return nil }}).Run(context.Background()); err == nil {
		t.Error("no Period: Run = nil")
	}
}
