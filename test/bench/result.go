package bench

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Result is one `make bench` run; it is written as JSON.
type Result struct {
	Started  time.Time `json:"started"`
	Seconds  float64   `json:"seconds"`
	Quick    bool      `json:"quick"`
	Profiled bool      `json:"profiled"`
	Commit   string    `json:"commit"`
	// WorkDir held the run's files; it is removed at the end.
	WorkDir string  `json:"workDir"`
	Machine Machine `json:"machine"`
	Plugin  Plugin  `json:"plugin"`
	// AgentEnv is the environment install-cni ran with (the chart's, with
	// the NodeLocal settings of the first backend's node).
	AgentEnv map[string]string `json:"agentEnv"`
	// NodeLocal is the list of settings the benchmark changed, and why.
	NodeLocal map[string]string `json:"nodeLocal"`
	// Method states how the latency figures were measured.
	Method   string          `json:"method"`
	Backends []BackendResult `json:"backends"`
	// Peers are Istio's istio-cni runs (its iptables and native nftables
	// modes), measured by the same harness in the same run.
	Peers []BackendResult `json:"peers,omitempty"`
	// Starts is what interleaving the systems' reps cost: every system
	// is started and stopped once per rep.
	Starts StartCost `json:"starts"`
}

// StartCost sums the systems' starts (to ready and settled) and their
// stops between reps.
type StartCost struct {
	Starts       int     `json:"starts"`
	StartSeconds float64 `json:"startSeconds"`
	StopSeconds  float64 `json:"stopSeconds"`
}

// String is the one line the run prints about it.
func (c StartCost) String() string {
	return fmt.Sprintf("interleaving: %d system starts took %.0f s to ready and settled, the stops between reps %.0f s", c.Starts, c.StartSeconds, c.StopSeconds)
}

// Machine describes where and under what load the run happened.
type Machine struct {
	CPUs      int        `json:"cpus"`
	Kernel    string     `json:"kernel"`
	Go        string     `json:"go"`
	LoadStart [3]float64 `json:"loadStart"`
	LoadEnd   [3]float64 `json:"loadEnd"`
}

// Plugin holds the plugin binary's figures.
type Plugin struct {
	Path      string  `json:"path"`
	SizeBytes int64   `json:"sizeBytes"`
	ExecRuns  int     `json:"execRuns"`
	ExecP50Ms float64 `json:"execP50Ms"`
	ExecP99Ms float64 `json:"execP99Ms"`
}

// BackendResult holds one rules backend's figures.
type BackendResult struct {
	Name        string `json:"name"`
	Selector    string `json:"selector,omitempty"`
	Unavailable string `json:"unavailable,omitempty"`
	// Detected is the backend the agent said it uses (its log).
	Detected string `json:"detected,omitempty"`
	Node     string `json:"node,omitempty"`
	// AgentPID was install-cni's process (gone after the run).
	AgentPID  int       `json:"agentPid,omitempty"`
	Latency   []Latency `json:"latency,omitempty"`
	Enroll    []Enroll  `json:"enroll,omitempty"`
	RSSIdleMB float64   `json:"rssIdleMiB,omitempty"`
	// RSSPodsMB is VmRSS right after RSSPods running pods were enrolled.
	RSSPodsMB float64 `json:"rssPodsMiB,omitempty"`
	RSSPods   int     `json:"rssPods,omitempty"`
	// MemoryIdle and MemoryPods break the two RSS figures down.
	MemoryIdle Memory `json:"memoryIdle"`
	MemoryPods Memory `json:"memoryPods"`
	// KubeClientQPS and KubeClientBurst are the client-side rate limit the
	// agent ran with (AgentEnv, else install-cni's default).
	KubeClientQPS   float64 `json:"kubeClientQPS"`
	KubeClientBurst int     `json:"kubeClientBurst"`
	// AgentAddMeanMs is the agent's own mean time per ADD (its
	// cni_add_duration_seconds histogram), the rest of the ADD being the
	// plugin's exec and the chain.
	AgentAddMeanMs float64 `json:"agentAddMeanMs"`
	// Plugin is a peer's plugin figures (ours: Result.Plugin).
	Plugin *Plugin `json:"plugin,omitempty"`
	// AgentEnv is a peer's whole environment (ours: Result.AgentEnv).
	AgentEnv map[string]string `json:"agentEnv,omitempty"`
	// Profiles are perf report files written for this backend.
	Profiles []string `json:"profiles,omitempty"`
	// StartSeconds and StopSeconds are each start's time to ready and
	// settled, and each stop's, one per rep.
	StartSeconds []float64 `json:"startSeconds,omitempty"`
	StopSeconds  []float64 `json:"stopSeconds,omitempty"`
	// Verifier is the verifier's steady cost with the enrollment's pods
	// captured and with verifierNodePods of them; VerifierDrift the time
	// to find and repair one pod's flushed rules (ours only).
	Verifier      []VerifierCost `json:"verifier,omitempty"`
	VerifierDrift *VerifierDrift `json:"verifierDrift,omitempty"`
	Error         string         `json:"error,omitempty"`
}

// Latency is one (pod kind, op, concurrency) measurement.
type Latency struct {
	Kind        string `json:"kind"` // "ambient" or "non-ambient"
	Op          string `json:"op"`   // "ADD" or "DEL"
	Concurrency int    `json:"concurrency"`
	Samples     int    `json:"samples"`
	Errors      int    `json:"errors"`
	// Reps blocks of PodsPerBlock pods ran per arm; Blocks say in which
	// order and on how quiet a machine.
	Reps         int     `json:"reps"`
	PodsPerBlock int     `json:"podsPerBlock"`
	Blocks       []Block `json:"blocks,omitempty"`
	// Chain* are the bridge + host-local chain alone; P* with our plugin.
	ChainP50Ms float64 `json:"chainP50Ms"`
	ChainP99Ms float64 `json:"chainP99Ms"`
	P50Ms      float64 `json:"p50Ms"`
	P99Ms      float64 `json:"p99Ms"`
	DeltaP50Ms float64 `json:"deltaP50Ms"`
	DeltaP99Ms float64 `json:"deltaP99Ms"`
	// CPU of the agent (own + children) and its API requests over the
	// op's window (Pod objects created or deleted, calls, settling), per
	// pod with our plugin.
	CPUMsPerPod    float64        `json:"cpuMsPerPod"`
	OwnCPUMsPerPod float64        `json:"ownCpuMsPerPod"`
	APIPerPod      float64        `json:"apiRequestsPerPod"`
	APIRequests    map[string]int `json:"apiRequests"`
	// APIServerMs is the API server's mean time per agent request.
	APIServerMs   float64 `json:"apiServerMeanMs"`
	WindowSeconds float64 `json:"windowSeconds"`
	// ChainedMs and ChainMs are every sample, with and without our plugin.
	ChainedMs []float64 `json:"chainedMs"`
	ChainMs   []float64 `json:"chainMs"`
}

// Enroll is one namespace flip over running pods.
type Enroll struct {
	Pods     int     `json:"pods"`
	Seconds  float64 `json:"seconds"`
	MsPerPod float64 `json:"msPerPod"`
	// CPUMsPerPod is the agent's CPU (own + children) over the flip and
	// its settling, per pod; OwnCPUMsPerPod its own alone.
	CPUMsPerPod    float64        `json:"cpuMsPerPod"`
	OwnCPUMsPerPod float64        `json:"ownCpuMsPerPod"`
	APIPerPod      float64        `json:"apiRequestsPerPod"`
	APIRequests    map[string]int `json:"apiRequests"`
	APIServerMs    float64        `json:"apiServerMeanMs"`
	// APIPerSecond is the agent's request rate over the flip: at the
	// client-side limit, throttling is what bounds the enrollment.
	APIPerSecond float64 `json:"apiRequestsPerSecond"`
	// Running is how many pods ran on the node at the flip.
	Running int `json:"runningPods"`
	// CapturedSeconds is how long until every pod was served by the
	// ztunnel stand-in (rules in place, ztunnel acked): the dataplane's
	// part, which the annotation writes then follow.
	CapturedSeconds float64 `json:"capturedSeconds"`
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func (b *BackendResult) latency(kind, op string, c int) *Latency {
	for i := range b.Latency {
		if l := &b.Latency[i]; l.Kind == kind && l.Op == op && l.Concurrency == c {
			return l
		}
	}
	return nil
}

// targets are the performance floor's (docs/performance.md), for
// comparison in the table; they are printed, never asserted.
var targets = map[string]string{
	"ambient ADD, 1 at a time":     "Δp50 ≤ 4, Δp99 ≤ 8",
	"ambient ADD, 8 at a time":     "Δp50 ≤ 20, Δp99 ≤ 40",
	"ambient DEL, 1 at a time":     "Δp50 ≤ 2.5",
	"non-ambient ADD, 1 at a time": "Δp50 ≤ 2.5",
	"enroll-small":                 "per pod flat from 100 to 500",
	"enroll-large":                 "served by ztunnel ≤ 1 s, per pod flat",
	"cpu":                          "ADD ≤ 1.5 (nftables)",
	"cpu enroll":                   "≤ 1.5 (nftables)",
	"rss":                          "≤ 25 / ≤ 35",
	"api ambient":                  "≤ 1 / 0",
	"plugin":                       "exec ≤ 1.5 ms",
	// Under 1 % of a core with 110 pods: 600 ms a minute, 5.45 per pod.
	"verifier":       "≤ 5.4 (< 1 %), no API request",
	"verifier drift": "counted within one period",
}

// WriteTable prints the one table of a run.
func (r *Result) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "ambient-cni bench %s, commit %s%s: %d CPUs, load %.1f %.1f %.1f at start, %.1f %.1f %.1f at end; %.0f s\n",
		r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.Commit, map[bool]string{true: " (BENCH_QUICK: few samples)"}[r.Quick],
		r.Machine.CPUs, r.Machine.LoadStart[0], r.Machine.LoadStart[1], r.Machine.LoadStart[2],
		r.Machine.LoadEnd[0], r.Machine.LoadEnd[1], r.Machine.LoadEnd[2], r.Seconds)
	if r.Method != "" {
		fmt.Fprintf(w, "method: %s\n", r.Method)
	}
	if r.Starts.Starts > 0 {
		fmt.Fprintln(w, r.Starts)
	}
	for _, b := range append(slices.Clone(r.Backends), r.Peers...) {
		if q := b.quietSummary(); q != "" {
			fmt.Fprintf(w, "%s: %s\n", b.Name, q)
		}
	}
	if r.Profiled {
		fmt.Fprintln(w, "PROFILED RUN: perf was attached to the agent; CPU and latency figures are inflated")
	}
	header := []string{"figure (ms over the bridge + host-local chain alone unless said)"}
	cols := append(slices.Clone(r.Backends), r.Peers...)
	for _, b := range cols {
		name := b.Name
		if b.Detected != "" {
			name += " (" + b.Detected + ")"
		}
		header = append(header, name)
	}
	ours := 0 // the column ratios are taken against: the shipped backend
	peers := r.Peers
	if len(r.Backends) == 0 {
		peers = nil
	}
	for _, p := range peers {
		header = append(header, p.Name+" ÷ "+r.Backends[ours].Name)
	}
	header = append(header, "target")
	rows := [][]string{header}
	row := func(label, target string, cell func(b *BackendResult) string) {
		line := []string{label}
		for i := range cols {
			b := &cols[i]
			switch c := cell(b); {
			case b.Unavailable != "":
				line = append(line, "n/a")
			case c == "" && b.Error != "":
				line = append(line, "failed")
			case c == "":
				line = append(line, "-")
			default:
				line = append(line, c)
			}
		}
		for i := range peers {
			line = append(line, ratioCell(line[1+len(r.Backends)+i], line[1+ours]))
		}
		rows = append(rows, append(line, target))
	}
	for _, kind := range []string{"ambient", "non-ambient"} {
		for _, op := range []string{"ADD", "DEL"} {
			for _, c := range []int{1, 8} {
				label := fmt.Sprintf("%s %s, %d at a time: Δp50 / Δp99", kind, op, c)
				row(label, targets[fmt.Sprintf("%s %s, %d at a time", kind, op, c)], func(b *BackendResult) string {
					l := b.latency(kind, op, c)
					if l == nil {
						return ""
					}
					s := fmt.Sprintf("%+.1f / %+.1f", l.DeltaP50Ms, l.DeltaP99Ms)
					if l.Errors > 0 {
						s += fmt.Sprintf(" (%d failed)", l.Errors)
					}
					return s
				})
			}
		}
	}
	for _, op := range []string{"ADD", "DEL"} {
		for _, c := range []int{1, 8} {
			row(fmt.Sprintf("bridge + host-local alone: %s p50 / p99, %d at a time (ms, absolute)", op, c), "", func(b *BackendResult) string {
				l := b.latency("ambient", op, c)
				if l == nil {
					return ""
				}
				return fmt.Sprintf("%.1f / %.1f", l.ChainP50Ms, l.ChainP99Ms)
			})
		}
	}
	for i, key := range []string{"enroll-small", "enroll-large"} {
		label := "enroll running pods (label → all enabled): s (ms per pod); all served by ztunnel: s"
		for _, b := range r.Backends {
			if i < len(b.Enroll) {
				label = fmt.Sprintf("enroll %d running pods (label → all enabled): s (ms per pod); all served by ztunnel: s", b.Enroll[i].Pods)
				break
			}
		}
		row(label, targets[key], func(b *BackendResult) string {
			if i >= len(b.Enroll) {
				return ""
			}
			e := b.Enroll[i]
			return fmt.Sprintf("%.2f (%.1f); %.2f", e.Seconds, e.MsPerPod, e.CapturedSeconds)
		})
	}
	row("agent CPU per ambient ADD / DEL (own + children; own alone): ms", targets["cpu"], func(b *BackendResult) string {
		a, d := b.latency("ambient", "ADD", 1), b.latency("ambient", "DEL", 1)
		if a == nil || d == nil {
			return ""
		}
		return fmt.Sprintf("%.1f / %.1f (%.1f / %.1f)", a.CPUMsPerPod, d.CPUMsPerPod, a.OwnCPUMsPerPod, d.OwnCPUMsPerPod)
	})
	cpuLabel := "agent CPU per enrolled pod, largest flip (own + children; own alone): ms"
	for _, b := range cols {
		if len(b.Enroll) > 0 {
			cpuLabel = fmt.Sprintf("agent CPU per enrolled pod, %d running pods (own + children; own alone): ms", b.Enroll[len(b.Enroll)-1].Pods)
			break
		}
	}
	row(cpuLabel, targets["cpu enroll"], func(b *BackendResult) string {
		if len(b.Enroll) == 0 {
			return ""
		}
		e := b.Enroll[len(b.Enroll)-1]
		return fmt.Sprintf("%.2f (%.2f)", e.CPUMsPerPod, e.OwnCPUMsPerPod)
	})
	row("agent RSS idle / with the enrolled pods: MiB", targets["rss"], func(b *BackendResult) string {
		if b.RSSIdleMB == 0 {
			return ""
		}
		if b.RSSPods == 0 {
			return fmt.Sprintf("%.1f / -", b.RSSIdleMB)
		}
		return fmt.Sprintf("%.1f / %.1f (%d pods)", b.RSSIdleMB, b.RSSPodsMB, b.RSSPods)
	})
	for _, kind := range []string{"ambient", "non-ambient"} {
		target := ""
		if kind == "ambient" {
			target = targets["api ambient"]
		}
		row(fmt.Sprintf("API requests per %s ADD / DEL", kind), target, func(b *BackendResult) string {
			a, d := b.latency(kind, "ADD", 1), b.latency(kind, "DEL", 1)
			if a == nil || d == nil {
				return ""
			}
			return fmt.Sprintf("%.2f / %.2f", a.APIPerPod, d.APIPerPod)
		})
	}
	rounds := 0
	for _, b := range cols {
		rounds = max(rounds, len(b.Verifier))
	}
	for i := range rounds {
		label := "verifier, captured pods: agent CPU per pod per minute: ms (share of a core)"
		target := ""
		for _, b := range cols {
			if i < len(b.Verifier) {
				label = fmt.Sprintf("verifier, %d captured pods: agent CPU per pod per minute, idle agent's taken off: ms (share of a core)", b.Verifier[i].Pods)
				if b.Verifier[i].Pods == verifierNodePods {
					target = targets["verifier"]
				}
				break
			}
		}
		row(label, target, func(b *BackendResult) string {
			if i >= len(b.Verifier) {
				return ""
			}
			v := b.Verifier[i]
			return fmt.Sprintf("%.3f (%.2f%%)", v.CPUMsPerPodMinute, v.CorePct)
		})
	}
	row("verifier: one pod's rules flushed from the host → drift counted / repaired: s", targets["verifier drift"], func(b *BackendResult) string {
		if b.VerifierDrift == nil {
			return ""
		}
		return fmt.Sprintf("%.1f / %.1f (period %.0f s)", b.VerifierDrift.DetectSeconds, b.VerifierDrift.RepairSeconds, b.VerifierDrift.PeriodSeconds)
	})
	row("plugin binary size / exec (CNI VERSION) p50: MiB / ms", targets["plugin"], func(b *BackendResult) string {
		p := &r.Plugin
		if b.Plugin != nil {
			p = b.Plugin
		}
		if p.ExecRuns == 0 && p.SizeBytes == 0 {
			return ""
		}
		return fmt.Sprintf("%.2f MiB / %.2f ms", float64(p.SizeBytes)/(1<<20), p.ExecP50Ms)
	})
	writeMarkdown(w, rows)
	for i, b := range cols {
		switch {
		case b.Unavailable != "":
			fmt.Fprintf(w, "%s: n/a: %s\n", b.Name, b.Unavailable)
		case b.Error != "":
			fmt.Fprintf(w, "%s: FAILED: %s\n", b.Name, b.Error)
		default:
			line := fmt.Sprintf("%s: agent's own mean time per ambient ADD %.1f ms; client limit %g/s burst %d", b.Name, b.AgentAddMeanMs, b.KubeClientQPS, b.KubeClientBurst)
			if i >= len(r.Backends) {
				line = fmt.Sprintf("%s: API requests count install-cni's and its plugin's (one ServiceAccount); client limit %g/s burst %d (its own)", b.Name, b.KubeClientQPS, b.KubeClientBurst)
			}
			for _, e := range b.Enroll {
				line += fmt.Sprintf("; enroll %d: %.0f API requests/s", e.Pods, e.APIPerSecond)
			}
			fmt.Fprintln(w, line)
		}
	}
	return nil
}

// ratioCell divides the numbers of a peer's cell by those of ours, pair
// by pair ("+72.6 / +213.7" over "+12.9 / +16.4" is "5.6× / 13.0×"), up to
// a parenthesis; a pair whose divisor is not positive has no ratio.
func ratioCell(peer, ours string) string {
	nums := func(s string) []float64 {
		s, _, _ = strings.Cut(s, "(")
		var out []float64
		for f := range strings.FieldsSeq(s) {
			if v, err := strconv.ParseFloat(strings.TrimSuffix(f, ";"), 64); err == nil {
				out = append(out, v)
			}
		}
		return out
	}
	p, o := nums(peer), nums(ours)
	if len(p) == 0 || len(p) != len(o) {
		return "-"
	}
	var parts []string
	for i := range p {
		if o[i] <= 0 || p[i] < 0 {
			parts = append(parts, "-")
			continue
		}
		parts = append(parts, fmt.Sprintf("%.1f×", p[i]/o[i]))
	}
	return strings.Join(parts, " / ")
}

// quietSummary says how many of the backend's latency blocks started on a
// quiet machine, and the load range they saw.
func (b *BackendResult) quietSummary() string {
	n, quiet := 0, 0
	lo, hi := 0.0, 0.0
	for _, l := range b.Latency {
		if l.Op != "ADD" {
			continue // ADD and DEL share their blocks
		}
		for _, bl := range l.Blocks {
			if n == 0 || bl.Load1 < lo {
				lo = bl.Load1
			}
			hi = max(hi, bl.Load1)
			n++
			if bl.Quiet {
				quiet++
			}
		}
	}
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("%d of %d latency blocks started on a quiet machine (the rest after the bounded wait); one-minute load %.1f–%.1f at their starts", quiet, n, lo, hi)
}

// failed reports whether any backend that ran failed.
func (r *Result) failed() []string {
	var out []string
	for _, b := range r.Backends {
		if b.Error != "" {
			out = append(out, b.Name+": "+b.Error)
		}
	}
	return out
}

// String is the table, for logs.
func (r *Result) String() string {
	var b strings.Builder
	_ = r.WriteTable(&b)
	return b.String()
}

// writeMarkdown prints rows (the first is the header) as a Markdown table
// with padded columns, readable in a terminal and pasteable into docs.
func writeMarkdown(w io.Writer, rows [][]string) {
	width := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			width[i] = max(width[i], utf8.RuneCountInString(c))
		}
	}
	line := func(cells []string) {
		var b strings.Builder
		for i, c := range cells {
			b.WriteString("| " + c + strings.Repeat(" ", width[i]-utf8.RuneCountInString(c)) + " ")
		}
		fmt.Fprintln(w, b.String()+"|")
	}
	line(rows[0])
	sep := make([]string, len(width))
	for i, n := range width {
		sep[i] = strings.Repeat("-", n)
	}
	line(sep)
	for _, r := range rows[1:] {
		line(r)
	}
}
