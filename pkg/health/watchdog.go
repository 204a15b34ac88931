package health

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Watchdog checks a part of the agent on a period and gives up on the
// process when the part stops answering: Run returns an error after
// Failures checks in a row failed, so that its owner exits and is
// restarted rather than sit half alive. It needs no kubelet probe, so a
// stalled container runtime (which fails exec probes) does not trip it.
type Watchdog struct {
	// Name says what is checked, for the error.
	Name string
	// Check is one bounded proof that the part answers.
	Check LiveCheck
	// Period is the time between checks; Timeout bounds each (default
	// LiveTimeout); Failures is how many failed checks in a row end Run
	// (default 3).
	Period, Timeout time.Duration
	Failures        int
	// Failed, when set, is told each failed check and how many failed in
	// a row so far (the last one ends Run instead).
	Failed func(err error, inARow int)
}

// Run checks until ctx ends (nil) or Failures checks in a row failed.
func (w Watchdog) Run(ctx context.Context) error {
	if w.Check == nil || w.Period <= 0 {
		return errors.New("watchdog: Check and Period are required")
	}
	timeout, limit := w.Timeout, w.Failures
	if timeout <= 0 {
		timeout = LiveTimeout
	}
	if limit <= 0 {
		limit = 3
	}
	t := time.NewTicker(w.Period)
	defer t.Stop()
	failed := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		err := w.Check(cctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return nil
		case err == nil:
			failed = 0
			continue
		}
		failed++
		if failed >= limit {
			return fmt.Errorf("%s did not answer %d checks in a row, %s apart (last: %w); exiting so that the agent is restarted",
				w.Name, failed, w.Period, err)
		}
		if w.Failed != nil {
			w.Failed(err, failed)
		}
	}
}
