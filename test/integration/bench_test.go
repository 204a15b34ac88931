package integration

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
)

// benchPods is how many running pods the namespace label enrolls at once.
const benchPods = 100

// BenchmarkEnrollRunningNamespace: a namespace with 100 running pods is
// labelled ambient; each iteration measures the time until all 100 are
// annotated enabled (rules, ztunnel ack and annotation done), reported as
// s-to-enabled, and the time until the ztunnel stand-in serves all 100
// (handed to ztunnel), as s-to-ztunnel; and how long an ambient pod takes
// to start (sandbox, chain, capture) idle and while the label enrolls
// (ms-pod-start-idle, ms-pod-start-during). The agent runs in the test process, so its RSS is reported
// as the whole test process's (VmRSS, and the peak VmHWM): an upper bound
// that also holds the test's own clients, the stand-in and the kubelet
// simulator. Run with:
//
//	go test ./test/integration -run '^$' -bench EnrollRunningNamespace -benchtime 1x
func BenchmarkEnrollRunningNamespace(b *testing.B) {
	n := newNode(b, nodeOptions{LogLevel: slog.LevelWarn})
	ctx := context.Background()
	var total, toZtunnel, startIdle, startDuring time.Duration
	iters := 0
	for b.Loop() {
		b.StopTimer()
		ns := n.namespace("bench", nil)
		pods := n.runPods(b, ns, benchPods)

		// An ambient pod started while the label enrolls the running pods
		// must not starve behind them: its start (sandbox, chain and
		// capture) is timed idle and then during the enrollment.
		amb := n.namespace("bench-amb", ambientLabel)
		var ambPods []*kubesim.Pod
		startAmbient := func(name string) time.Duration {
			t0 := time.Now()
			p, err := n.kube.Run(ctx, podSpec(amb, name, nil, nil))
			if err != nil {
				b.Errorf("start ambient pod %s: %v", name, err)
				return 0
			}
			ambPods = append(ambPods, p)
			return time.Since(t0)
		}
		idleStart := (startAmbient("idle-0") + startAmbient("idle-1")) / 2

		scans := counter(b, n.metrics.NetnsScans)
		b.StartTimer()
		start := time.Now()
		// Handed to ztunnel (the stand-in serves every pod) comes well
		// before annotated: the annotations are paced by their budget.
		handed := make(chan time.Duration, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
			defer cancel()
			_ = n.zt.Wait(wctx, func() bool {
				for _, p := range pods {
					if _, ok := n.zt.Workload(string(p.Obj.UID)); !ok {
						return false
					}
				}
				return true
			})
			handed <- time.Since(start)
		}()
		n.setNamespaceMode(ns, ambient.DataplaneModeAmbient)
		during := make(chan time.Duration, 1)
		go func() {
			// Once a tenth of the running pods are served: mid-enrollment.
			_ = n.zt.Wait(ctx, func() bool { return len(n.zt.Workloads()) >= len(ambPods)+benchPods/10 })
			during <- (startAmbient("during-0") + startAmbient("during-1")) / 2
		}()
		deadline := start.Add(3 * time.Minute)
		for {
			list, err := n.env.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				b.Fatal(err)
			}
			enabled := 0
			for _, p := range list.Items {
				if p.Annotations[ambient.RedirectionAnnotation] == ambient.RedirectionEnabled {
					enabled++
				}
			}
			if enabled == benchPods {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("only %d of %d pods enabled after %v", enabled, benchPods, time.Since(start))
			}
			time.Sleep(10 * time.Millisecond)
		}
		took := time.Since(start)
		b.StopTimer()
		total += took
		handedAfter, duringStart := <-handed, <-during
		toZtunnel += handedAfter
		startIdle += idleStart
		startDuring += duringStart
		iters++
		b.Logf("%d running pods handed to ztunnel after %v; an ambient pod starts in %v idle, %v during the enrollment",
			benchPods, handedAfter.Round(time.Millisecond), idleStart.Round(time.Millisecond), duringStart.Round(time.Millisecond))
		st, err := procstat.ReadStatus(os.Getpid(), "VmRSS", "VmHWM")
		if err != nil {
			b.Fatal(err)
		}
		rss, hwm := int(st["VmRSS"]>>10), int(st["VmHWM"]>>10)
		b.Logf("%d running pods enabled %v after the namespace label; test process RSS %d MiB (peak %d MiB)",
			benchPods, took.Round(time.Millisecond), rss/1024, hwm/1024)
		b.ReportMetric(float64(rss)/1024, "MiB-rss")
		b.ReportMetric(float64(hwm)/1024, "MiB-rss-peak")
		b.ReportMetric(counter(b, n.metrics.NetnsScans)-scans, "proc-scans")
		if len(n.zt.Workloads()) < benchPods {
			b.Fatalf("stand-in serves %d workloads, want at least %d", len(n.zt.Workloads()), benchPods)
		}

		var wg sync.WaitGroup
		sem := make(chan struct{}, 4)
		for _, p := range append(pods, ambPods...) {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				if err := n.kube.Delete(ctx, p); err != nil {
					b.Errorf("delete %s: %v", p.Obj.Name, err)
				}
			})
		}
		wg.Wait()
		poll.Within(b, waitLong, "the agent to forget the deleted pods", func() bool { return len(n.d.Agent().Pods()) == 0 })
		b.StartTimer()
	}
	b.ReportMetric(total.Seconds()/float64(iters), "s-to-enabled")
	b.ReportMetric(toZtunnel.Seconds()/float64(iters), "s-to-ztunnel")
	b.ReportMetric(float64(startIdle.Milliseconds())/float64(iters), "ms-pod-start-idle")
	b.ReportMetric(float64(startDuring.Milliseconds())/float64(iters), "ms-pod-start-during")
}

// runPods starts count pods p000... in namespace ns, four at a time (as a
// kubelet starts a batch), and fails tb if any cannot start.
func (n *node) runPods(tb testing.TB, ns string, count int) []*kubesim.Pod {
	tb.Helper()
	ctx := context.Background()
	pods := make([]*kubesim.Pod, count)
	var wg sync.WaitGroup
	errs := make(chan error, count)
	sem := make(chan struct{}, 4)
	for i := range pods {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			p, err := n.kube.Run(ctx, podSpec(ns, fmt.Sprintf("p%03d", i), nil, nil))
			if err != nil {
				errs <- err
				return
			}
			pods[i] = p
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		tb.Fatalf("start pods: %v", err)
	}
	return pods
}
