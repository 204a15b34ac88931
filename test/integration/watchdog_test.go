package integration

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// slowServer is a ServerHook that holds every answer of the event server
// (before it is sent) while hung, and delays STATUS answers by delay; it
// counts the STATUS requests answered.
type slowServer struct {
	hung     atomic.Bool
	delay    atomic.Int64 // nanoseconds
	statuses atomic.Int32
	release  chan struct{}
}

func newSlowServer(t *testing.T) *slowServer {
	s := &slowServer{release: make(chan struct{})}
	t.Cleanup(s.unhang)
	return s
}

func (s *slowServer) hook(c *nodeagent.ServerConfig) {
	observe := c.Observe
	c.Observe = func(verb, result string, took time.Duration) {
		if verb == "STATUS" {
			time.Sleep(time.Duration(s.delay.Load()))
			s.statuses.Add(1)
		}
		if s.hung.Load() {
			<-s.release
		}
		if observe != nil {
			observe(verb, result, took)
		}
	}
}

// unhang lets the held answers go (once).
func (s *slowServer) unhang() {
	if s.hung.CompareAndSwap(true, false) {
		close(s.release)
	}
}

// probeLive is the chart's liveness probe: install-cni probe live.
func (n *node) probeLive() error {
	var out bytes.Buffer
	err := installcni.ProbeMain([]string{"--agent-socket=" + n.cfg.AgentSocket, "live"}, func(string) string { return "" }, &out, io.Discard)
	if err != nil {
		n.t.Logf("install-cni probe live: %v (%s)", err, strings.TrimSpace(out.String()))
	}
	return err
}

// TestWatchdogExitsHungAgent: an agent whose event server stops answering
// while its debug socket still serves fails liveness (the probe's answer
// names the event server), and its watchdog ends it with one error line
// and a non-nil error (install-cni exits non-zero). The exit is not an
// uninstall: the plugin stays chained for the next agent.
func TestWatchdogExitsHungAgent(t *testing.T) {
	s := newSlowServer(t)
	n := newNode(t, nodeOptions{Upgrade: true, ServerHook: s.hook, WatchdogPeriod: 200 * time.Millisecond})
	if err := n.probeLive(); err != nil {
		t.Fatalf("liveness of a healthy agent: %v", err)
	}
	mark := n.logs.mark()
	n.exitExpected = true
	s.hung.Store(true)

	// Liveness fails, saying why.
	var out bytes.Buffer
	code, err := installcni.AskAgent(context.Background(), n.cfg.Layout(), "/livez", 10*time.Second, &out)
	if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(out.String(), "event-server") {
		t.Errorf("/livez of a hung event server: %d %q, %v; want 503 naming the event server", code, out.String(), err)
	}
	if n.probeLive() == nil {
		t.Error("install-cni probe live passed with the event server hung")
	}

	select {
	case <-n.d.Hung():
	case <-n.exited:
		t.Fatalf("the daemon exited before its watchdog gave up: %v", n.runErr())
	case <-time.After(waitLong):
		t.Fatalf("the watchdog did not give up on a hung event server within %v", waitLong)
	}
	// What hung goes on once the agent is going, so the shutdown is quick
	// (Main bounds it otherwise).
	s.unhang()
	select {
	case <-n.exited:
	case <-time.After(waitLong):
		t.Fatalf("the daemon did not exit within %v of its watchdog giving up", waitLong)
	}
	runErr := n.runErr()
	if runErr == nil || !strings.Contains(runErr.Error(), "did not answer 3 checks in a row") {
		t.Errorf("Run = %v; want the watchdog's error", runErr)
	}
	var errorLines []string
	for _, l := range n.logs.warningsSince(mark) {
		if strings.Contains(l, "level=ERROR") {
			errorLines = append(errorLines, l)
		}
	}
	if len(errorLines) != 1 || !strings.Contains(errorLines[0], "the plugin event server did not answer 3 checks in a row") {
		t.Errorf("want one error line naming the event server, got %d:\n%s", len(errorLines), strings.Join(errorLines, "\n"))
	}
	conf, err := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf))
	if err != nil || !bytes.Contains(conf, []byte(`"`+cnibin.PluginName+`"`)) {
		t.Errorf("after the watchdog's exit the plugin is no longer chained (%v):\n%s", err, conf)
	}
}

// TestWatchdogSlowEventServerStaysUp: an event server that answers
// slowly, within the bound, is alive: liveness passes and the watchdog
// lets the agent run through many checks.
func TestWatchdogSlowEventServerStaysUp(t *testing.T) {
	s := newSlowServer(t)
	n := newNode(t, nodeOptions{ServerHook: s.hook, WatchdogPeriod: 100 * time.Millisecond})
	s.delay.Store(int64(time.Second))
	from := s.statuses.Load()
	for s.statuses.Load() < from+8 {
		if err := n.probeLive(); err != nil {
			t.Fatalf("liveness of a slow but answering agent: %v", err)
		}
		select {
		case <-n.d.Hung():
			t.Fatal("the watchdog gave up on a slow but answering event server")
		case <-n.exited:
			t.Fatalf("the daemon exited: %v", n.runErr())
		default:
		}
	}
}
