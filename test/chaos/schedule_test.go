package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// churnEvent is one step of a fault schedule: a flip of the flip
// namespace's label, or a fault.
type churnEvent struct {
	at    time.Duration
	fault bool
}

// faultSchedule draws a churn's events, in time order: faults at random
// in [1s, 1s+faultSpan), and a flip every flipMin plus up to flipSpread
// until d, half of them followed within 400 ms by a fault (while the
// flip's captures or releases are under way: the moments a fault can
// leave a pod half done).
func faultSchedule(rng *rand.Rand, faults int, faultSpan, d, flipMin, flipSpread time.Duration) []churnEvent {
	var events []churnEvent
	for range faults {
		events = append(events, churnEvent{at: time.Second + time.Duration(rng.Int64N(int64(faultSpan))), fault: true})
	}
	for at := time.Duration(0); ; {
		at += flipMin + time.Duration(rng.Int64N(int64(flipSpread)))
		if at >= d {
			break
		}
		events = append(events, churnEvent{at: at})
		if rng.IntN(2) == 0 {
			events = append(events, churnEvent{at: at + time.Duration(rng.Int64N(int64(400*time.Millisecond))), fault: true})
		}
	}
	sort.Slice(events, func(i, j int) bool { return events[i].at < events[j].at })
	return events
}

// play runs events from start: a flip toggles the flip namespace's
// dataplane-mode label, a fault calls fault, which logs what it did with
// say. It returns the log, each line stamped with its time since start.
func (w *world) play(ctx context.Context, t *testing.T, start time.Time, events []churnEvent, flip string, fault func(say func(format string, args ...any))) []string {
	t.Helper()
	var log []string
	say := func(format string, args ...any) {
		log = append(log, fmt.Sprintf("%5.1fs ", time.Since(start).Seconds())+fmt.Sprintf(format, args...))
	}
	for _, ev := range events {
		time.Sleep(time.Until(start.Add(ev.at))) // the schedule's time, not a wait for anything
		if ev.fault {
			fault(say)
			continue
		}
		next := ambient.DataplaneModeAmbient
		if w.modeOf(flip) == next {
			next = ""
		}
		if err := w.setMode(ctx, flip, next); err != nil {
			t.Fatal(err)
		}
		say("flip -> %q", next)
	}
	return log
}
