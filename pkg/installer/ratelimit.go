package installer

import (
	"math"
	"time"
)

// tokenBucket bounds how often the installer rewrites files, so a primary
// CNI that rewrites its config in a loop cannot make us spin with it. Not
// safe for concurrent use; the Installer's mutex guards it.
type tokenBucket struct {
	rate   float64 // tokens per second
	burst  float64
	tokens float64
	last   time.Time
}

func newTokenBucket(rate float64, burst int, now time.Time) *tokenBucket {
	return &tokenBucket{rate: rate, burst: float64(burst), tokens: float64(burst), last: now}
}

// take consumes one token and returns 0, or returns how long until one is
// available and consumes nothing.
func (b *tokenBucket) take(now time.Time) time.Duration {
	if el := now.Sub(b.last).Seconds(); el > 0 {
		b.tokens = math.Min(b.burst, b.tokens+el*b.rate)
	}
	b.last = now
	if b.tokens >= 1 {
		b.tokens--
		return 0
	}
	wait := time.Duration((1 - b.tokens) / b.rate * float64(time.Second))
	return max(wait, time.Millisecond)
}
