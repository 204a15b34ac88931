package health

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock is a settable clock for Startup.
type fakeClock struct{ t atomic.Int64 }

func (c *fakeClock) now() time.Time          { return time.Unix(0, c.t.Load()) }
func (c *fakeClock) advance(d time.Duration) { c.t.Add(int64(d)) }
func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.t.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *fakeClock) startup(b time.Duration) *Startup { return NewStartup(b, c.now, nil) }

// dependency is a Dependency whose availability the test sets.
func dependency(down *atomic.Bool, asked *atomic.Int32) *Dependency {
	return &Dependency{Name: "the API server", Answers: func(context.Context) error {
		asked.Add(1)
		if down.Load() {
			return errors.New("connection refused")
		}
		return nil
	}}
}

// TestStartupStepOverrunFails: a step that runs past its bound, waiting on
// nothing outside the agent, fails the check, naming the step and how long
// it ran; the next step gets a whole bound, and Done ends the checks.
func TestStartupStepOverrunFails(t *testing.T) {
	c := newFakeClock()
	s := c.startup(time.Minute)
	ctx := context.Background()
	if err := s.Check(ctx); err != nil {
		t.Fatalf("before the first step: %v", err)
	}
	s.Begin("restore", nil)
	c.advance(time.Minute)
	if err := s.Check(ctx); err != nil {
		t.Fatalf("at the bound: %v", err)
	}
	c.advance(30 * time.Second)
	err := s.Check(ctx)
	if err == nil || !strings.Contains(err.Error(), `start-up step "restore" has run for 1m30s`) || !strings.Contains(err.Error(), "nothing outside the agent") {
		t.Fatalf("past the bound: %v; want the step and how long it ran", err)
	}
	s.Begin("listen", nil)
	if err := s.Check(ctx); err != nil {
		t.Fatalf("a new step: %v", err)
	}
	c.advance(2 * time.Minute)
	if s.Check(ctx) == nil {
		t.Fatal("the new step overran and passed")
	}
	s.Done()
	if err := s.Check(ctx); err != nil {
		t.Fatalf("after Done: %v", err)
	}
}

// TestStartupWaitingIsNotHung: a step past its bound passes while what it
// waits on does not answer, however long; once it answers again, the step
// gets a whole bound from the last check that found it unavailable, then
// fails saying so. What it waits on is asked only past the bound.
func TestStartupWaitingIsNotHung(t *testing.T) {
	c := newFakeClock()
	s := c.startup(time.Minute)
	ctx := context.Background()
	var down atomic.Bool
	var asked atomic.Int32
	down.Store(true)
	s.Begin("pod cache sync", dependency(&down, &asked))
	for range 6 * 30 { // half an hour, a check every 10 s
		c.advance(10 * time.Second)
		if err := s.Check(ctx); err != nil {
			t.Fatalf("waiting on an API server that does not answer: %v", err)
		}
	}
	if n := asked.Load(); n != 6*30-6 {
		t.Errorf("the API server was asked %d times; want once per check past the bound (%d)", n, 6*30-6)
	}
	down.Store(false)
	for range 6 {
		c.advance(10 * time.Second)
		if err := s.Check(ctx); err != nil {
			t.Fatalf("within a bound of the API server's return: %v", err)
		}
	}
	c.advance(10 * time.Second)
	err := s.Check(ctx)
	if err == nil || !strings.Contains(err.Error(), `start-up step "pod cache sync" has run for 31m10s, 1m10s of it since the API server last failed to answer`) {
		t.Fatalf("a bound after the API server's return: %v", err)
	}
}

// TestStartupDependencyAnswersFromStart: a step whose dependency answers
// all along fails once past its bound, saying it answers.
func TestStartupDependencyAnswersFromStart(t *testing.T) {
	c := newFakeClock()
	s := c.startup(time.Minute)
	var down atomic.Bool
	var asked atomic.Int32
	s.Begin("pod cache sync", dependency(&down, &asked))
	c.advance(time.Minute + time.Second)
	err := s.Check(context.Background())
	if err == nil || !strings.Contains(err.Error(), "though the API server answers") {
		t.Fatalf("got %v; want a failure saying the API server answers", err)
	}
}
