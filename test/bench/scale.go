package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The scale run (`make bench-scale`) measures the agent's memory on a node
// of a large cluster: every namespace of the cluster is in its cache, and
// the pods of other nodes must never be. It prints figures beside their
// targets and asserts none: only a failure to load the cluster or a
// failure of the agent to catch up is an error.

// The scale targets: the agent's RSS with the whole cluster loaded, and
// what each namespace may add to it.
const (
	ScaleTargetRSSMiB          = 40
	ScaleTargetKiBPerNamespace = 1.0
)

// ScaleOptions configure RunScale.
type ScaleOptions struct {
	// RepoRoot is the repository (chart).
	RepoRoot string
	// InstallCNI and Plugin are the shipped binaries (make build).
	InstallCNI, Plugin string
	// Quick loads 200 namespaces and 400 pods: a smoke test of the
	// harness, not figures.
	Quick bool
	// Log receives progress lines.
	Log io.Writer
}

// scaleSizes is what a scale run loads into the API server.
type scaleSizes struct {
	namespaces, pods, otherNodes int
	// annotationBytes is what each namespace carries in annotations
	// (keys and values).
	annotationBytes int
	// workers create objects in parallel through one client.
	workers int
	// deadline bounds the whole run.
	deadline time.Duration
}

func (o ScaleOptions) sizes() scaleSizes {
	s := scaleSizes{namespaces: 10000, pods: 20000, otherNodes: 100, annotationBytes: 10 << 10, workers: 16, deadline: time.Hour}
	if o.Quick {
		s.namespaces, s.pods, s.otherNodes, s.deadline = 200, 400, 10, 15*time.Minute
	}
	return s
}

// ScaleResult is one scale run; it is written as JSON.
type ScaleResult struct {
	Started time.Time `json:"started"`
	Seconds float64   `json:"seconds"`
	Quick   bool      `json:"quick"`
	Commit  string    `json:"commit"`
	// WorkDir held the run's files; it is removed at the end.
	WorkDir string  `json:"workDir"`
	Machine Machine `json:"machine"`
	Node    string  `json:"node"`
	// AgentPID was the last install-cni process (gone after the run).
	AgentPID int `json:"agentPid"`
	// KubeClientQPS and KubeClientBurst are the agent's client limit (the
	// chart's; the loader has a client of its own).
	KubeClientQPS   float64 `json:"kubeClientQPS"`
	KubeClientBurst int     `json:"kubeClientBurst"`
	// MemoryLimit is what the agent logged of the Go memory limit it set
	// at start ("" when it logged none: no cgroup limit was visible).
	MemoryLimit string `json:"memoryLimit"`
	// What was loaded: namespaces with AnnotationBytes of annotations
	// each, and pods bound to OtherNodes nodes that are not the agent's.
	Namespaces      int `json:"namespaces"`
	AnnotationBytes int `json:"annotationBytes"`
	Pods            int `json:"pods"`
	OtherNodes      int `json:"otherNodes"`
	// LoadSeconds is how long the creates took; CatchUpSeconds how long
	// after them the agent's caches held the sentinel (see waitCaughtUp).
	LoadSeconds    float64 `json:"loadSeconds"`
	CatchUpSeconds float64 `json:"catchUpSeconds"`
	// Idle is the settled agent before the load, After the settled agent
	// once it caught up; PeakRSSMiB is its VmHWM then (the high-water
	// mark, reached while it decoded the load).
	Idle       Memory  `json:"idle"`
	After      Memory  `json:"after"`
	PeakRSSMiB float64 `json:"peakRssMiB"`
	// GrowthKiBPerNamespace is (After - Idle) RSS over Namespaces.
	GrowthKiBPerNamespace float64 `json:"growthKiBPerNamespace"`
	// Restarted is a new agent started (after a SIGKILL of the first, as
	// a crash or an OOM kill ends it: no uninstall) with the whole load
	// in the API server, settled once it caught up; RestartPeakRSSMiB is
	// its VmHWM: what its initial list of the cluster cost at the peak.
	Restarted         Memory  `json:"restarted"`
	RestartPeakRSSMiB float64 `json:"restartPeakRssMiB"`
}

// RunScale runs the scale benchmark. Like Run it must run as root in a
// network namespace of its own (testnet.ProgramInOwnNetns): the simulated
// node has a bridge, and the API server listens on its loopback. The API
// server env is the run's own and goes with it.
func RunScale(ctx context.Context, o ScaleOptions) (res *ScaleResult, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the scale benchmark runs a simulated node (a bridge, netfilter rules): run it as root")
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
	sz := o.sizes()
	ctx, cancel := context.WithTimeout(ctx, sz.deadline)
	defer cancel()
	res = &ScaleResult{
		Started: time.Now(), Quick: o.Quick, Commit: commit(o.RepoRoot),
		Machine:    Machine{CPUs: runtime.NumCPU(), Kernel: kernel(), Go: runtime.Version(), LoadStart: procstat.LoadAvg()},
		Namespaces: sz.namespaces, AnnotationBytes: sz.annotationBytes, Pods: sz.pods, OtherNodes: sz.otherNodes,
	}
	defer func() {
		res.Machine.LoadEnd = procstat.LoadAvg()
		res.Seconds = time.Since(res.Started).Seconds()
	}()

	shipped, err := simnode.RenderChart(ctx, o.RepoRoot)
	if err != nil {
		return nil, err
	}
	// A short directory: socket paths must fit in sun_path.
	work, err := os.MkdirTemp("", "ascale-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	res.WorkDir = work
	cniPaths, _, err := cnibin.Build()
	if err != nil {
		return nil, err
	}
	logf("starting etcd and kube-apiserver")
	env, err := kubeenv.Launch(ctx, kubeenv.Options{Dir: filepath.Join(work, "kube")})
	if err != nil {
		return nil, fmt.Errorf("start API server (build it with %s): %w", kubeenv.BuildCommand, err)
	}
	defer env.Stop()

	res.Node = testnet.RandName("scale-", 6)
	logf("starting %s with the chart's environment on node %s", o.InstallCNI, res.Node)
	node, err := simnode.Start(ctx, simnode.Options{
		Env: env, Chart: shipped, InstallCNI: o.InstallCNI, Plugin: o.Plugin,
		ReferencePlugins: cniPaths[0], Dir: filepath.Join(work, "node"), Name: res.Node, RunOnTmpfs: true,
	})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, node.Close()) }()
	agent := node.Agent()
	res.AgentPID = agent.Pid()
	res.KubeClientQPS, res.KubeClientBurst = float64(node.Config.KubeClientQPS), node.Config.KubeClientBurst
	res.MemoryLimit = memoryLimitLogged(node.LogPath)

	logf("agent ready; waiting for its RSS to settle")
	if res.Idle, err = settledMemory(ctx, agent, node.MetricsURL, 3*time.Minute); err != nil {
		return res, fmt.Errorf("idle: %w", err)
	}
	logf("idle RSS %.1f MiB", res.Idle.RSSMiB)

	// The loader's own client, its rate limit far above the test
	// clients' so that the load takes minutes, not tens of them; the
	// agent keeps the chart's limit.
	loaderCfg := rest.CopyConfig(env.Config)
	loaderCfg.QPS, loaderCfg.Burst = 5000, 5000
	loader, err := kubernetes.NewForConfig(loaderCfg)
	if err != nil {
		return res, fmt.Errorf("loader client: %w", err)
	}
	t0 := time.Now()
	if err := loadCluster(ctx, loader, sz, res.Node, testnet.RandName("", 4), logf); err != nil {
		return res, err
	}
	res.LoadSeconds = time.Since(t0).Seconds()
	logf("loaded %d namespaces and %d pods in %.0f s", sz.namespaces, sz.pods, res.LoadSeconds)

	t1 := time.Now()
	if err := waitCaughtUp(ctx, loader, node, agent, 10*time.Minute); err != nil {
		return res, err
	}
	res.CatchUpSeconds = time.Since(t1).Seconds()
	logf("the agent caught up %.1f s after the last create; waiting for its RSS to settle", res.CatchUpSeconds)
	if res.After, err = settledMemory(ctx, agent, node.MetricsURL, 5*time.Minute); err != nil {
		return res, fmt.Errorf("after the load: %w", err)
	}
	if st, err := procstat.ReadStatus(agent.Pid(), "VmHWM"); err == nil {
		res.PeakRSSMiB = float64(st["VmHWM"]) / (1 << 20)
	}
	res.GrowthKiBPerNamespace = (res.After.RSSMiB - res.Idle.RSSMiB) * 1024 / float64(sz.namespaces)
	if agent.Exited() {
		return res, fmt.Errorf("install-cni exited during the run: %v; log %s", agent.Err(), node.LogPath)
	}

	// A restart lists the whole cluster at once, where the first agent
	// saw it arrive one object at a time.
	logf("killing the agent and starting a new one with the load in place")
	node.KillAgent()
	if agent, err = node.StartAgent(); err != nil {
		return res, fmt.Errorf("restart the agent: %w", err)
	}
	res.AgentPID = agent.Pid()
	if err := node.WaitReady(ctx, 5*time.Minute); err != nil {
		return res, fmt.Errorf("the restarted agent: %w", err)
	}
	if err := waitCaughtUp(ctx, loader, node, agent, 10*time.Minute); err != nil {
		return res, fmt.Errorf("the restarted agent: %w", err)
	}
	if res.Restarted, err = settledMemory(ctx, agent, node.MetricsURL, 5*time.Minute); err != nil {
		return res, fmt.Errorf("after the restart: %w", err)
	}
	if st, err := procstat.ReadStatus(agent.Pid(), "VmHWM"); err == nil {
		res.RestartPeakRSSMiB = float64(st["VmHWM"]) / (1 << 20)
	}
	if agent.Exited() {
		return res, fmt.Errorf("the restarted install-cni exited: %v; log %s", agent.Err(), node.LogPath)
	}
	return res, nil
}

// loadCluster creates sz.namespaces namespaces, each with
// sz.annotationBytes of annotations and its default ServiceAccount (the
// ServiceAccount admission wants it before a pod; no controller manager
// runs here to make it), then sz.pods pods spread over them and bound to
// sz.otherNodes nodes that are not node: they exist in the API only.
func loadCluster(ctx context.Context, c kubernetes.Interface, sz scaleSizes, node, tag string, logf func(string, ...any)) error {
	const annotations = 10
	annot := func(i int) map[string]string {
		m := make(map[string]string, annotations)
		for a := range annotations {
			k := fmt.Sprintf("bench.ambient-cni.io/note-%d", a)
			// Distinct per namespace, as users' annotations are.
			v := fmt.Sprintf("%05d-", i)
			v += strings.Repeat("x", max(0, sz.annotationBytes/annotations-len(k)-len(v)))
			m[k] = v
		}
		return m
	}
	nsName := func(i int) string { return fmt.Sprintf("scale-%s-%05d", tag, i) }
	if err := parallel(ctx, sz.namespaces, sz.workers, "namespaces", logf, func(ctx context.Context, i int) error {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
			Name: nsName(i), Labels: map[string]string{"bench.ambient-cni.io/load": tag}, Annotations: annot(i),
		}}
		if _, err := c.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create namespace %s: %w", ns.Name, err)
		}
		sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}
		if _, err := c.CoreV1().ServiceAccounts(ns.Name).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create the default serviceaccount of %s: %w", ns.Name, err)
		}
		return nil
	}); err != nil {
		return err
	}
	return parallel(ctx, sz.pods, sz.workers, "pods", logf, func(ctx context.Context, i int) error {
		other := fmt.Sprintf("other-%03d", i%sz.otherNodes)
		if other == node {
			return fmt.Errorf("internal error: another node is named %s like the agent's", node)
		}
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: nsName(i % sz.namespaces), Name: fmt.Sprintf("load-%05d", i), Labels: map[string]string{"app": "load"}},
			Spec: corev1.PodSpec{
				NodeName:   other,
				Containers: []corev1.Container{{Name: "app", Image: "app:1"}},
			},
		}
		if _, err := c.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create pod %s/%s: %w", p.Namespace, p.Name, err)
		}
		return nil
	})
}

// parallel runs f(0..n-1), workers at a time, logging progress every
// tenth; the first error stops the rest and is returned.
func parallel(ctx context.Context, n, workers int, what string, logf func(string, ...any), f func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	next, done := make(chan int), atomic.Int64{}
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				if err := f(ctx, i); err != nil {
					cancel(err)
					return
				}
				if d := done.Add(1); n >= 10 && d%int64(n/10) == 0 {
					logf("  %s: %d of %d", what, d, n)
				}
			}
		})
	}
feed:
	for i := range n {
		select {
		case next <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

// waitCaughtUp creates a sentinel after the load, a namespace labelled
// istio.io/dataplane-mode=none and a pod in it bound to the agent's node,
// and waits until the agent's explain view of that pod names the
// namespace's label. A watch delivers events in order, so once the agent's
// namespace cache holds the sentinel it holds every namespace created
// before it, and once its pod cache holds the sentinel pod its pod watch
// has passed every pod of the load (those of other nodes it never sees).
func waitCaughtUp(ctx context.Context, c kubernetes.Interface, node *simnode.Node, agent *childproc.Proc, within time.Duration) error {
	ns, err := createNamespace(ctx, c, "scale-sentinel", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone})
	if err != nil {
		return err
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sentinel"},
		Spec:       corev1.PodSpec{NodeName: node.Name, Containers: []corev1.Container{{Name: "app", Image: "app:1"}}},
	}
	if _, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create the sentinel pod: %w", err)
	}
	path := "/debug/explain?pod=" + url.QueryEscape(ns+"/"+pod.Name)
	deadline := time.Now().Add(within)
	var last string
	for {
		var buf bytes.Buffer
		code, err := installcni.AskAgent(ctx, node.Config.Layout(), path, 30*time.Second, &buf)
		switch {
		case err != nil:
			last = err.Error()
		case code != http.StatusOK:
			last = fmt.Sprintf("%d: %s", code, bytes.TrimSpace(buf.Bytes()))
		default:
			var r explainwire.Report
			if err := json.Unmarshal(buf.Bytes(), &r); err != nil {
				return fmt.Errorf("the agent's explain answer: %w: %s", err, buf.Bytes())
			}
			if r.Policy.NamespaceLabel == ambient.DataplaneModeNone {
				return nil
			}
			last = fmt.Sprintf("namespace label %q", r.Policy.NamespaceLabel)
		}
		if agent.Exited() {
			return fmt.Errorf("install-cni exited while catching up: %v; log tail:\n%s", agent.Err(), agent.LogTail(20))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the agent did not see the sentinel pod %s/%s within %v (last answer: %s)", ns, pod.Name, within, last)
		}
		if err := sleep(ctx, 500*time.Millisecond); err != nil {
			return err
		}
	}
}

// settledMemory polls the agent every half second until, over the last
// five seconds, its RSS moved by at most 1 % (or 256 KiB) and it used under
// 100 ms of CPU, then reads its memory: what it holds once done with what
// it was given, not a figure taken a fixed time after.
func settledMemory(ctx context.Context, agent *childproc.Proc, metricsURL string, within time.Duration) (Memory, error) {
	const window = 10 // samples, half a second apart
	type sample struct {
		rss int64
		cpu time.Duration
	}
	var samples []sample
	deadline := time.Now().Add(within)
	for {
		st, err := procstat.ReadStatus(agent.Pid(), "VmRSS")
		if err != nil {
			return Memory{}, fmt.Errorf("read the agent's RSS: %w", err)
		}
		cpu, err := procstat.ReadCPU(agent.Pid())
		if err != nil {
			return Memory{}, fmt.Errorf("read the agent's CPU: %w", err)
		}
		samples = append(samples, sample{st["VmRSS"], cpu.Total()})
		if len(samples) > window+1 {
			samples = samples[1:]
		}
		if len(samples) == window+1 {
			lo, hi := samples[0].rss, samples[0].rss
			for _, s := range samples {
				lo, hi = min(lo, s.rss), max(hi, s.rss)
			}
			busy := samples[window].cpu - samples[0].cpu
			if hi-lo <= max(256<<10, hi/100) && busy < 100*time.Millisecond {
				return ReadMemory(agent.Pid(), metricsURL)
			}
		}
		if agent.Exited() {
			return Memory{}, fmt.Errorf("install-cni exited: %v", agent.Err())
		}
		if time.Now().After(deadline) {
			return Memory{}, fmt.Errorf("the agent's RSS and CPU did not settle within %v", within)
		}
		if err := sleep(ctx, 500*time.Millisecond); err != nil {
			return Memory{}, err
		}
	}
}

// memoryLimitLogged is the agent's log line about its Go memory limit,
// without the time stamp, or "" if it wrote none.
func memoryLimitLogged(logPath string) string {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return ""
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		m := logFields(l)
		if strings.HasPrefix(m["msg"], "memory limit") {
			delete(m, "time")
			delete(m, "level")
			out, _ := json.Marshal(m)
			return string(out)
		}
	}
	return ""
}

// met is the word beside a figure and its upper bound.
func met(v, target float64) string {
	if v <= target {
		return "met"
	}
	return "missed"
}

// WriteReport prints the run's figures beside the targets. Nothing is
// asserted: the figures are information.
func (r *ScaleResult) WriteReport(w io.Writer) error {
	l1, l2 := r.Machine.LoadStart, r.Machine.LoadEnd
	fmt.Fprintf(w, "ambient-cni bench-scale %s, commit %s: %d CPUs, load %.1f %.1f %.1f at start, %.1f %.1f %.1f at end; %.0f s\n\n",
		r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.Commit, r.Machine.CPUs, l1[0], l1[1], l1[2], l2[0], l2[1], l2[2], r.Seconds)
	if r.Quick {
		fmt.Fprintln(w, "QUICK run (a smoke test of the harness): the figures say nothing about scale.")
	}
	fmt.Fprintf(w, "loaded %d namespaces (%d KiB of annotations each) and %d pods bound to %d other nodes in %.0f s; the agent (client limit %.0f/s, burst %d) caught up %.1f s after the last create\n",
		r.Namespaces, r.AnnotationBytes>>10, r.Pods, r.OtherNodes, r.LoadSeconds, r.KubeClientQPS, r.KubeClientBurst, r.CatchUpSeconds)
	limit := r.MemoryLimit
	if limit == "" {
		limit = "none logged (no cgroup memory limit visible to the agent)"
	}
	fmt.Fprintf(w, "agent's Go memory limit: %s\n\n", limit)
	writeMarkdown(w, [][]string{
		{"figure", "measured", "target", ""},
		{"agent RSS idle: MiB", fmt.Sprintf("%.1f", r.Idle.RSSMiB), "", ""},
		{"agent RSS after the load (settled): MiB", fmt.Sprintf("%.1f", r.After.RSSMiB), fmt.Sprintf("≤ %d", ScaleTargetRSSMiB), met(r.After.RSSMiB, ScaleTargetRSSMiB)},
		{"RSS growth per namespace: KiB", fmt.Sprintf("%.2f", r.GrowthKiBPerNamespace), fmt.Sprintf("≤ %g", ScaleTargetKiBPerNamespace), met(r.GrowthKiBPerNamespace, ScaleTargetKiBPerNamespace)},
		{"agent peak RSS (VmHWM): MiB", fmt.Sprintf("%.1f", r.PeakRSSMiB), "", ""},
		{"RSS anonymous / file-backed, idle: MiB", fmt.Sprintf("%.1f / %.1f", r.Idle.AnonMiB, r.Idle.FileMiB), "", ""},
		{"RSS anonymous / file-backed, after: MiB", fmt.Sprintf("%.1f / %.1f", r.After.AnonMiB, r.After.FileMiB), "", ""},
		{"Go heap in use idle / after: MiB", fmt.Sprintf("%.1f / %.1f", r.Idle.HeapInuseMiB, r.After.HeapInuseMiB), "", ""},
		{"Go runtime's memory from the OS idle / after: MiB", fmt.Sprintf("%.1f / %.1f", r.Idle.GoSysMiB, r.After.GoSysMiB), "", ""},
		{"restarted with the load in place, RSS settled: MiB", fmt.Sprintf("%.1f", r.Restarted.RSSMiB), "", ""},
		{"restarted, peak RSS (VmHWM) / Go heap in use: MiB", fmt.Sprintf("%.1f / %.1f", r.RestartPeakRSSMiB, r.Restarted.HeapInuseMiB), "", ""},
	})
	return nil
}
