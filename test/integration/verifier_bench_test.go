package integration

import (
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// verifierBenchPods is the node's pod count: Kubernetes' default pod
// limit per node.
const verifierBenchPods = 110

// verifierBenchPeriod is the period the benchmark runs the verifier at:
// short, so the rounds it measures take seconds, not minutes. A proof
// costs the same at any period, so the cost is reported per proof and
// scaled to the shipped one-minute period (one proof per pod per minute);
// the detection time is reported as a fraction of the period as well.
const verifierBenchPeriod = 5 * time.Second

// BenchmarkVerifier110Pods measures the verifier on a node with 110
// captured pods: the CPU of one proof (rules, ztunnel's listeners, probe
// set, annotation), reported as CPU per pod per minute and the share of a
// core at the shipped period, and the time from a drift (a probe-set
// entry deleted) to its detection. The CPU is the whole test process's
// and its children's (getrusage) over whole verifier rounds, so it also
// holds the idle agent, the stand-in and the kubelet simulator: an upper
// bound. Run with:
//
//	go test ./test/integration -run '^$' -bench Verifier110Pods -benchtime 1x
func BenchmarkVerifier110Pods(b *testing.B) {
	n := newNode(b, nodeOptions{LogLevel: slog.LevelWarn, VerifyPeriod: verifierBenchPeriod})
	ns := n.namespace("bench", ambientLabel)
	pods := n.runPods(b, ns, verifierBenchPods)
	n.waitEnrolled(3*time.Minute, pods...)
	v := n.d.Verifier()
	// roundAfter waits until every pod has a proof begun after t0.
	roundAfter := func(t0 time.Time) {
		poll.Within(b, waitLong, "a verifier round over every pod", func() bool {
			for _, p := range pods {
				if proof, ok := v.Last(p.Obj.UID); !ok || !proof.At.After(t0) {
					return false
				}
			}
			return true
		})
	}
	roundAfter(time.Now()) // every pod proven once: the annotations settled

	const rounds, samples = 3, 5
	var cpuPerProof, detect time.Duration
	for b.Loop() {
		// Cost: whole rounds of proofs on a healthy node.
		before := cpuTime(b)
		start := time.Now()
		mark := start
		for range rounds {
			roundAfter(mark)
			mark = time.Now()
		}
		cpu := cpuTime(b) - before
		wall := time.Since(start)
		cpuPerProof = cpu / (rounds * verifierBenchPods)
		b.Logf("%d rounds of %d pods: %v CPU over %v wall", rounds, verifierBenchPods, cpu.Round(time.Millisecond), wall.Round(time.Millisecond))
		for _, p := range pods {
			if proof, _ := v.Last(p.Obj.UID); !proof.OK || len(proof.Found) > 0 {
				b.Fatalf("pod %s not proven on a healthy node: %+v", p.Obj.Name, proof)
			}
		}

		// Detection: a random pod's probe-set entry deleted at a random
		// moment of the round.
		detect = 0
		for range samples {
			time.Sleep(rand.N(verifierBenchPeriod))
			p := pods[rand.N(len(pods))]
			t0 := time.Now()
			if err := n.rules.Probe.DelIP(p.Addr(4)); err != nil {
				b.Fatal(err)
			}
			var found time.Time
			poll.Within(b, waitLong, "the drift found", func() bool {
				proof, ok := v.Last(p.Obj.UID)
				found = proof.LastDriftAt
				return ok && found.After(t0)
			})
			detect += found.Sub(t0)
			poll.Within(b, waitLong, "the drift repaired", func() bool { return n.inProbeSet(p) })
		}
		detect /= samples
	}
	perMin := time.Minute / verifier.DefaultPeriod // proofs per pod per minute as shipped
	b.ReportMetric(float64(cpuPerProof*perMin)/float64(time.Millisecond), "cpu-ms/pod/min")
	b.ReportMetric(100*float64(cpuPerProof*verifierBenchPods*perMin)/float64(time.Minute), "%core-110pods")
	b.ReportMetric(detect.Seconds(), "s-to-detect")
	b.ReportMetric(detect.Seconds()/verifierBenchPeriod.Seconds(), "periods-to-detect")
	b.Logf("verifier at the shipped %v period, %d pods: %.3f ms CPU per pod per minute (%.3f%% of a core); drift found %.2f periods after it was made (%v at %v; %v at the shipped period)",
		verifier.DefaultPeriod, verifierBenchPods, float64(cpuPerProof)/float64(time.Millisecond),
		100*float64(cpuPerProof*verifierBenchPods*perMin)/float64(time.Minute),
		detect.Seconds()/verifierBenchPeriod.Seconds(), detect.Round(time.Millisecond), verifierBenchPeriod,
		time.Duration(float64(verifier.DefaultPeriod)*detect.Seconds()/verifierBenchPeriod.Seconds()).Round(time.Second))
}

// cpuTime is the CPU (user and system) the test process and its waited
// children (iptables-save and the like, run by the in-process agent) have
// used.
func cpuTime(tb testing.TB) time.Duration {
	tb.Helper()
	var total time.Duration
	for _, who := range []int{unix.RUSAGE_SELF, unix.RUSAGE_CHILDREN} {
		var ru unix.Rusage
		if err := unix.Getrusage(who, &ru); err != nil {
			tb.Fatal(err)
		}
		total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	return total
}
