package integration

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
)

// BenchmarkCapturePhases breaks the agent's part of an ambient CNI ADD
// into its phases (the debug-level "capture timings": the event server's
// read and decode, decision and netns open, then the capture's prepare,
// capture record, in-pod rules, host probe set and ztunnel handoff, which
// for a new pod is what is left of the ack's wait once the rules are in,
// and the reply), for pods
// started one at a time and eight at a time through the real plugin
// binary, with the chart's settings and the backend it chooses. It logs
// the median and p90 of each phase, and the CPU time per pod started of
// this process (the agent, the stand-in and the harness) and of the API
// server, over the starts; docs/performance.md carries the figures. Run
// with:
//
//	go test ./test/integration -run '^$' -bench CapturePhases -benchtime 1x
func BenchmarkCapturePhases(b *testing.B) {
	rec := &phaseRecorder{}
	n := newNode(b, nodeOptions{LogLevel: slog.LevelWarn, AgentHook: func(c *nodeagent.Config) {
		c.Logger = slog.New(&multiHandler{rec: rec, next: c.Logger.Handler()})
	}})
	ctx := context.Background()
	for b.Loop() {
		for _, conc := range []int{1, 8} {
			ns := n.namespace(fmt.Sprintf("phases-c%d", conc), ambientLabel)
			rec.reset()
			self0, api0 := readCPU(b, os.Getpid()), readCPU(b, n.env.APIServerPid())
			var wg sync.WaitGroup
			sem := make(chan struct{}, conc)
			pods := make([]*kubesim.Pod, 48)
			for i := range pods {
				wg.Go(func() {
					sem <- struct{}{}
					defer func() { <-sem }()
					p, err := n.kube.Run(ctx, podSpec(ns, fmt.Sprintf("p%02d", i), nil, nil))
					if err != nil {
						b.Errorf("start pod: %v", err)
						return
					}
					pods[i] = p
				})
			}
			wg.Wait()
			self, api := readCPU(b, os.Getpid()).Sub(self0), readCPU(b, n.env.APIServerPid()).Sub(api0)
			b.Logf("%d at a time, %d captures:\n%s  cpu per pod: this process %.2f ms (its children %.2f), kube-apiserver %.2f ms",
				conc, rec.count(), rec.summary(), ms(self.Own)/float64(len(pods)), ms(self.Children)/float64(len(pods)), ms(api.Own)/float64(len(pods)))
			for _, p := range pods {
				if p != nil {
					if err := n.kube.Delete(ctx, p); err != nil {
						b.Errorf("delete: %v", err)
					}
				}
			}
		}
	}
}

func readCPU(b *testing.B, pid int) procstat.CPUTimes {
	c, err := procstat.ReadCPU(pid)
	if err != nil {
		b.Fatalf("cpu time of pid %d: %v", pid, err)
	}
	return c
}

// multiHandler sends records to the recorder at every level and to the
// harness's handler at its own.
type multiHandler struct {
	rec  *phaseRecorder
	next slog.Handler
}

func (m *multiHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l == slog.LevelDebug || m.next.Enabled(ctx, l)
}

func (m *multiHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "capture timings" {
		m.rec.add(r)
	}
	if m.next.Enabled(ctx, r.Level) {
		return m.next.Handle(ctx, r)
	}
	return nil
}

func (m *multiHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &multiHandler{rec: m.rec, next: m.next.WithAttrs(as)}
}

func (m *multiHandler) WithGroup(g string) slog.Handler {
	return &multiHandler{rec: m.rec, next: m.next.WithGroup(g)}
}

// phaseRecorder collects the durations of each phase.
type phaseRecorder struct {
	mu     sync.Mutex
	order  []string
	phases map[string][]time.Duration
	n      int
}

func (p *phaseRecorder) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.order, p.phases, p.n = nil, map[string][]time.Duration{}, 0
}

func (p *phaseRecorder) add(r slog.Record) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n++
	r.Attrs(func(a slog.Attr) bool {
		if a.Value.Kind() == slog.KindDuration {
			if _, ok := p.phases[a.Key]; !ok {
				p.order = append(p.order, a.Key)
			}
			p.phases[a.Key] = append(p.phases[a.Key], a.Value.Duration())
		}
		return true
	})
}

func (p *phaseRecorder) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

func (p *phaseRecorder) summary() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, k := range p.order {
		d := slices.Clone(p.phases[k])
		slices.Sort(d)
		fmt.Fprintf(&b, "  %-8s p50 %6.2f ms  p90 %6.2f ms\n", k, ms(d[len(d)/2]), ms(d[len(d)*9/10]))
	}
	return b.String()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
