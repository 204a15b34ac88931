package installer

import (
	"time"

	"golang.org/x/time/rate"
)

// rewriteLimit bounds how often the installer rewrites files, so a primary
// CNI that rewrites its config in a loop cannot make us spin with it. A
// pass that finds no token does not wait: it reports how long until one is
// due, and Run schedules the pass again for then.
type rewriteLimit struct{ l *rate.Limiter }

func newRewriteLimit(perSecond float64, burst int) rewriteLimit {
	return rewriteLimit{rate.NewLimiter(rate.Limit(perSecond), burst)}
}

// take consumes one token and returns 0, or returns how long until one is
// available and consumes nothing.
func (r rewriteLimit) take(now time.Time) time.Duration {
	res := r.l.ReserveN(now, 1)
	wait := res.DelayFrom(now)
	if wait == 0 {
		return 0
	}
	res.CancelAt(now)
	return max(wait, time.Millisecond)
}
