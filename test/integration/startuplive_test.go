package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// testStartupBound is the start-up step bound of these tests (the shipped
// one, a minute, is pinned by TestStartupStepBoundShipped).
const testStartupBound = 500 * time.Millisecond

// livez is the agent's /livez as kubelet's exec probe asks it: the
// status code and the answer (code 0: the debug socket did not answer).
func (n *node) livez() (int, string) {
	var out bytes.Buffer
	code, err := installcni.AskAgent(context.Background(), n.cfg.Layout(), "/livez", 10*time.Second, &out)
	if err != nil {
		return 0, err.Error()
	}
	return code, out.String()
}

// waitDebugSocket waits until the agent's debug socket answers.
func (n *node) waitDebugSocket() {
	n.t.Helper()
	poll.Within(n.t, waitLong, "the agent's debug socket", func() bool { code, _ := n.livez(); return code != 0 })
}

// isPodsListWatch is the pod cache's list (or watch) of this node's pods.
func isPodsListWatch(r *http.Request) bool {
	return r.Method == http.MethodGet && r.URL.Path == "/api/v1/pods"
}

// TestStartupStuckIsNotLive: an agent whose start-up hangs in a step
// while the API server answers (here the pod cache's list of the node's
// pods never returns, everything else is served) fails liveness once the
// step overran its bound, naming the step and for how long it ran; the
// agent is not hung, only waiting, once the step ends: it becomes ready
// and live.
func TestStartupStuckIsNotLive(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	unhang := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unhang)
	var held atomic.Int32
	n := newNode(t, nodeOptions{NoWaitReady: true, StartupStepBound: testStartupBound,
		AgentTransport: func(rt http.RoundTripper) http.RoundTripper {
			return roundTripFunc(func(r *http.Request) (*http.Response, error) {
				if isPodsListWatch(r) {
					held.Add(1)
					select {
					case <-release:
					case <-r.Context().Done():
						return nil, r.Context().Err()
					}
				}
				return rt.RoundTrip(r)
			})
		}})
	n.waitDebugSocket()
	var answer string
	poll.Within(t, waitLong, "liveness to fail with the start-up stuck in the pod cache sync", func() bool {
		code, body := n.livez()
		answer = body
		return code == http.StatusServiceUnavailable
	})
	if !strings.Contains(answer, `start-up step "pod cache sync" has run for`) || !strings.Contains(answer, "though the API server answers") {
		t.Errorf("/livez of a stuck start-up: %q; want the step, how long it ran, and that the API server answers", answer)
	}
	if held.Load() == 0 {
		t.Fatal("the pod list was never asked: the start-up was not stuck where the test holds it")
	}
	if n.probeLive() == nil {
		t.Error("install-cni probe live passed with the start-up stuck")
	}

	unhang()
	poll.Within(t, waitLong, "the agent to be ready once the pod list returns", func() bool { return len(n.d.Ready()) == 0 })
	if err := n.probeLive(); err != nil {
		t.Errorf("liveness once the start-up ended: %v", err)
	}
}

// TestStartupWaitingForAPIServerIsLive: an agent that starts while the
// API server does not answer it (every request refused, as at a boot
// before the API server's address is reachable) waits: liveness passes
// through many of its step bounds (the agent logs that it is waiting,
// not hung), and once the API server answers the agent becomes ready and
// stays live.
func TestStartupWaitingForAPIServerIsLive(t *testing.T) {
	var down atomic.Bool
	down.Store(true)
	var refused atomic.Int32
	n := newNode(t, nodeOptions{NoWaitReady: true, StartupStepBound: testStartupBound,
		AgentTransport: func(rt http.RoundTripper) http.RoundTripper {
			return roundTripFunc(func(r *http.Request) (*http.Response, error) {
				if down.Load() {
					refused.Add(1)
					return nil, &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connect: connection refused")}
				}
				return rt.RoundTrip(r)
			})
		}})
	n.waitDebugSocket()
	start := time.Now()
	var failed string
	poll.Within(t, waitLong, "many step bounds of waiting for the API server", func() bool {
		if code, body := n.livez(); code != http.StatusOK {
			failed = fmt.Sprintf("/livez while the API server does not answer, %v into the start-up: %d %q", time.Since(start).Round(time.Millisecond), code, body)
			return true
		}
		if len(n.d.Ready()) == 0 {
			failed = "the agent is ready without the API server"
			return true
		}
		waiting := false
		for _, l := range n.logs.warningsSince(0) {
			waiting = waiting || (strings.Contains(l, "waiting on what does not answer: not hung") && strings.Contains(l, `step="pod cache sync"`))
		}
		return waiting && time.Since(start) >= 10*testStartupBound
	})
	if failed != "" {
		t.Fatal(failed)
	}
	if refused.Load() == 0 {
		t.Fatal("the agent asked the API server nothing")
	}

	down.Store(false)
	poll.Within(t, waitLong, "the agent to be ready once the API server answers", func() bool { return len(n.d.Ready()) == 0 })
	if err := n.probeLive(); err != nil {
		t.Errorf("liveness once ready: %v", err)
	}
}

// hangingVerify is a rules applier whose Verify (what the startup restore
// proves each captured pod's rules with) blocks while hung: a deadlock in
// the restore, which waits on nothing outside the agent.
type hangingVerify struct {
	ruleset.Applier
	hung    atomic.Bool
	release chan struct{}
	held    atomic.Int32
}

func (h *hangingVerify) Verify(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, error) {
	if h.hung.Load() {
		h.held.Add(1)
		<-h.release
	}
	return h.Applier.Verify(netnsPath, cfg)
}

// TestStartupStuckInRestoreIsNotLive: an agent restarted on a node with
// a captured pod, whose startup restore hangs (the pod's rules are never
// proven), fails liveness once the restore overran its bound, saying it
// waits on nothing outside the agent; the API server answers throughout.
func TestStartupStuckInRestoreIsNotLive(t *testing.T) {
	h := &hangingVerify{release: make(chan struct{})}
	var once sync.Once
	n := newNode(t, nodeOptions{Upgrade: true, StartupStepBound: testStartupBound,
		AgentHook: func(c *nodeagent.Config) { h.Applier = c.Rules; c.Rules = h }})
	t.Cleanup(func() { once.Do(func() { close(h.release) }) }) // before the daemon stops
	p := n.runPod(podSpec(n.namespace("shop", ambientLabel), "p", nil, nil))
	n.waitEnrolled(waitLong, p)

	n.stopDaemon()
	h.hung.Store(true)
	n.opts.NoWaitReady = true
	n.startDaemon()
	n.waitDebugSocket()
	var answer string
	poll.Within(t, waitLong, "liveness to fail with the startup restore stuck", func() bool {
		code, body := n.livez()
		answer = body
		return code == http.StatusServiceUnavailable
	})
	if !strings.Contains(answer, `start-up step "restore of the pods captured before" has run for`) || !strings.Contains(answer, "waiting on nothing outside the agent") {
		t.Errorf("/livez of a stuck restore: %q; want the step, how long it ran, and that it waits on nothing outside the agent", answer)
	}
	if h.held.Load() == 0 {
		t.Fatal("the restore never proved the pod's rules: the start-up was not stuck where the test holds it")
	}
}
