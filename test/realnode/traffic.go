package realnode

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// Flow is TCP traffic from inside a pod's network namespace to an app
// port: the test dials from the pod's netns, so its connections take the
// pod's capture rules (through the ztunnel stand-in when captured).
type Flow struct {
	// Name names the flow in failure messages; Netns is the source pod's
	// netns file; Dst the app to reach.
	Name  string
	Netns string
	Dst   netip.AddrPort
}

// TrafficCounts are a Traffic's counters so far.
type TrafficCounts struct {
	// Held is the number of long-lived connections; Broken how many times
	// one of them failed (reset, closed or timed out) and was dialed
	// again; HeldRequests the requests they carried.
	Held, Broken, HeldRequests int
	// LoopOK and LoopFailed count the request loop's one-request
	// connections.
	LoopOK, LoopFailed int
	// Failures are the failures, each with its time (the first
	// maxFailures; Listed shows the first few).
	Failures []string
}

// Sub returns c minus an earlier reading.
func (c TrafficCounts) Sub(before TrafficCounts) TrafficCounts {
	return TrafficCounts{
		Held: c.Held, Broken: c.Broken - before.Broken, HeldRequests: c.HeldRequests - before.HeldRequests,
		LoopOK: c.LoopOK - before.LoopOK, LoopFailed: c.LoopFailed - before.LoopFailed,
		Failures: c.Failures[min(len(before.Failures), len(c.Failures)):],
	}
}

// Listed shows c's first failures, for a report: at most 20, and how
// many more there were.
func (c TrafficCounts) Listed() string {
	const shown = 20
	if len(c.Failures) <= shown {
		return fmt.Sprint(c.Failures)
	}
	return fmt.Sprintf("%v and %d more", c.Failures[:shown], len(c.Failures)-shown)
}

// maxFailures bounds TrafficCounts.Failures: enough that a late step's
// failures are still listed after an earlier step's (Sub).
const maxFailures = 2000

// Traffic keeps long-lived connections open, each carrying a keep-alive
// request every heldEvery, and runs a loop of one-request connections,
// counting what fails. Stop ends it.
type Traffic struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu sync.Mutex
	c  TrafficCounts
	// answered is, per held connection, when the last request it
	// answered was sent (Settle).
	answered []time.Time
}

const (
	heldEvery = 500 * time.Millisecond
	loopEvery = 200 * time.Millisecond
	// trafficTimeout bounds one request: a proxy that stops forwarding
	// counts as a failure, not a hang.
	trafficTimeout = 10 * time.Second
)

// StartTraffic opens every held flow (failing if one cannot be opened:
// the traffic must start healthy) and starts the request loop over loop.
func StartTraffic(ctx context.Context, held []Flow, loop Flow) (*Traffic, error) {
	conns := make([]net.Conn, 0, len(held))
	for _, f := range held {
		c, err := dialIn(ctx, f)
		if err == nil {
			err = request(c, bufio.NewReader(c), "/held-open")
		}
		if err != nil {
			for _, c := range conns {
				_ = c.Close()
			}
			return nil, fmt.Errorf("open held connection %s: %w", f.Name, err)
		}
		conns = append(conns, c)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t := &Traffic{cancel: cancel, answered: make([]time.Time, len(held))}
	t.c.Held = len(held)
	for i, f := range held {
		t.wg.Add(1)
		go t.hold(ctx, f, conns[i], i) // owner: t; Stop cancels and waits
	}
	t.wg.Add(1)
	go t.loop(ctx, loop) // owner: t; Stop cancels and waits
	return t, nil
}

// Counts returns the counters so far.
func (t *Traffic) Counts() TrafficCounts {
	t.mu.Lock()
	defer t.mu.Unlock()
	c := t.c
	c.Failures = append([]string(nil), t.c.Failures...)
	return c
}

// Stop ends the traffic and returns the final counters.
func (t *Traffic) Stop() TrafficCounts {
	t.cancel()
	t.wg.Wait()
	return t.Counts()
}

func (t *Traffic) fail(what string, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.c.Failures) < maxFailures {
		t.c.Failures = append(t.c.Failures, time.Now().Format("15:04:05.000")+" "+what+": "+err.Error())
	}
}

// hold sends a request over c every heldEvery; when c fails it counts a
// broken connection and dials again until that works.
func (t *Traffic) hold(ctx context.Context, f Flow, c net.Conn, i int) {
	defer t.wg.Done()
	defer func() { _ = c.Close() }()
	br := bufio.NewReader(c)
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(heldEvery):
		}
		sent := time.Now()
		if err := request(c, br, fmt.Sprintf("/held-%d", i)); err != nil {
			if ctx.Err() != nil {
				return
			}
			t.mu.Lock()
			t.c.Broken++
			t.mu.Unlock()
			t.fail("held connection "+f.Name, err)
			_ = c.Close()
			for {
				nc, err := dialIn(ctx, f)
				if err == nil {
					c, br = nc, bufio.NewReader(nc)
					break
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(heldEvery):
				}
			}
			continue
		}
		t.mu.Lock()
		t.c.HeldRequests++
		t.answered[i] = sent
		t.mu.Unlock()
	}
}

// Settle waits until every held connection has answered a request sent
// at or after since, for at most wait. A step under traffic settles
// before it reads its counts: a request in flight when the step ended
// fails only when its deadline passes (trafficTimeout), and that failure
// is the step's, not the next one's.
func (t *Traffic) Settle(ctx context.Context, since time.Time, wait time.Duration) error {
	behind := func() int {
		t.mu.Lock()
		defer t.mu.Unlock()
		n := 0
		for _, a := range t.answered {
			if a.Before(since) {
				n++
			}
		}
		return n
	}
	if err := poll.Wait(ctx, wait, func() bool { return behind() == 0 }); err != nil {
		return fmt.Errorf("%d of %d held connections answered nothing sent since %s: %w", behind(), len(t.answered), since.Format("15:04:05.000"), err)
	}
	return nil
}

// loop makes one request over a new connection every loopEvery.
func (t *Traffic) loop(ctx context.Context, f Flow) {
	defer t.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(loopEvery):
		}
		began := time.Now()
		c, err := dialIn(ctx, f)
		if err == nil {
			// The source names the connection in the stand-in's records
			// (StandInOf): proxied or not, and why; the time taken tells
			// a peer's timeout from a prompt close.
			if err = request(c, bufio.NewReader(c), "/loop"); err != nil {
				err = fmt.Errorf("from %s after %s: %w", c.LocalAddr(), time.Since(began).Round(time.Millisecond), err)
			}
			_ = c.Close()
		}
		if ctx.Err() != nil {
			return
		}
		t.mu.Lock()
		if err != nil {
			t.c.LoopFailed++
		} else {
			t.c.LoopOK++
		}
		t.mu.Unlock()
		if err != nil {
			t.fail("request "+f.Name, err)
		}
	}
}

// dialIn connects to f.Dst from inside f.Netns; the socket stays in that
// namespace.
func dialIn(ctx context.Context, f Flow) (net.Conn, error) {
	var c net.Conn
	err := netns.Do(f.Netns, func() error {
		d := net.Dialer{Timeout: 5 * time.Second}
		var err error
		c, err = d.DialContext(ctx, "tcp", f.Dst.String())
		return err
	})
	return c, err
}

// request sends one keep-alive GET over c and reads the answer.
func request(c net.Conn, br *bufio.Reader, path string) error {
	if err := c.SetDeadline(time.Now().Add(trafficTimeout)); err != nil {
		return err
	}
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: app\r\n\r\n", path); err != nil {
		return err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %s", resp.Status)
	}
	return err
}
