package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The fleet run (`make bench-agents`) measures what many node agents cost
// one API server: as many simulated nodes as it is given, each with its
// Node object, its own directories and network namespace and one agent
// process (ours, then istio-cni's against a fresh API server), no pods
// on most. It prints the API server's requests, watches, memory and CPU
// per agent when they all start, at rest and when a namespace with pods
// of some nodes is labelled ambient. It asserts only what the agents
// promise: every agent ready, every agent's watches established and
// still open at the end, no agent exited. The figures are information.

// FleetOptions configure RunFleet.
type FleetOptions struct {
	// RepoRoot is the repository (charts).
	RepoRoot string
	// InstallCNI and Plugin are the shipped binaries (make build).
	InstallCNI, Plugin string
	// IstioInstallCNI, IstioPlugin and IstioChart are Istio's
	// (IstioBinaries); IstioMissing, when set, says why they are not
	// there and its column is left out.
	IstioInstallCNI, IstioPlugin, IstioChart, IstioMissing string
	// Agents is how many nodes (default 50).
	Agents int
	// Quick runs 5 agents and short windows: a smoke test of the harness.
	Quick bool
	// Log receives progress lines.
	Log io.Writer
}

type fleetSizes struct {
	agents int
	// idle is the window over the API server with the nodes but no
	// agents; rest the window over it with every agent idle.
	idle, rest time.Duration
	// flipNodes nodes have podsPerNode pods each in the namespace that is
	// labelled.
	flipNodes, podsPerNode int
	deadline               time.Duration
}

func (o FleetOptions) sizes() fleetSizes {
	s := fleetSizes{agents: 50, idle: 30 * time.Second, rest: 2 * time.Minute, flipNodes: 10, podsPerNode: 5, deadline: time.Hour}
	if o.Quick {
		s = fleetSizes{agents: 5, idle: 10 * time.Second, rest: 20 * time.Second, flipNodes: 2, podsPerNode: 2, deadline: 20 * time.Minute}
	}
	if o.Agents > 0 {
		s.agents = o.Agents
		s.flipNodes = min(s.flipNodes, s.agents)
	}
	return s
}

// FleetResult is one fleet run; it is written as JSON.
type FleetResult struct {
	Started time.Time `json:"started"`
	Seconds float64   `json:"seconds"`
	Quick   bool      `json:"quick"`
	Commit  string    `json:"commit"`
	Machine Machine   `json:"machine"`
	Agents  int       `json:"agents"`
	// FlipNodes nodes had PodsPerNode pods each in the namespace
	// labelled; the pods exist in the API only (Pending, no sandbox).
	FlipNodes   int `json:"flipNodes"`
	PodsPerNode int `json:"podsPerNode"`
	// IstioMissing says why istio-cni's column is absent.
	IstioMissing string         `json:"istioMissing,omitempty"`
	Systems      []*FleetSystem `json:"systems"`
}

// FleetSystem is one system's agents against their own API server.
type FleetSystem struct {
	Name  string `json:"name"`
	Error string `json:"error,omitempty"`
	// ReadySeconds is from starting every agent until all were ready;
	// EstablishedSeconds until, besides, every agent held the same set of
	// watches open.
	ReadySeconds       float64 `json:"readySeconds"`
	EstablishedSeconds float64 `json:"establishedSeconds"`
	// WatchesPerAgent is what each agent holds open, by resource.
	WatchesPerAgent map[string]int `json:"watchesPerAgent"`
	// FlipQuiet is whether the agents went quiet (10 s without a request)
	// within a minute of the flip, which ends the Flip window; else it
	// ends after that minute.
	FlipQuiet bool `json:"flipQuiet"`
	// AgentRSSMiB is the agents' mean RSS at rest.
	AgentRSSMiB float64 `json:"agentRssMiB"`
	// Idle is the API server with the nodes but no agent; Start from
	// starting every agent until all were established; Rest a window of
	// every agent idle; Flip from labelling the namespace until the agents
	// were quiet.
	Idle  FleetPhase `json:"idle"`
	Start FleetPhase `json:"start"`
	Rest  FleetPhase `json:"rest"`
	Flip  FleetPhase `json:"flip"`
	// DaemonSetStatus is one write of the chart's DaemonSet's status, as
	// its controller writes it while pods become ready.
	DaemonSetStatus FleetPhase `json:"daemonSetStatus"`
}

// FleetPhase is the API server over one window.
type FleetPhase struct {
	Seconds float64 `json:"seconds"`
	// AgentRequests are every agent's requests together, watches apart
	// (WatchStarts: watches established), by "verb resource".
	AgentRequests int            `json:"agentRequests"`
	ByKey         map[string]int `json:"byKey"`
	WatchStarts   int            `json:"watchStarts"`
	// AllRequests is apiserver_request_total's growth: every client,
	// the harness's own scrapes and the API server's loopback clients too.
	AllRequests float64 `json:"allRequests"`
	// APIServerCPUSeconds is kube-apiserver's CPU over the window.
	APIServerCPUSeconds float64 `json:"apiserverCpuSeconds"`
	// RSSMiB and PeakRSSMiB (VmHWM) are kube-apiserver's at the end.
	RSSMiB     float64 `json:"rssMiB"`
	PeakRSSMiB float64 `json:"peakRssMiB"`
	// LongRunningWatches (apiserver_longrunning_requests, verb WATCH) and
	// RegisteredWatchers (apiserver_registered_watchers, -1 when the API
	// server has no such metric) at the end, every client's.
	LongRunningWatches float64 `json:"longRunningWatches"`
	RegisteredWatchers float64 `json:"registeredWatchers"`
	// WatchEvents and WatchEventBytes are the events (and their bytes)
	// the API server sent to watchers over the window.
	WatchEvents     float64 `json:"watchEvents"`
	WatchEventBytes float64 `json:"watchEventBytes"`
	// Goroutines and HeapInuseMiB are kube-apiserver's at the end (its
	// Go runtime's metrics): what each watch holds, steadier than RSS.
	Goroutines   float64 `json:"goroutines"`
	HeapInuseMiB float64 `json:"heapInuseMiB"`
	// EventsByResource are WatchEvents and WatchEventBytes by the API
	// server's resource label (its kind label on older ones).
	EventsByResource map[string]ResourceEvents `json:"eventsByResource,omitempty"`
}

// ResourceEvents are the watch events of one resource and their bytes.
type ResourceEvents struct {
	Events float64 `json:"events"`
	Bytes  float64 `json:"bytes"`
}

// RunFleet runs the fleet benchmark: ours, then istio-cni's when built.
// Like Run it must run as root in a network namespace of its own.
func RunFleet(ctx context.Context, o FleetOptions) (res *FleetResult, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the fleet benchmark makes network namespaces and runs node agents: run it as root")
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	for _, p := range []string{o.InstallCNI, o.Plugin} {
		if st, err := os.Stat(p); err != nil || st.IsDir() {
			return nil, fmt.Errorf("shipped binary %s missing (make build): %v", p, err)
		}
	}
	sz := o.sizes()
	ctx, cancel := context.WithTimeout(ctx, sz.deadline)
	defer cancel()
	res = &FleetResult{
		Started: time.Now(), Quick: o.Quick, Commit: commit(o.RepoRoot),
		Machine: Machine{CPUs: runtime.NumCPU(), Kernel: kernel(), Go: runtime.Version(), LoadStart: procstat.LoadAvg()},
		Agents:  sz.agents, FlipNodes: sz.flipNodes, PodsPerNode: sz.podsPerNode, IstioMissing: o.IstioMissing,
	}
	defer func() {
		res.Machine.LoadEnd = procstat.LoadAvg()
		res.Seconds = time.Since(res.Started).Seconds()
	}()
	kinds := []fleetKind{&ourFleet{o: o}}
	if o.IstioMissing == "" {
		kinds = append(kinds, &istioFleet{o: o})
	}
	var errs error
	for _, k := range kinds {
		s, err := runFleetSystem(ctx, o, sz, k)
		res.Systems = append(res.Systems, s)
		if err != nil {
			s.Error = err.Error()
			errs = errors.Join(errs, fmt.Errorf("%s: %w", s.Name, err))
		}
	}
	return res, errs
}

// fleetKind is one system's way of running its agents.
type fleetKind interface {
	name() string
	// user is its ServiceAccount as the audit log names it.
	user() string
	// setup renders the chart (once per system).
	setup(ctx context.Context) error
	// install makes what the chart installs once per cluster, beyond
	// each node's agent ServiceAccount and RBAC, and returns its
	// DaemonSet's namespace and name (created in the API; no controller
	// runs it).
	install(ctx context.Context, env *kubeenv.Env) (dsNamespace, dsName string, err error)
	prepare(ctx context.Context, p fleetPlace) (fleetAgent, error)
}

// fleetPlace is one node: its API server, name, directory and network.
type fleetPlace struct {
	env           *kubeenv.Env
	apiHost       string
	name, dir     string
	refPlugins    string
	netns, nodeIP string
}

// fleetAgent is one node's agent.
type fleetAgent interface {
	start(ctx context.Context) error
	waitReady(ctx context.Context, within time.Duration) error
	// exited says how the agent ended, nil while it runs.
	exited() error
	pid() int
	close() error
}

func runFleetSystem(ctx context.Context, o FleetOptions, sz fleetSizes, k fleetKind) (sys *FleetSystem, err error) {
	sys = &FleetSystem{Name: k.name()}
	logf := func(format string, args ...any) { fmt.Fprintf(o.Log, k.name()+": "+format+"\n", args...) }
	if err := k.setup(ctx); err != nil {
		return sys, err
	}
	// A short directory: socket paths must fit in sun_path.
	work, err := os.MkdirTemp("", "afleet-")
	if err != nil {
		return sys, err
	}
	defer func() {
		if rerr := os.RemoveAll(work); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}()
	cniPaths, _, err := cnibin.Build()
	if err != nil {
		return sys, err
	}
	fnet, err := newFleetNet()
	if err != nil {
		return sys, err
	}
	defer func() { err = errors.Join(err, fnet.Close(), leakedMounts(work)) }()

	policy, auditPath := filepath.Join(work, "audit-policy.yaml"), filepath.Join(work, "audit.log")
	if err := os.WriteFile(policy, []byte(fleetAuditPolicy(k.user())), 0o644); err != nil {
		return sys, err
	}
	logf("starting etcd and kube-apiserver")
	env, err := kubeenv.Launch(ctx, kubeenv.Options{
		Dir: filepath.Join(work, "kube"), ListenAll: true, ServingIPs: []net.IP{fnet.gateway.Addr().AsSlice()},
		APIServerArgs: auditArgs(policy, auditPath),
	})
	if err != nil {
		return sys, fmt.Errorf("start API server (build it with %s): %w", kubeenv.BuildCommand, err)
	}
	defer env.Stop()
	u, err := url.Parse(env.Config.Host)
	if err != nil {
		return sys, err
	}
	apiHost := "https://" + net.JoinHostPort(fnet.gateway.Addr().String(), u.Port())
	dsNS, dsName, err := k.install(ctx, env)
	if err != nil {
		return sys, err
	}

	tag := testnet.RandName("", 4)
	logf("making %d nodes", sz.agents)
	places := make([]fleetPlace, sz.agents)
	ipToNode := map[string]string{}
	for i := range places {
		p := fleetPlace{env: env, apiHost: apiHost, name: fmt.Sprintf("fleet-%s-%02d", tag, i),
			dir: filepath.Join(work, fmt.Sprintf("n%02d", i)), refPlugins: cniPaths[0],
			netns: filepath.Join(work, fmt.Sprintf("n%02d.netns", i))}
		nn, err := fnet.addNode(i, p.netns)
		if err != nil {
			return sys, err
		}
		p.nodeIP = nn.addr.String()
		ipToNode[p.nodeIP] = p.name
		if err := createNode(ctx, env.Client, p.name); err != nil {
			return sys, err
		}
		places[i] = p
	}
	flipNS, err := createNamespace(ctx, env.Client, "fleet-flip", nil)
	if err != nil {
		return sys, err
	}
	for i := range sz.flipNodes {
		for j := range sz.podsPerNode {
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: flipNS, Name: fmt.Sprintf("app-%02d-%d", i, j), Labels: map[string]string{"app": "flip"}},
				Spec:       corev1.PodSpec{NodeName: places[i].name, Containers: []corev1.Container{{Name: "app", Image: "app:1"}}},
			}
			if _, err := env.Client.CoreV1().Pods(flipNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
				return sys, fmt.Errorf("create pod %s/%s: %w", flipNS, pod.Name, err)
			}
		}
	}

	logf("preparing %d agents", sz.agents)
	agents := make([]fleetAgent, sz.agents)
	defer func() {
		logf("stopping the agents")
		cerrs := make([]error, len(agents))
		_ = parallel(context.Background(), len(agents), len(agents), "stop", func(string, ...any) {}, func(_ context.Context, i int) error {
			if agents[i] != nil {
				cerrs[i] = agents[i].close()
			}
			return nil
		})
		err = errors.Join(append([]error{err}, cerrs...)...)
	}()
	if err := parallel(ctx, sz.agents, 4, "prepare", func(string, ...any) {}, func(ctx context.Context, i int) error {
		a, err := k.prepare(ctx, places[i])
		agents[i] = a
		return err
	}); err != nil {
		return sys, err
	}

	audit := newFleetAudit(auditPath, k.user(), ipToNode)
	logf("the API server without agents for %v", sz.idle)
	s0, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return sys, err
	}
	if err := sleep(ctx, sz.idle); err != nil {
		return sys, err
	}
	s1, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return sys, err
	}
	sys.Idle = s1.since(s0)

	logf("starting %d agents at once", sz.agents)
	t0 := time.Now()
	for _, a := range agents {
		if err := a.start(ctx); err != nil {
			return sys, err
		}
	}
	if err := parallel(ctx, sz.agents, sz.agents, "ready", func(string, ...any) {}, func(ctx context.Context, i int) error {
		if err := agents[i].waitReady(ctx, 10*time.Minute); err != nil {
			return fmt.Errorf("node %s: %w", places[i].name, err)
		}
		return nil
	}); err != nil {
		return sys, err
	}
	sys.ReadySeconds = time.Since(t0).Seconds()
	logf("all ready in %.1f s; waiting for every agent's watches", sys.ReadySeconds)
	if sys.WatchesPerAgent, err = waitEstablished(ctx, audit, ipToNode, 5*time.Minute); err != nil {
		return sys, err
	}
	sys.EstablishedSeconds = time.Since(t0).Seconds()
	s2, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return sys, err
	}
	sys.Start = s2.since(s1)
	logf("every agent's watches established in %.1f s: %v", sys.EstablishedSeconds, sys.WatchesPerAgent)

	logf("at rest for %v", sz.rest)
	if err := sleep(ctx, sz.rest); err != nil {
		return sys, err
	}
	if err := allRunning(agents, places); err != nil {
		return sys, err
	}
	s3, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return sys, err
	}
	sys.Rest = s3.since(s2)
	var rss float64
	for _, a := range agents {
		if st, err := procstat.ReadStatus(a.pid(), "VmRSS"); err == nil {
			rss += float64(st["VmRSS"]) / (1 << 20)
		}
	}
	sys.AgentRSSMiB = rss / float64(len(agents))

	logf("labelling namespace %s (%d pods on %d nodes) %s=%s", flipNS, sz.flipNodes*sz.podsPerNode, sz.flipNodes, ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
	if _, err := env.Client.CoreV1().Namespaces().Patch(ctx, flipNS, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return sys, fmt.Errorf("label namespace %s: %w", flipNS, err)
	}
	if sys.FlipQuiet, err = waitQuiet(ctx, audit, 10*time.Second, time.Minute); err != nil {
		return sys, err
	}
	if err := allRunning(agents, places); err != nil {
		return sys, err
	}
	s4, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return sys, err
	}
	sys.Flip = s4.since(s3)
	// The watches every agent held must all still be open.
	ow, err := audit.openWatches()
	if err != nil {
		return sys, err
	}
	for ip, node := range ipToNode {
		if !maps.Equal(ow[ip], sys.WatchesPerAgent) {
			return sys, fmt.Errorf("node %s holds watches %v after the flip, %v before", node, ow[ip], sys.WatchesPerAgent)
		}
	}

	// What a DaemonSet status write costs: the DaemonSet controller
	// writes it as the agents' pods become ready, during every rollout.
	ds, err := env.Client.AppsV1().DaemonSets(dsNS).Get(ctx, dsName, metav1.GetOptions{})
	if err != nil {
		return sys, err
	}
	ds.Status.DesiredNumberScheduled, ds.Status.CurrentNumberScheduled = int32(sz.agents), int32(sz.agents)
	ds.Status.NumberReady, ds.Status.NumberAvailable, ds.Status.UpdatedNumberScheduled = int32(sz.agents), int32(sz.agents), int32(sz.agents)
	ds.Status.ObservedGeneration = ds.Generation
	if _, err := env.Client.AppsV1().DaemonSets(dsNS).UpdateStatus(ctx, ds, metav1.UpdateOptions{}); err != nil {
		return sys, fmt.Errorf("write the DaemonSet's status: %w", err)
	}
	if _, err := waitQuiet(ctx, audit, 5*time.Second, 30*time.Second); err != nil {
		return sys, err
	}
	s5, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return sys, err
	}
	sys.DaemonSetStatus = s5.since(s4)
	if err := allRunning(agents, places); err != nil {
		return sys, err
	}
	logf("done: %d requests at start, %d at rest, %d at the flip", sys.Start.AgentRequests, sys.Rest.AgentRequests, sys.Flip.AgentRequests)
	return sys, nil
}

// allRunning is an error naming the first agent that exited.
func allRunning(agents []fleetAgent, places []fleetPlace) error {
	for i, a := range agents {
		if err := a.exited(); err != nil {
			return fmt.Errorf("the agent of node %s exited: %w", places[i].name, err)
		}
	}
	return nil
}

// waitEstablished waits until every node's agent holds at least one watch
// open and all hold the same ones, unchanged for five seconds, and
// returns them.
func waitEstablished(ctx context.Context, audit *fleetAudit, ipToNode map[string]string, within time.Duration) (map[string]int, error) {
	deadline := time.Now().Add(within)
	var last map[string]int
	stable := 0
	for {
		ow, err := audit.openWatches()
		if err != nil {
			return nil, err
		}
		var first map[string]int
		same, why := true, ""
		for ip, node := range ipToNode {
			w := ow[ip]
			switch {
			case len(w) == 0:
				same, why = false, "node "+node+" holds no watch"
			case first == nil:
				first = w
			case !maps.Equal(w, first):
				same, why = false, fmt.Sprintf("node %s holds %v, another %v", node, w, first)
			}
			if !same {
				break
			}
		}
		if same && maps.Equal(first, last) {
			stable++
		} else {
			stable = 0
		}
		last = first
		if same && stable >= 5 {
			return first, nil
		}
		if time.Now().After(deadline) {
			if why == "" {
				why = fmt.Sprintf("every node held %v at the last poll, but not at %d polls in a row", first, 5)
			}
			return nil, fmt.Errorf("the agents' watches were not all established within %v: %s", within, why)
		}
		if err := sleep(ctx, time.Second); err != nil {
			return nil, err
		}
	}
}

// waitQuiet waits until the agents made no request for quiet (and at
// least quiet has passed), or until within has passed: it reports
// whether they were quiet. Agents that ask all the time (a periodic
// request) are a figure, not a failure.
func waitQuiet(ctx context.Context, audit *fleetAudit, quiet, within time.Duration) (bool, error) {
	start := time.Now()
	for {
		q, err := audit.quietFor()
		if err != nil {
			return false, err
		}
		if q >= quiet && time.Since(start) >= quiet {
			return true, nil
		}
		if time.Since(start) > within {
			return false, nil
		}
		if err := sleep(ctx, 500*time.Millisecond); err != nil {
			return false, err
		}
	}
}

// leakedMounts is an error listing the mounts left under dir.
func leakedMounts(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var left []string
	for l := range strings.SplitSeq(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir) {
			left = append(left, f[4])
		}
	}
	if len(left) > 0 {
		return fmt.Errorf("mounts left behind: %s", strings.Join(left, ", "))
	}
	return nil
}

// apiSample is the API server at one moment.
type apiSample struct {
	at                  time.Time
	rss, hwm            int64
	cpu                 time.Duration
	watches, registered float64
	events, eventBytes  float64
	byResource          map[string]ResourceEvents
	requests            float64
	goroutines, heap    float64
	agents              auditCounts
}

func sampleAPI(ctx context.Context, env *kubeenv.Env, audit *fleetAudit) (apiSample, error) {
	s := apiSample{at: time.Now()}
	pid := env.APIServerPid()
	st, err := procstat.ReadStatus(pid, "VmRSS", "VmHWM")
	if err != nil {
		return s, fmt.Errorf("kube-apiserver's memory: %w", err)
	}
	s.rss, s.hwm = st["VmRSS"], st["VmHWM"]
	cpu, err := procstat.ReadCPU(pid)
	if err != nil {
		return s, fmt.Errorf("kube-apiserver's CPU: %w", err)
	}
	s.cpu = cpu.Total()
	b, err := env.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return s, fmt.Errorf("kube-apiserver's /metrics: %w", err)
	}
	text := string(b)
	s.watches, _ = metricSum(text, "apiserver_longrunning_requests", `verb="WATCH"`)
	var ok bool
	if s.registered, ok = metricSum(text, "apiserver_registered_watchers", ""); !ok {
		s.registered = -1
	}
	s.events, _ = metricSum(text, "apiserver_watch_events_total", "")
	s.eventBytes, _ = metricSum(text, "apiserver_watch_events_sizes_sum", "")
	s.byResource = map[string]ResourceEvents{}
	for res, v := range metricByResource(text, "apiserver_watch_events_total") {
		e := s.byResource[res]
		e.Events = v
		s.byResource[res] = e
	}
	for res, v := range metricByResource(text, "apiserver_watch_events_sizes_sum") {
		e := s.byResource[res]
		e.Bytes = v
		s.byResource[res] = e
	}
	s.requests, _ = metricSum(text, "apiserver_request_total", "")
	s.goroutines, _ = metricSum(text, "go_goroutines", "")
	s.heap, _ = metricSum(text, "go_memstats_heap_inuse_bytes", "")
	if s.agents, err = audit.counts(); err != nil {
		return s, fmt.Errorf("the audit log: %w", err)
	}
	return s, nil
}

// metricSum adds up the samples of name whose labels contain match.
func metricSum(text, name, match string) (float64, bool) {
	sum, seen := 0.0, false
	for l := range strings.SplitSeq(text, "\n") {
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		if match != "" && !strings.Contains(l, match) {
			continue
		}
		f := strings.Fields(l)
		if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
			sum, seen = sum+v, true
		}
	}
	return sum, seen
}

// metricByResource adds up the samples of name by their resource label,
// or kind label where the API server names none.
func metricByResource(text, name string) map[string]float64 {
	out := map[string]float64{}
	for l := range strings.SplitSeq(text, "\n") {
		if !strings.HasPrefix(l, name+"{") {
			continue
		}
		res := labelValue(l, "resource")
		if res == "" {
			res = labelValue(l, "kind")
		}
		f := strings.Fields(l)
		if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil && res != "" {
			out[res] += v
		}
	}
	return out
}

// labelValue is the value of label key in a sample line, "" if absent.
func labelValue(line, key string) string {
	_, rest, ok := strings.Cut(line, "{"+key+`="`)
	if !ok {
		_, rest, ok = strings.Cut(line, ","+key+`="`)
	}
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// since is the window from a to s.
func (s apiSample) since(a apiSample) FleetPhase {
	p := FleetPhase{
		Seconds:       s.at.Sub(a.at).Seconds(),
		AgentRequests: s.agents.total - a.agents.total, WatchStarts: s.agents.watchStarts - a.agents.watchStarts,
		ByKey:               map[string]int{},
		AllRequests:         s.requests - a.requests,
		APIServerCPUSeconds: (s.cpu - a.cpu).Seconds(),
		RSSMiB:              float64(s.rss) / (1 << 20), PeakRSSMiB: float64(s.hwm) / (1 << 20),
		LongRunningWatches: s.watches, RegisteredWatchers: s.registered,
		WatchEvents: s.events - a.events, WatchEventBytes: s.eventBytes - a.eventBytes,
		Goroutines: s.goroutines, HeapInuseMiB: s.heap / (1 << 20),
	}
	if len(s.byResource) > 0 {
		p.EventsByResource = map[string]ResourceEvents{}
		for res, e := range s.byResource {
			was := a.byResource[res]
			if d := (ResourceEvents{Events: e.Events - was.Events, Bytes: e.Bytes - was.Bytes}); d.Events > 0 {
				p.EventsByResource[res] = d
			}
		}
	}
	for k, v := range s.agents.byKey {
		if d := v - a.agents.byKey[k]; d > 0 {
			p.ByKey[k] = d
		}
	}
	return p
}

// ourFleet runs our install-cni on each node as the chart does.
type ourFleet struct {
	o       FleetOptions
	shipped *simnode.Shipped
}

func (f *ourFleet) name() string { return "ambient-cni" }

func (f *ourFleet) user() string {
	return "system:serviceaccount:" + simnode.ReleaseNamespace + ":" + f.shipped.ServiceAccount
}

// setup reads the chart's rendered defaults as committed (make
// check-manifests keeps them equal to the chart's).
func (f *ourFleet) setup(context.Context) (err error) {
	f.shipped, err = simnode.CommittedChart()
	return err
}

// install creates the chart's ServiceAccounts (the plugin's, which the
// agent makes tokens for, beside the agent's own) and its DaemonSet.
func (f *ourFleet) install(ctx context.Context, env *kubeenv.Env) (string, string, error) {
	return installChart(ctx, env, f.shipped.Manifest, simnode.ReleaseNamespace)
}

// installChart creates a rendered chart's ServiceAccounts, Services (ours:
// the release's signal, which every agent watches) and DaemonSet (in
// namespace when they name none).
func installChart(ctx context.Context, env *kubeenv.Env, manifest []byte, namespace string) (dsNS, dsName string, err error) {
	objs, err := kubeenv.ParseObjects(manifest)
	if err != nil {
		return "", "", err
	}
	for _, o := range objs {
		if o.GetKind() != "ServiceAccount" && o.GetKind() != "DaemonSet" && o.GetKind() != "Service" {
			continue
		}
		if o.GetNamespace() == "" {
			o.SetNamespace(namespace)
		}
		if _, err := env.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: o.GetNamespace()}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return "", "", fmt.Errorf("create namespace %s: %w", o.GetNamespace(), err)
		}
		if o.GetKind() == "DaemonSet" {
			ds := &appsv1.DaemonSet{}
			if err := k8sruntime.DefaultUnstructuredConverter.FromUnstructured(o.Object, ds); err != nil {
				return "", "", fmt.Errorf("decode the chart's DaemonSet: %w", err)
			}
			if _, err := env.Client.AppsV1().DaemonSets(ds.Namespace).Create(ctx, ds, metav1.CreateOptions{}); err != nil {
				return "", "", fmt.Errorf("create the chart's DaemonSet %s/%s: %w", ds.Namespace, ds.Name, err)
			}
			dsNS, dsName = ds.Namespace, ds.Name
			continue
		}
		if o.GetKind() == "Service" {
			svc := &corev1.Service{}
			if err := k8sruntime.DefaultUnstructuredConverter.FromUnstructured(o.Object, svc); err != nil {
				return "", "", fmt.Errorf("decode the chart's Service: %w", err)
			}
			if _, err := env.Client.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return "", "", fmt.Errorf("create the chart's Service %s/%s: %w", svc.Namespace, svc.Name, err)
			}
			continue
		}
		sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: o.GetNamespace(), Name: o.GetName()}}
		if _, err := env.Client.CoreV1().ServiceAccounts(sa.Namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return "", "", fmt.Errorf("create the chart's serviceaccount %s/%s: %w", sa.Namespace, sa.Name, err)
		}
	}
	if dsName == "" {
		return "", "", errors.New("the chart renders no DaemonSet")
	}
	return dsNS, dsName, nil
}

func (f *ourFleet) prepare(ctx context.Context, p fleetPlace) (fleetAgent, error) {
	n, err := simnode.Prepare(ctx, simnode.Options{
		Env: p.env, Chart: f.shipped, InstallCNI: f.o.InstallCNI, Plugin: f.o.Plugin,
		ReferencePlugins: p.refPlugins, Dir: p.dir, Name: p.name, APIHost: p.apiHost, Netns: p.netns,
	})
	if err != nil {
		return nil, err
	}
	return &ourFleetAgent{n: n}, nil
}

type ourFleetAgent struct{ n *simnode.Node }

func (a *ourFleetAgent) start(context.Context) error {
	_, err := a.n.StartAgent()
	return err
}

func (a *ourFleetAgent) waitReady(ctx context.Context, within time.Duration) error {
	if err := a.n.WaitReady(ctx, within); err != nil {
		return err
	}
	a.n.StartStandIn(ztunnel.Faults{})
	return nil
}

func (a *ourFleetAgent) exited() error {
	p := a.n.Agent()
	if p == nil {
		return errors.New("not started")
	}
	if p.Exited() {
		return fmt.Errorf("%v; log tail:\n%s", p.Err(), p.LogTail(20))
	}
	return nil
}

func (a *ourFleetAgent) pid() int { return a.n.Agent().Pid() }

func (a *ourFleetAgent) close() error { return a.n.Close() }

// istioFleet runs Istio's install-cni on each node as its chart does
// (ambient profile, iptables mode).
type istioFleet struct {
	o     FleetOptions
	chart *istioChart
}

func (f *istioFleet) name() string { return "istio-cni" }

func (f *istioFleet) user() string { return istioUser }

func (f *istioFleet) setup(ctx context.Context) (err error) {
	f.chart, err = renderIstioChart(ctx, f.o.IstioChart, false)
	return err
}

// install creates the chart's ServiceAccount and DaemonSet.
func (f *istioFleet) install(ctx context.Context, env *kubeenv.Env) (string, string, error) {
	return installChart(ctx, env, f.chart.Manifest, istioNamespace)
}

func (f *istioFleet) prepare(ctx context.Context, p fleetPlace) (fleetAgent, error) {
	n, err := prepareIstio(ctx, istioPlace{
		env: p.env, dir: p.dir, name: p.name, refPlugins: p.refPlugins,
		apiHost: p.apiHost, netns: p.netns, nodeIP: p.nodeIP,
	}, f.o.IstioInstallCNI, f.o.IstioPlugin, f.chart)
	if err != nil {
		return nil, err
	}
	return &istioFleetAgent{n: n}, nil
}

type istioFleetAgent struct {
	n      *istioNode
	ztStop func() error
}

func (a *istioFleetAgent) start(ctx context.Context) error {
	if err := a.n.start(ctx); err != nil {
		return err
	}
	zt := ztunnel.New(ztunnel.Config{SocketPath: a.n.ZDSSocket, Logger: slog.New(slog.DiscardHandler)})
	ztCtx, ztCancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- zt.Run(ztCtx) }() // owner: this agent; close waits
	a.ztStop = func() error { ztCancel(); return <-done }
	return nil
}

func (a *istioFleetAgent) waitReady(ctx context.Context, within time.Duration) error {
	_, _, err := a.n.waitChained(ctx, within)
	return err
}

func (a *istioFleetAgent) exited() error {
	if a.n.proc == nil {
		return errors.New("not started")
	}
	if a.n.proc.Exited() {
		return fmt.Errorf("%v; log tail:\n%s", a.n.proc.Err(), a.n.proc.LogTail(20))
	}
	return nil
}

func (a *istioFleetAgent) pid() int { return a.n.agentPid }

func (a *istioFleetAgent) close() error {
	var err error
	if a.ztStop != nil {
		err, a.ztStop = a.ztStop(), nil
	}
	return errors.Join(err, a.n.Close())
}

// WriteReport prints the run's figures per agent for each system, then
// the agents' requests by verb and resource. Nothing is asserted.
func (r *FleetResult) WriteReport(w io.Writer) error {
	l1, l2 := r.Machine.LoadStart, r.Machine.LoadEnd
	fmt.Fprintf(w, "ambient-cni bench-agents %s, commit %s: %d CPUs, load %.1f %.1f %.1f at start, %.1f %.1f %.1f at end; %.0f s\n\n",
		r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.Commit, r.Machine.CPUs, l1[0], l1[1], l1[2], l2[0], l2[1], l2[2], r.Seconds)
	if r.Quick {
		fmt.Fprintln(w, "QUICK run (a smoke test of the harness): the figures say nothing about scale.")
	}
	fmt.Fprintf(w, "%d agents, each on a simulated node (its Node object, network namespace and directories) against one kube-apiserver per system; the flip labels a namespace with %d pods on each of %d nodes (pods in the API only).\n",
		r.Agents, r.PodsPerNode, r.FlipNodes)
	if r.IstioMissing != "" {
		fmt.Fprintf(w, "istio-cni: not run: %s\n", r.IstioMissing)
	}
	fmt.Fprintln(w)
	n := float64(r.Agents)
	names := func(first string) []string {
		row := []string{first}
		for _, s := range r.Systems {
			if s.Error != "" {
				row = append(row, s.Name+" (failed: partial)")
			} else {
				row = append(row, s.Name)
			}
		}
		return row
	}
	rows := [][]string{names("per agent")}
	add := func(label string, f func(s *FleetSystem) string) {
		row := []string{label}
		for _, s := range r.Systems {
			row = append(row, f(s))
		}
		rows = append(rows, row)
	}
	idleRate := func(s *FleetSystem) float64 { return s.Idle.APIServerCPUSeconds / max(s.Idle.Seconds, 1) }
	add("all ready / all watches established: s", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f / %.1f", s.ReadySeconds, s.EstablishedSeconds)
	})
	add("watches held open", func(s *FleetSystem) string { return watchList(s.WatchesPerAgent) })
	add("start: requests (watches apart)", func(s *FleetSystem) string { return fmt.Sprintf("%.1f", float64(s.Start.AgentRequests)/n) })
	add("start: watches established", func(s *FleetSystem) string { return fmt.Sprintf("%.1f", float64(s.Start.WatchStarts)/n) })
	add("start: API server CPU beyond idle: ms", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f", (s.Start.APIServerCPUSeconds-idleRate(s)*s.Start.Seconds)*1000/n)
	})
	add("rest: requests per minute", func(s *FleetSystem) string {
		return fmt.Sprintf("%.2f", float64(s.Rest.AgentRequests)/n*60/s.Rest.Seconds)
	})
	add("rest: API server CPU beyond idle: ms per minute", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f", (s.Rest.APIServerCPUSeconds/s.Rest.Seconds-idleRate(s))*60*1000/n)
	})
	add("rest: API server RSS beyond idle: KiB", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f", (s.Rest.RSSMiB-s.Idle.RSSMiB)*1024/n)
	})
	add("rest: watch events sent per minute (bytes)", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f (%.0f)", s.Rest.WatchEvents/n*60/s.Rest.Seconds, s.Rest.WatchEventBytes/n*60/s.Rest.Seconds)
	})
	add("start: watch events sent (bytes)", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f (%.0f)", s.Start.WatchEvents/n, s.Start.WatchEventBytes/n)
	})
	add("rest: API server goroutines beyond idle", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f", (s.Rest.Goroutines-s.Idle.Goroutines)/n)
	})
	add("rest: API server Go heap in use beyond idle: KiB", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f", (s.Rest.HeapInuseMiB-s.Idle.HeapInuseMiB)*1024/n)
	})
	add("flip: requests (window: s)", func(s *FleetSystem) string {
		quiet := ""
		if !s.FlipQuiet {
			quiet = ", never quiet"
		}
		return fmt.Sprintf("%.2f (%.0f%s)", float64(s.Flip.AgentRequests)/n, s.Flip.Seconds, quiet)
	})
	add("flip: watch events sent (bytes)", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f (%.0f)", s.Flip.WatchEvents/n, s.Flip.WatchEventBytes/n)
	})
	add("flip: API server CPU beyond idle: ms", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f", (s.Flip.APIServerCPUSeconds-idleRate(s)*s.Flip.Seconds)*1000/n)
	})
	add("one DaemonSet status write: watch events sent (bytes)", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f (%.0f)", s.DaemonSetStatus.WatchEvents/n, s.DaemonSetStatus.WatchEventBytes/n)
	})
	add("agent's own RSS at rest: MiB", func(s *FleetSystem) string { return fmt.Sprintf("%.1f", s.AgentRSSMiB) })
	writeMarkdown(w, rows)

	fmt.Fprintln(w)
	rows = [][]string{names("the API server, all agents")}
	add("RSS idle (no agent) / at rest / after the flip: MiB", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f / %.0f / %.0f", s.Idle.RSSMiB, s.Rest.RSSMiB, s.Flip.RSSMiB)
	})
	add("peak RSS (VmHWM): MiB", func(s *FleetSystem) string { return fmt.Sprintf("%.0f", s.Flip.PeakRSSMiB) })
	add("Go heap in use idle / at rest: MiB", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f / %.0f", s.Idle.HeapInuseMiB, s.Rest.HeapInuseMiB)
	})
	add("goroutines idle / at rest", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f / %.0f", s.Idle.Goroutines, s.Rest.Goroutines)
	})
	add("CPU idle (no agent) / at rest: % of a core", func(s *FleetSystem) string {
		return fmt.Sprintf("%.1f / %.1f", idleRate(s)*100, s.Rest.APIServerCPUSeconds/s.Rest.Seconds*100)
	})
	add("CPU over the start: s", func(s *FleetSystem) string { return fmt.Sprintf("%.1f", s.Start.APIServerCPUSeconds) })
	add("WATCH requests open (longrunning) idle / at rest", func(s *FleetSystem) string {
		return fmt.Sprintf("%.0f / %.0f", s.Idle.LongRunningWatches, s.Rest.LongRunningWatches)
	})
	add("registered watchers idle / at rest", func(s *FleetSystem) string {
		if s.Rest.RegisteredWatchers < 0 {
			return "no such metric"
		}
		return fmt.Sprintf("%.0f / %.0f", s.Idle.RegisteredWatchers, s.Rest.RegisteredWatchers)
	})
	writeMarkdown(w, rows)

	fmt.Fprintln(w)
	keys := map[string]bool{}
	for _, s := range r.Systems {
		for _, p := range []FleetPhase{s.Start, s.Rest, s.Flip} {
			for k := range p.ByKey {
				keys[k] = true
			}
		}
	}
	rows = [][]string{{"requests per agent"}}
	for _, s := range r.Systems {
		rows[0] = append(rows[0], s.Name+" start", "rest", "flip")
	}
	for _, k := range slices.Sorted(maps.Keys(keys)) {
		row := []string{k}
		for _, s := range r.Systems {
			for _, p := range []FleetPhase{s.Start, s.Rest, s.Flip} {
				if v := p.ByKey[k]; v > 0 {
					row = append(row, fmt.Sprintf("%.2f", float64(v)/n))
				} else {
					row = append(row, "")
				}
			}
		}
		rows = append(rows, row)
	}
	writeMarkdown(w, rows)
	for _, s := range r.Systems {
		if s.Error != "" {
			fmt.Fprintf(w, "\n%s failed: %s\n", s.Name, s.Error)
		}
	}
	return nil
}

// watchList is "namespaces 1, pods (spec.nodeName=<node>) 1".
func watchList(m map[string]int) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(out, ", ")
}
