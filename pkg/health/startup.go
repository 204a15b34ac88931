package health

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// Startup follows the agent's start-up step by step, so that liveness can
// tell a start-up that hangs (a deadlock in restore, a cache sync that
// never ends although the API server answers) from one that waits on
// something outside the agent that is unavailable right now (the API
// server at boot). A step that has run longer than Bound fails Check,
// unless what it waits on does not answer now or answered again less than
// Bound ago: then the agent is waiting, not hung, and a restart would only
// add kubelet's back-off to the wait. Create it with NewStartup.
type Startup struct {
	bound time.Duration
	now   func() time.Time
	log   *slog.Logger

	mu sync.Mutex
	// step is the step under way ("" once Done); began is when it began.
	step  string
	began time.Time
	on    *Dependency
	// waited is the last time on did not answer during this step.
	waited time.Time
	// told is what was last logged about the step (toldWaiting,
	// toldHung), so each is logged once per change.
	told int
	done bool
}

// Dependency is something outside the agent a start-up step waits on.
type Dependency struct {
	// Name says what it is, for messages ("the API server").
	Name string
	// Answers returns nil when it is available right now; it gives up
	// when ctx ends (which counts as not available).
	Answers func(ctx context.Context) error
}

// NewStartup returns a tracker whose steps may each run for bound; now is
// the clock (nil: time.Now).
func NewStartup(bound time.Duration, now func() time.Time, log *slog.Logger) *Startup {
	if now == nil {
		now = time.Now
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Startup{bound: bound, now: now, log: log}
}

// Bound is how long one step may run while what it waits on answers.
func (s *Startup) Bound() time.Duration { return s.bound }

// Begin ends the step under way and begins the next: name says what it
// does, on what outside the agent it waits on (nil: nothing).
func (s *Startup) Begin(name string, on *Dependency) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.step, s.began, s.on, s.waited, s.told = name, s.now(), on, time.Time{}, toldNothing
}

// Done ends the start-up: Check passes from now on.
func (s *Startup) Done() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.step, s.on, s.done = "", nil, true
}

// Step is the step under way and when it began ("" once Done or before
// the first Begin).
func (s *Startup) Step() (string, time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.step, s.began
}

// Check is the liveness check: an error naming the step and how long it
// has run once it overran its bound while what it waits on answered.
func (s *Startup) Check(ctx context.Context) error {
	s.mu.Lock()
	step, began, on, done := s.step, s.began, s.on, s.done
	s.mu.Unlock()
	if done || step == "" || s.now().Sub(began) <= s.bound {
		return nil
	}
	// Past the bound, what the step waits on is asked at every check, so
	// the time it last failed to answer is known to the probe's period.
	var err error
	if on != nil {
		err = on.Answers(ctx)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.step != step || !s.began.Equal(began) {
		return nil // the step ended meanwhile
	}
	now := s.now()
	ran := now.Sub(began).Round(time.Second)
	if err != nil {
		s.waited = now
		if s.told != toldWaiting {
			s.told = toldWaiting
			s.log.Warn("a start-up step runs long, waiting on what does not answer: not hung",
				"step", step, "for", ran, "waits_on", on.Name, "err", err)
		}
		return nil
	}
	var hung error
	switch {
	case !s.waited.IsZero() && now.Sub(s.waited) <= s.bound:
		return nil // back only lately: the step gets a whole bound from then
	case !s.waited.IsZero():
		hung = fmt.Errorf("start-up step %q has run for %s, %s of it since %s last failed to answer (bound %s): hung",
			step, ran, now.Sub(s.waited).Round(time.Second), on.Name, s.bound)
	case on != nil:
		hung = fmt.Errorf("start-up step %q has run for %s though %s answers (bound %s): hung", step, ran, on.Name, s.bound)
	default:
		hung = fmt.Errorf("start-up step %q has run for %s, waiting on nothing outside the agent (bound %s): hung", step, ran, s.bound)
	}
	if s.told != toldHung {
		s.told = toldHung
		s.log.Error("start-up is stuck: liveness fails until the step ends, and kubelet restarts the agent", "err", hung)
	}
	return hung
}

// What Check last logged about the step under way.
const (
	toldNothing = iota
	toldWaiting
	toldHung
)
