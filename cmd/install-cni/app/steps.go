package app

import (
	"context"
	"errors"

	"github.com/ambient-cni/ambient-cni/pkg/health"
)

// step is one named step of a lifecycle list (startSteps, upgradeSteps,
// uninstallSteps).
type step struct {
	// name says what the step does, in the words the docs use (the
	// start-up's liveness names the step it is in by it).
	name string
	do   func(ctx context.Context) error
	// undo takes back what do did, when a later step of the list fails;
	// nil when there is nothing to take back. Undos that the stop also
	// runs (stopping the components) must be safe to run twice.
	undo func()
	// goOn: a failure is kept (joined into the list's error) and the
	// next step runs, nothing is undone. An uninstall's steps are all
	// such: each leaves the node in a state a kill may leave it in, and
	// taking one back (chaining the plugin again) would be less safe
	// than going on.
	goOn bool
	// live: start-up liveness follows the step (health.Startup), which
	// may run a bound while waitsOn (if set) answers.
	live    bool
	waitsOn *health.Dependency
}

// errStopRequested is what a start step returns when the process is told
// to stop while the step waits: not a failure (nothing is undone); Run
// stops the agent as it stops one that serves.
var errStopRequested = errors.New("stop requested during the start-up")

// runSteps runs steps in order, calling begin (if set) before each. When
// step k fails (and is not goOn) the undos of steps k-1…1 run, in
// reverse, and nothing else: its error is returned with an unwind that
// does nothing. Otherwise unwind runs every done step's undo in reverse
// (the caller's last act); with errStopRequested it covers the steps done
// before.
func runSteps(ctx context.Context, steps []step, begin func(step)) (unwind func(), err error) {
	var kept []error
	for k, s := range steps {
		if begin != nil {
			begin(s)
		}
		err := s.do(ctx)
		switch {
		case err == nil:
		case s.goOn && !errors.Is(err, errStopRequested):
			kept = append(kept, err)
		case errors.Is(err, errStopRequested):
			return undoer(steps[:k]), errors.Join(append(kept, err)...)
		default:
			undoer(steps[:k])()
			return func() {}, errors.Join(append(kept, err)...)
		}
	}
	return undoer(steps), errors.Join(kept...)
}

// undoer runs the undos of done in reverse.
func undoer(done []step) func() {
	return func() {
		for i := len(done) - 1; i >= 0; i-- {
			if u := done[i].undo; u != nil {
				u()
			}
		}
	}
}

// stepNames lists the names of steps, in order (docs tests).
func stepNames(steps []step) []string {
	out := make([]string, len(steps))
	for i, s := range steps {
		out[i] = s.name
	}
	return out
}
