package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/scrape"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// Options configure Run.
type Options struct {
	// RepoRoot is the repository (chart, shipped manifest).
	RepoRoot string
	// InstallCNI and Plugin are the shipped binaries (make build).
	InstallCNI, Plugin string
	// Quick runs few samples and small enrollments: a smoke test of the
	// harness, not figures.
	Quick bool
	// Profile attaches perf to the agent during the sequential ambient ADD
	// and the large enrollment and writes its reports to ProfileDir.
	Profile    bool
	ProfileDir string
	// IstioInstallCNI, IstioPlugin and IstioChart are Istio's binaries
	// and chart for the peer column (IstioBinaries); IstioMissing, when
	// set, says why they are not there, and the peer is reported n/a.
	IstioInstallCNI, IstioPlugin, IstioChart, IstioMissing string
	// Log receives progress lines.
	Log io.Writer
}

// sizes are how many pods each phase uses.
type sizes struct {
	seq, conc int   // latency pods per kind and block at 1 and 8 at a time
	reps      int   // blocks per arm (baseline, measured) of each latency figure
	enroll    []int // running pods per namespace flip, small then large
	// nodePods is the verifier's second count of captured pods, reached
	// by deleting the others.
	nodePods int
	execRuns int
	// quietWait bounds the wait for a quiet machine before each block.
	quietWait time.Duration
}

func (o Options) sizes() sizes {
	if o.Quick {
		// Half the pods deleted before the drift: a smoke run goes the
		// full run's way.
		return sizes{seq: 2, conc: 8, reps: 2, enroll: []int{4, 12}, nodePods: 8, execRuns: 10}
	}
	return sizes{seq: 34, conc: 32, reps: 3, enroll: []int{100, 500}, nodePods: verifierNodePods, execRuns: 100, quietWait: 10 * time.Second}
}

// peers are the istio-cni runs: a quick run keeps the smoke test short
// with its default (iptables) mode alone.
func (o Options) peers() []Peer {
	if o.Quick {
		return Peers()[:1]
	}
	return Peers()
}

// quietBusyPct is the share of the machine's CPUs at or under which a
// second counts as quiet.
const quietBusyPct = 25

// Method states how the latency figures are measured (printed with the
// table and recorded in the JSON).
func (s sizes) method() string {
	return fmt.Sprintf("latency: the bridge + host-local chain alone (baseline) and the chain with the plugin (measured) run as separate blocks "+
		"at the same concurrency, %d blocks each, alternating (the order flips every rep); %d / %d pods per block at 1 / 8 at a time; "+
		"the systems' reps interleave: rep after rep, every system in turn (the order rotating every rep) is started, runs one rep of every figure and is stopped, "+
		"its enrollment once after its last rep; "+
		"each block starts on a settled agent after waiting up to %s for a second with ≤ %d%% of the CPUs busy; Δ = measured quantile − baseline quantile over all blocks",
		s.reps, s.seq, s.conc, s.quietWait, quietBusyPct)
}

const (
	// agentNamespace is where the shipped RBAC is bound, as the chart does.
	agentNamespace = simnode.ReleaseNamespace
)

// Run runs the benchmark. It must run as root, in a network namespace of
// its own (see testnet.ProgramInOwnNetns): it creates a bridge, network namespaces and
// netfilter rules there, and the API server listens on its loopback.
func Run(ctx context.Context, o Options) (res *Result, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the benchmark creates network namespaces, veths and netfilter rules: run it as root")
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	logf := func(format string, args ...any) { fmt.Fprintf(o.Log, format+"\n", args...) }
	for _, p := range []string{o.InstallCNI, o.Plugin} {
		if st, err := os.Stat(p); err != nil || st.IsDir() {
			return nil, fmt.Errorf("shipped binary %s missing (make build): %v", p, err)
		}
	}
	for _, c := range []string{"iptables-save", "iptables-restore", "ip6tables-restore", "nsenter", "sleep"} {
		if _, err := exec.LookPath(c); err != nil {
			return nil, fmt.Errorf("%s not found: as root, make deps installs the packages the tests need", c)
		}
	}
	if o.Profile {
		if _, err := exec.LookPath("perf"); err != nil {
			return nil, errors.New("profiling needs perf (Debian: linux-perf)")
		}
	}
	sz := o.sizes()
	res = &Result{
		Started: time.Now(), Quick: o.Quick, Profiled: o.Profile, Commit: commit(o.RepoRoot),
		Machine:   Machine{CPUs: runtime.NumCPU(), Kernel: kernel(), Go: runtime.Version(), LoadStart: procstat.LoadAvg()},
		NodeLocal: simnode.NodeLocal, Method: sz.method(),
	}
	defer func() {
		res.Machine.LoadEnd = procstat.LoadAvg()
		res.Seconds = time.Since(res.Started).Seconds()
	}()

	shipped, err := simnode.RenderChart(ctx, o.RepoRoot)
	if err != nil {
		return nil, err
	}
	if res.Plugin, err = pluginFigures(o.Plugin, sz.execRuns); err != nil {
		return nil, err
	}
	logf("plugin %s: %.2f MiB, exec p50 %.2f ms", o.Plugin, float64(res.Plugin.SizeBytes)/(1<<20), res.Plugin.ExecP50Ms)

	// A short directory: socket paths must fit in sun_path.
	work, err := os.MkdirTemp("", "abench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	res.WorkDir = work

	logf("building the reference CNI plugins (containernetworking/plugins %s)", cnibin.PluginsVersion)
	cniPaths, _, err := cnibin.Build()
	if err != nil {
		return nil, err
	}

	user := fmt.Sprintf("system:serviceaccount:%s:%s", agentNamespace, shipped.ServiceAccount)
	policy, auditPath := filepath.Join(work, "audit-policy.yaml"), filepath.Join(work, "audit.log")
	if err := os.WriteFile(policy, []byte(auditPolicy(user, istioUser)), 0o600); err != nil {
		return nil, err
	}
	logf("starting etcd and kube-apiserver")
	env, err := kubeenv.Launch(ctx, kubeenv.Options{Dir: filepath.Join(work, "kube"), APIServerArgs: auditArgs(policy, auditPath)})
	if err != nil {
		return nil, fmt.Errorf("start API server (build it with %s): %w", kubeenv.BuildCommand, err)
	}
	defer env.Stop()

	// Every system (ours with each rules backend, Istio's istio-cni in
	// each mode) in the same run, their latency reps interleaved; a
	// peer's failure is reported beside our figures, never in place of
	// them.
	backends, peers := Backends(), o.peers()
	res.Backends, res.Peers = make([]BackendResult, len(backends)), make([]BackendResult, len(peers))
	var systems []*backendRun
	for i, b := range backends {
		res.Backends[i] = BackendResult{Name: b.Name, Selector: b.Selector, Unavailable: b.Unavailable}
		if b.Unavailable != "" {
			continue
		}
		// Each node's bridge stays up between its reps: the subnets differ.
		subnet := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(64 + i), 0, 0}), 16)
		systems = append(systems, newSystem(o, sz, logf, env, work, cniPaths[0], auditPath, &res.Backends[i],
			&ourAgent{shipped: shipped, backend: b, subnet: subnet}))
	}
	for i, p := range peers {
		res.Peers[i] = BackendResult{Name: p.Name, Unavailable: o.IstioMissing}
		if o.IstioMissing != "" {
			logf("== peer %s: n/a: %s", p.Name, o.IstioMissing)
			continue
		}
		systems = append(systems, newSystem(o, sz, logf, env, work, cniPaths[0], auditPath, &res.Peers[i],
			&peerAgent{peer: p, installCNI: o.IstioInstallCNI, plugin: o.IstioPlugin, chart: o.IstioChart}))
	}
	interleave(ctx, systems, sz.reps)
	for _, s := range systems {
		if _, ours := s.kind.(*ourAgent); ours && res.AgentEnv == nil {
			res.AgentEnv = s.agentEnv
		}
	}
	res.Starts = starts(systems)
	logf("%s", res.Starts)
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	if f := res.failed(); len(f) > 0 {
		return res, fmt.Errorf("benchmark failed: %s", strings.Join(f, "; "))
	}
	return res, nil
}

// figure is one latency figure (pod kind, concurrency) of a system: its
// samples, blocks and measured windows pooled over the system's reps.
type figure struct {
	kind        string
	concurrency int
	pods        int // per block
	namespace   string
	add, del    samples
	blocks      []Block
	windows     map[string][]*window
}

// window is one measured block's op: the agent's CPU, API requests and
// ADD histogram around it.
type window struct {
	cpu0, cpu1 procstat.CPUTimes
	mark       int
	reqs       []APIRequest
	start      time.Time
	took       time.Duration
	add0, add1 histogram
}

// latency runs one rep of figure f on the started system.
func (r *backendRun) latency(ctx context.Context, f *figure, rep int) error {
	kind, c, n := f.kind, f.concurrency, f.pods
	profiling := r.o.Profile && kind == "ambient" && c == 1
	q := quietCheck{maxWait: r.sz.quietWait, busyPct: quietBusyPct, logf: r.logf}
	lr := &latencyRun{
		client: r.client, cni: r.cni, chained: r.chained, primary: r.primary, node: r.res.Node, namespace: f.namespace, pods: n, concurrency: c,
		reps: r.sz.reps, annotated: kind == "ambient", quiet: q.wait, netnsDir: r.netnsDir,
		settle: func(ctx context.Context) error { return r.settle(ctx) },
		window: func(op string, rep int) func() error {
			w := &window{start: time.Now()}
			f.windows[op] = append(f.windows[op], w)
			var stopProfile func() ([]string, error)
			var err error
			if profiling && rep == 0 {
				if stopProfile, err = r.profile("ambient-" + strings.ToLower(op) + "-seq"); err != nil {
					return func() error { return err }
				}
			}
			if w.cpu0, err = procstat.ReadCPU(r.pid()); err != nil {
				return func() error { return err }
			}
			if w.mark, err = r.auditLog.mark(); err != nil {
				return func() error { return err }
			}
			w.add0, _ = scrapeAddHistogram(r.metricsURL)
			return func() error {
				var err error
				if w.cpu1, err = procstat.ReadCPU(r.pid()); err != nil {
					return err
				}
				w.reqs = r.auditLog.since(w.mark)
				w.took = time.Since(w.start)
				w.add1, _ = scrapeAddHistogram(r.metricsURL)
				if stopProfile != nil {
					files, err := stopProfile()
					if err != nil {
						return err
					}
					r.res.Profiles = append(r.res.Profiles, files...)
				}
				return nil
			}
		},
	}
	r.logf("%s pods, %d at a time: rep %d/%d, a block of %d ADDs and DELs with and without the plugin each", kind, c, rep+1, r.sz.reps, n)
	blocks, err := lr.rep(ctx, rep, &f.add, &f.del)
	f.blocks = append(f.blocks, blocks...)
	if err != nil {
		return err
	}
	for _, s := range []struct {
		op string
		samples
	}{{"ADD", f.add}, {"DEL", f.del}} {
		if s.errors > 0 {
			return fmt.Errorf("%d of %d %s calls failed by rep %d; see %s and %s", s.errors, (rep+1)*n, s.op, rep+1, r.log, r.pluginLog.Name())
		}
	}
	return nil
}

// record records figure f, its samples pooled over all reps.
func (r *backendRun) record(f *figure) {
	kind, c, n := f.kind, f.concurrency, f.pods
	r.logf("%s: %s pods, %d at a time, over %d reps:", r.res.Name, kind, c, r.sz.reps)
	for _, op := range []string{"ADD", "DEL"} {
		s := f.add
		if op == "DEL" {
			s = f.del
		}
		var cpu procstat.CPUTimes
		var reqs []APIRequest
		var took time.Duration
		var hist histogram
		for _, w := range f.windows[op] {
			cpu = procstat.CPUTimes{Own: cpu.Own + w.cpu1.Sub(w.cpu0).Own, Children: cpu.Children + w.cpu1.Sub(w.cpu0).Children}
			reqs = append(reqs, w.reqs...)
			took += w.took
			hist.sum += w.add1.sum - w.add0.sum
			hist.count += w.add1.count - w.add0.count
		}
		pods := float64(len(f.windows[op]) * n)
		l := Latency{
			Kind: kind, Op: op, Concurrency: c, Samples: len(s.chained), Errors: s.errors,
			Reps: r.sz.reps, PodsPerBlock: n, Blocks: f.blocks,
			ChainP50Ms: ms(quantile(s.primary, .5)), ChainP99Ms: ms(quantile(s.primary, .99)),
			P50Ms: ms(quantile(s.chained, .5)), P99Ms: ms(quantile(s.chained, .99)),
			CPUMsPerPod:    ms(cpu.Total()) / pods,
			OwnCPUMsPerPod: ms(cpu.Own) / pods,
			APIPerPod:      float64(len(reqs)) / pods, APIRequests: summarize(reqs), APIServerMs: meanServerMs(reqs),
			WindowSeconds: took.Seconds(), ChainedMs: msList(s.chained), ChainMs: msList(s.primary),
		}
		l.DeltaP50Ms, l.DeltaP99Ms = l.P50Ms-l.ChainP50Ms, l.P99Ms-l.ChainP99Ms
		r.res.Latency = append(r.res.Latency, l)
		if kind == "ambient" && op == "ADD" && c == 1 && hist.count > 0 {
			r.res.AgentAddMeanMs = 1000 * hist.sum / hist.count
		}
		r.logf("  %s: Δp50 %+.1f ms, Δp99 %+.1f ms, %.1f ms agent CPU and %.2f API requests per pod, %d failed",
			op, l.DeltaP50Ms, l.DeltaP99Ms, l.CPUMsPerPod, l.APIPerPod, l.Errors)
	}
}

// settle waits until the agent is idle: no API request and under 20 ms
// of CPU (its own and its children's) for a whole second. Work the agent
// does after a CNI call returned, or in reaction to an informer event (an
// annotation written off the critical path, rules removed when a pod is
// deleted), is then done and counted in the phase that caused it.
// readIdle records the agent's idle memory: ready, ztunnel connected,
// nothing enrolled, after a moment for the start-up garbage to be
// collected. what says which agent is ready, for the log line.
func (r *backendRun) readIdle(ctx context.Context, what string) error {
	if err := sleep(ctx, 2*time.Second); err != nil {
		return err
	}
	m, err := r.memory()
	if err != nil {
		return err
	}
	r.res.MemoryIdle, r.res.RSSIdleMB = m, m.RSSMiB
	r.logf("%s, idle RSS %.1f MiB", what, r.res.RSSIdleMB)
	return nil
}

// settle waits until the agent is idle: no API request and under 20 ms
// of CPU (its own and its children's) for a whole second. Work the agent
// does after a CNI call returned, or in reaction to an informer event (an
// annotation written off the critical path, rules removed when a pod is
// deleted), is then done and counted in the phase that caused it.
func (r *backendRun) settle(ctx context.Context) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		n0, err := r.auditLog.mark()
		if err != nil {
			return err
		}
		c0, err := procstat.ReadCPU(r.pid())
		if err != nil {
			return err
		}
		if err := sleep(ctx, time.Second); err != nil {
			return err
		}
		n1, err := r.auditLog.mark()
		if err != nil {
			return err
		}
		c1, err := procstat.ReadCPU(r.pid())
		if err != nil {
			return err
		}
		if n1 == n0 && c1.Sub(c0).Total() < 20*time.Millisecond {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("the agent stayed busy for 2 minutes")
		}
	}
}

// profile attaches perf to the agent (its children inherit it: iptables
// and ipset runs show up) until the returned function stops it and writes
// the reports.
func (r *backendRun) profile(phase string) (func() ([]string, error), error) {
	if err := os.MkdirAll(r.o.ProfileDir, 0o755); err != nil {
		return nil, err
	}
	base := filepath.Join(r.o.ProfileDir, fmt.Sprintf("profile-%s-%s", r.res.Name, phase))
	data := base + ".perf.data"
	cmd := exec.Command("perf", "record", "-q", "-g", "-F", "499", "-e", "cpu-clock",
		"-e", "sched:sched_process_fork", "-e", "sched:sched_process_exec", "-e", "sched:sched_process_exit",
		"-p", strconv.Itoa(r.pid()), "-o", data)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("perf record: %w", err)
	}
	// perf needs a moment to attach to every thread.
	time.Sleep(500 * time.Millisecond)
	return func() ([]string, error) {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
		var files []string
		for suffix, args := range map[string][]string{
			"by-command.txt":  {"report", "-i", data, "--stdio", "--sort", "comm", "-g", "none", "--percent-limit", "0.5"},
			"agent-funcs.txt": {"report", "-i", data, "--stdio", "--comms", "install-cni", "--no-children", "--sort", "sym", "-g", "none", "--percent-limit", "0.5"},
			"agent-tree.txt":  {"report", "-i", data, "--stdio", "--comms", "install-cni", "--children", "--sort", "sym", "-g", "none", "--percent-limit", "2"},
		} {
			out, err := exec.Command("perf", args...).Output()
			if err != nil {
				return files, fmt.Errorf("perf %s: %w", strings.Join(args, " "), err)
			}
			path := base + "-" + suffix
			if err := os.WriteFile(path, out, 0o644); err != nil {
				return files, err
			}
			files = append(files, path)
		}
		// Children: fork to exit of every process that exec'd, by program.
		out, err := exec.Command("perf", "script", "-i", data, "-F", "comm,pid,time,event,trace").Output()
		if err != nil {
			return files, fmt.Errorf("perf script: %w", err)
		}
		b, _ := json.MarshalIndent(childTimes(out), "", "  ")
		path := base + "-children.json"
		if err := os.WriteFile(path, b, 0o644); err != nil {
			return files, err
		}
		return append(files, path), os.Remove(data)
	}, nil
}

// ChildTime sums the wall time (fork to exit) of the agent's children
// that ran one program.
type ChildTime struct {
	Count   int     `json:"count"`
	TotalMs float64 `json:"totalMs"`
	MeanMs  float64 `json:"meanMs"`
}

// childTimes reads `perf script -F comm,pid,time,event,trace` output of
// sched_process_fork/exec/exit events.
func childTimes(script []byte) map[string]ChildTime {
	forked := map[string]float64{}
	prog := map[string]string{}
	out := map[string]ChildTime{}
	field := func(f []string, key string) string {
		for _, kv := range f {
			if v, ok := strings.CutPrefix(kv, key+"="); ok {
				return v
			}
		}
		return ""
	}
	sc := bufio.NewScanner(bytes.NewReader(script))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		i := slices.IndexFunc(f, func(s string) bool { return strings.HasPrefix(s, "sched:") })
		if i < 1 {
			continue
		}
		t, err := strconv.ParseFloat(strings.TrimSuffix(f[i-1], ":"), 64)
		if err != nil {
			continue
		}
		switch f[i] {
		case "sched:sched_process_fork:":
			forked[field(f, "child_pid")] = t
		case "sched:sched_process_exec:":
			prog[field(f, "pid")] = filepath.Base(field(f, "filename"))
		case "sched:sched_process_exit:":
			pid := field(f, "pid")
			name, ok := prog[pid]
			start, forkSeen := forked[pid]
			if !ok || !forkSeen {
				continue
			}
			c := out[name]
			c.Count++
			c.TotalMs += 1000 * (t - start)
			c.MeanMs = c.TotalMs / float64(c.Count)
			out[name] = c
			delete(prog, pid)
		}
	}
	return out
}

// Memory is a breakdown of the agent's memory from its Go runtime metrics.
type Memory struct {
	RSSMiB float64 `json:"rssMiB"`
	// AnonMiB is private memory; FileMiB is the binary's (and libraries')
	// pages mapped from files.
	AnonMiB      float64 `json:"rssAnonMiB"`
	FileMiB      float64 `json:"rssFileMiB"`
	HeapInuseMiB float64 `json:"heapInuseMiB"`
	StackMiB     float64 `json:"stackInuseMiB"`
	GoSysMiB     float64 `json:"goSysMiB"`
	Goroutines   int     `json:"goroutines"`
}

// memory reads VmRSS and the Go runtime's view from /metrics.
func (r *backendRun) memory() (Memory, error) {
	return ReadMemory(r.pid(), r.metricsURL)
}

// ReadMemory reads pid's VmRSS, RssAnon and RssFile, and the Go runtime's
// view from the agent's /metrics at metricsURL (a bonus: left zero when
// the scrape fails).
func ReadMemory(pid int, metricsURL string) (Memory, error) {
	st, err := procstat.ReadStatus(pid, "VmRSS", "RssAnon", "RssFile")
	if err != nil {
		return Memory{}, err
	}
	m := Memory{
		RSSMiB: float64(st["VmRSS"]) / (1 << 20), AnonMiB: float64(st["RssAnon"]) / (1 << 20), FileMiB: float64(st["RssFile"]) / (1 << 20),
	}
	vals, err := scrape.Values(metricsURL, "go_memstats_heap_inuse_bytes", "go_memstats_stack_inuse_bytes", "go_memstats_sys_bytes", "go_goroutines")
	if err != nil {
		return m, nil // RSS is the figure; the breakdown is a bonus
	}
	m.HeapInuseMiB = vals["go_memstats_heap_inuse_bytes"] / (1 << 20)
	m.StackMiB = vals["go_memstats_stack_inuse_bytes"] / (1 << 20)
	m.GoSysMiB = vals["go_memstats_sys_bytes"] / (1 << 20)
	m.Goroutines = int(vals["go_goroutines"])
	return m, nil
}

// histogram is a Prometheus histogram's sum and count.
type histogram struct{ sum, count float64 }

// scrapeAddHistogram reads ambient_cni_cni_add_duration_seconds from the
// agent's /metrics.
func scrapeAddHistogram(base string) (histogram, error) {
	v, err := scrape.Values(base, "ambient_cni_cni_add_duration_seconds_sum", "ambient_cni_cni_add_duration_seconds_count")
	return histogram{sum: v["ambient_cni_cni_add_duration_seconds_sum"], count: v["ambient_cni_cni_add_duration_seconds_count"]}, err
}

// pluginFigures measures the plugin binary: size, and the wall time of an
// exec that does nothing but answer CNI VERSION (the floor of every call).
func pluginFigures(path string, runs int) (Plugin, error) {
	st, err := os.Stat(path)
	if err != nil {
		return Plugin{}, err
	}
	var ds []time.Duration
	for range runs {
		cmd := exec.Command(path)
		cmd.Env = []string{"CNI_COMMAND=VERSION"}
		cmd.Stdin = strings.NewReader(`{"cniVersion":"1.0.0"}`)
		t0 := time.Now()
		out, err := cmd.Output()
		ds = append(ds, time.Since(t0))
		if err != nil || !bytes.Contains(out, []byte("supportedVersions")) {
			return Plugin{}, fmt.Errorf("%s VERSION: %v: %s", path, err, out)
		}
	}
	return Plugin{Path: path, SizeBytes: st.Size(), ExecRuns: runs, ExecP50Ms: ms(quantile(ds, .5)), ExecP99Ms: ms(quantile(ds, .99))}, nil
}

// createNamespace creates a namespace and its default ServiceAccount (no
// controller manager runs here to create it).
func createNamespace(ctx context.Context, c kubernetes.Interface, name string, labels map[string]string) (string, error) {
	name = name + "-" + testnet.RandName("", 4)
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
		return "", fmt.Errorf("create namespace %s: %w", name, err)
	}
	if _, err := c.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		return "", fmt.Errorf("create default serviceaccount in %s: %w", name, err)
	}
	return name, nil
}

// createNode registers a Node as kubelet does (no kubelet runs here): the
// plugin's tokens are bound to it.
func createNode(ctx context.Context, c kubernetes.Interface, name string) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}}
	if _, err := c.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create node %s: %w", name, err)
	}
	return nil
}

// detectedBackend reads the backend the agent logged at start.
func detectedBackend(logPath string) string {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return ""
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		if f := logFields(l); f["backend"] != "" && strings.Contains(f["msg"], "backend") {
			return f["backend"]
		}
	}
	return ""
}

func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

func msList(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = ms(d)
	}
	return out
}

// commit names the checked-out commit, "+dirty" with local changes.
func commit(root string) string {
	out, err := exec.Command("git", "-C", root, "rev-parse", "--short=12", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "-C", root, "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
		c += "+dirty"
	}
	return c
}

func kernel() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}
