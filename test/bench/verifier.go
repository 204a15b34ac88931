package bench

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/scrape"
)

// The verifier's cost: with the enrollment's pods captured and nothing
// changing, the agent's CPU over one whole verifier period (every pod
// proven once), a period after the last capture, is what proving them costs plus what the agent spends
// idle (its host probe resync, metrics, heartbeats). The idle agent's
// CPU is read first, over one period with no pod captured, and taken
// off. It is measured with every pod of the enrollment captured and
// again with verifierNodePods of them (the node's default pod limit; the
// others deleted);
// then one pod's rules are flushed from the host and the drift is timed
// until the agent counts it and until it is repaired.

// verifierNodePods is Kubernetes' default pod limit per node, the count
// the verifier's cost target is set for (under 1 % of a core).
const verifierNodePods = 110

// quickVerifyPeriod is the verifier period of a quick run: a smoke test,
// so drift is found in seconds rather than within the shipped minute.
const quickVerifyPeriod = 10 * time.Second

// VerifierCost is the verifier's steady cost with Pods captured.
type VerifierCost struct {
	Pods int `json:"pods"`
	// PeriodSeconds is the verifier period; the window is one period.
	PeriodSeconds float64 `json:"periodSeconds"`
	WindowSeconds float64 `json:"windowSeconds"`
	// CPUMs is the agent's CPU (own + children) over the window; IdleMs
	// the idle agent's over as long (no pod captured).
	CPUMs  float64 `json:"cpuMs"`
	IdleMs float64 `json:"idleMs"`
	// ChildrenMs is the part of CPUMs in the agent's children
	// (iptables-save and the like: rules read in full).
	ChildrenMs float64 `json:"childrenMs"`
	// CPUMsPerPodMinute is CPUMs less IdleMs, per pod per minute of
	// window: the verifier's.
	CPUMsPerPodMinute float64 `json:"cpuMsPerPodMinute"`
	// CorePct is the verifier's share of one core over the window.
	CorePct float64 `json:"corePct"`
	// APIRequests the agent made in the window (watches apart): none is
	// the promise.
	APIRequests int `json:"apiRequests"`
}

// VerifierDrift is one pod's rules flushed from the host, and after how
// long the agent's drift counter moved and the rules were back.
type VerifierDrift struct {
	PeriodSeconds float64 `json:"periodSeconds"`
	DetectSeconds float64 `json:"detectSeconds"`
	RepairSeconds float64 `json:"repairSeconds"`
	// APIRequests are the agent's requests from the flush to the repair
	// (the Warning Event).
	APIRequests map[string]int `json:"apiRequests,omitempty"`
}

// verifyPeriod is the agent's verifier period, from its environment.
func (r *backendRun) verifyPeriod() (time.Duration, error) {
	v, ok := r.agentEnv[installcni.EnvName("verify-period")]
	if !ok || v == "" {
		return verifier.DefaultPeriod, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("agent's verify-period %q: %w", v, err)
	}
	if d <= 0 {
		return 0, errors.New("the agent runs without the verifier (verify-period 0)")
	}
	return d, nil
}

// verifierFigures measures the verifier on node's captured pods: its cost
// with all of them and with r.sz.nodePods, then the time to find and
// repair a pod's flushed rules. It deletes pods to get to r.sz.nodePods.
func (r *backendRun) verifierFigures(ctx context.Context, node *enrollNode, idle time.Duration) error {
	period, err := r.verifyPeriod()
	if err != nil {
		return err
	}
	idlePerSecond := idle.Seconds() / period.Seconds() // CPU seconds a second
	counts := []int{len(node.running)}
	if len(node.running) > r.sz.nodePods {
		counts = append(counts, r.sz.nodePods)
	}
	for _, n := range counts {
		if len(node.running) > n {
			r.logf("deleting %d of the %d running pods, to measure the verifier with %d", len(node.running)-n, len(node.running), n)
			if err := deletePods(ctx, node.kube, node.running[n:]); err != nil {
				return fmt.Errorf("delete pods: %w", err)
			}
			node.running = node.running[:n]
		}
		c, err := r.verifierCost(ctx, n, period, idlePerSecond)
		if err != nil {
			return err
		}
		r.res.Verifier = append(r.res.Verifier, c)
		r.logf("verifier with %d captured pods: %.1f ms agent CPU over one %v period (%.1f ms in its children; idle agent: %.1f ms): %.3f ms per pod per minute, %.2f%% of a core; %d API requests",
			n, c.CPUMs, period, c.ChildrenMs, c.IdleMs, c.CPUMsPerPodMinute, c.CorePct, c.APIRequests)
		if c.APIRequests > 0 {
			return fmt.Errorf("the agent made %d API requests over a verifier period with nothing drifted", c.APIRequests)
		}
	}
	d, err := r.verifierDrift(ctx, node, period)
	if err != nil {
		return err
	}
	r.res.VerifierDrift = d
	r.logf("verifier: one pod's rules flushed from the host: drift counted after %.2f s, rules back after %.2f s (period %v)", d.DetectSeconds, d.RepairSeconds, period)
	return nil
}

// idleCPU reads the settled agent's CPU over one verifier period, with no
// pod captured: what it spends whatever the verifier does.
func (r *backendRun) idleCPU(ctx context.Context) (time.Duration, error) {
	period, err := r.verifyPeriod()
	if err != nil {
		return 0, err
	}
	if err := r.settle(ctx); err != nil {
		return 0, err
	}
	cpu0, err := procstat.ReadCPU(r.pid())
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := sleep(ctx, period); err != nil {
		return 0, err
	}
	cpu1, err := procstat.ReadCPU(r.pid())
	if err != nil {
		return 0, err
	}
	// Scaled to exactly one period.
	idle := time.Duration(float64(cpu1.Sub(cpu0).Total()) * period.Seconds() / time.Since(start).Seconds())
	r.logf("idle agent, no pod captured: %.1f ms CPU over one %v verifier period", ms(idle), period)
	return idle, nil
}

// verifierCost reads the agent's CPU and API requests over one period on
// a settled agent with n pods captured; idlePerSecond is the idle agent's
// CPU seconds per second, taken off.
func (r *backendRun) verifierCost(ctx context.Context, n int, period time.Duration, idlePerSecond float64) (VerifierCost, error) {
	// Every pod's first proof after its capture reads its rules in full
	// (no clean verify yet whose generation to compare with): two
	// iptables-save runs with iptables, a cost of the capture rather
	// than of the steady verifier. One period first, so the window holds
	// proofs by generation only, and what the deletions left is done; a
	// quick run's figures are produced, not read, and skip it.
	if !r.o.Quick {
		if err := sleep(ctx, period); err != nil {
			return VerifierCost{}, err
		}
	}
	if err := r.settle(ctx); err != nil {
		return VerifierCost{}, err
	}
	cpu0, err := procstat.ReadCPU(r.pid())
	if err != nil {
		return VerifierCost{}, err
	}
	mark, err := r.auditLog.mark()
	if err != nil {
		return VerifierCost{}, err
	}
	start := time.Now()
	if err := sleep(ctx, period); err != nil {
		return VerifierCost{}, err
	}
	cpu1, err := procstat.ReadCPU(r.pid())
	if err != nil {
		return VerifierCost{}, err
	}
	took := time.Since(start)
	reqs := r.auditLog.since(mark)
	used := cpu1.Sub(cpu0)
	cpu := ms(used.Total())
	idle := 1000 * idlePerSecond * took.Seconds()
	own := max(cpu-idle, 0)
	return VerifierCost{
		Pods: n, PeriodSeconds: period.Seconds(), WindowSeconds: took.Seconds(), CPUMs: cpu, ChildrenMs: ms(used.Children), IdleMs: idle,
		CPUMsPerPodMinute: own / float64(n) / took.Minutes(),
		CorePct:           100 * own / float64(took.Milliseconds()),
		APIRequests:       len(reqs),
	}, nil
}

// driftMetric counts the drift the verifier found, every kind.
const driftMetric = "ambient_cni_verify_drift_total"

// unprovenMetric is how many pods are not proven now.
const unprovenMetric = "ambient_cni_pods_unproven"

// verifierDrift flushes the first running pod's netfilter rules from the
// host (nft flush ruleset in its namespace: both backends keep them in
// nf_tables here) and times the agent's drift counter and the repair.
func (r *backendRun) verifierDrift(ctx context.Context, node *enrollNode, period time.Duration) (*VerifierDrift, error) {
	if len(node.running) == 0 {
		return nil, errors.New("no running pod to tamper with")
	}
	if strings.Contains(r.res.Detected, "legacy") {
		return nil, errors.New("the pod's rules are iptables-legacy's: nft flush ruleset cannot tamper with them")
	}
	if err := r.settle(ctx); err != nil {
		return nil, err
	}
	nsPath := node.running[0].NS.Path()
	before, err := scrape.Sum(r.metricsURL, driftMetric)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", driftMetric, err)
	}
	ours := func() (bool, error) {
		out, err := exec.CommandContext(ctx, "nsenter", "--net="+nsPath, "nft", "list", "ruleset").CombinedOutput()
		if err != nil {
			return false, fmt.Errorf("nft list ruleset in %s: %v: %s", nsPath, err, out)
		}
		return strings.Contains(strings.ToLower(string(out)), "istio"), nil
	}
	if ok, err := ours(); err != nil || !ok {
		return nil, fmt.Errorf("the pod's rules are not in nf_tables before the flush (%v)", err)
	}
	mark, err := r.auditLog.mark()
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	if out, err := exec.CommandContext(ctx, "nsenter", "--net="+nsPath, "nft", "flush", "ruleset").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("flush the pod's rules: %v: %s", err, out)
	}
	// Found within a period, plus the proof's own time; three periods
	// leave a loaded machine room.
	deadline := t0.Add(3*period + 30*time.Second)
	d := &VerifierDrift{PeriodSeconds: period.Seconds()}
	back, unproven := false, -1.0
	for d.DetectSeconds == 0 || d.RepairSeconds == 0 {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("a pod's flushed rules: drift counted after %.1f s, repaired after %.1f s (0: not by %v); last seen: rules back %v, %s %v",
				d.DetectSeconds, d.RepairSeconds, deadline.Sub(t0).Round(time.Second), back, unprovenMetric, unproven)
		}
		if err := sleep(ctx, 50*time.Millisecond); err != nil {
			return nil, err
		}
		now := time.Since(t0).Seconds()
		if d.DetectSeconds == 0 {
			if v, err := scrape.Sum(r.metricsURL, driftMetric); err == nil && v > before {
				d.DetectSeconds = now
			}
			continue
		}
		if back, err = ours(); err != nil {
			return nil, err
		}
		vals, err := scrape.Values(r.metricsURL, unprovenMetric)
		v, ok := vals[unprovenMetric]
		if err != nil || !ok {
			continue // a gauge not shown is not 0
		}
		if unproven = v; back && unproven == 0 {
			d.RepairSeconds = now
		}
	}
	d.APIRequests = summarize(r.auditLog.since(mark))
	return d, nil
}
