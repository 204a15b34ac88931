package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The fleet simulation (`make bench-fleet`) measures what thousands of
// node agents cost one API server, where `make bench-agents` runs 50 real
// agent processes. One process opens, for each of N simulated nodes,
// exactly what that node's agent opens: ours through install-cni's own
// NewAPIWatches (the same informers, selectors, metadata-only watches,
// content types and token request, from the chart's settings), each node
// with its own client, connection and source address; istio-cni's set as
// its sources build it (fleetsimagents.go). Per N and system, against a
// fresh kube-apiserver and etcd: the API server at rest, at a namespace
// flip, at DaemonSet status writes, and at a restart wave (every agent
// gone, then all back at once). It asserts only that every simulated
// agent holds the same watches; the figures are information.

// FleetSimOptions configure RunFleetSim.
type FleetSimOptions struct {
	// RepoRoot is the repository (git commit of the result).
	RepoRoot string
	// Nodes are the fleet sizes, each against a fresh API server
	// (default 100 and 1,000; quick: 20).
	Nodes []int
	// IstioChart is Istio's istio-cni chart, which gives istio-cni's
	// ServiceAccount and RBAC (IstioBinaries); IstioMissing, when set,
	// says why istio-cni's column is left out.
	IstioChart, IstioMissing string
	// Quick runs short windows: the smoke run of `make test`.
	Quick bool
	// Log receives progress lines.
	Log io.Writer
}

type fleetSimSizes struct {
	idle, rest time.Duration
	// statusWrites is how many DaemonSet status writes are measured.
	statusWrites           int
	flipNodes, podsPerNode int
	deadline               time.Duration
}

func (o FleetSimOptions) sizes() fleetSimSizes {
	if o.Quick {
		return fleetSimSizes{idle: 2 * time.Second, rest: 3 * time.Second, statusWrites: 3, flipNodes: 2, podsPerNode: 2, deadline: 5 * time.Minute}
	}
	return fleetSimSizes{idle: 10 * time.Second, rest: 30 * time.Second, statusWrites: 20, flipNodes: 10, podsPerNode: 5, deadline: time.Hour}
}

// FleetSimResult is one run of the fleet simulation; it is written as JSON.
type FleetSimResult struct {
	Started      time.Time      `json:"started"`
	Seconds      float64        `json:"seconds"`
	Quick        bool           `json:"quick"`
	Commit       string         `json:"commit"`
	Machine      Machine        `json:"machine"`
	IstioMissing string         `json:"istioMissing,omitempty"`
	Runs         []*FleetSimRun `json:"runs"`
}

// FleetSimRun is one system's N simulated agents against their own API
// server.
type FleetSimRun struct {
	System string `json:"system"`
	Nodes  int    `json:"nodes"`
	Error  string `json:"error,omitempty"`
	// WatchesPerAgent is what each agent held open, by resource (every
	// agent the same).
	WatchesPerAgent map[string]int `json:"watchesPerAgent"`
	// StartSeconds and RestartSeconds are from starting every agent until
	// all held their watches and had their initial state.
	StartSeconds   float64 `json:"startSeconds"`
	RestartSeconds float64 `json:"restartSeconds"`
	// StatusWrites is how many DaemonSet status writes Status spans.
	StatusWrites int `json:"statusWrites"`
	// Agent events delivered, bookmarks apart, over the flip and the
	// status writes: what the simulated agents' watches received.
	FlipAgentEvents   int64 `json:"flipAgentEvents"`
	StatusAgentEvents int64 `json:"statusAgentEvents"`
	// Idle is the API server with the nodes but no agent; Start from
	// starting every agent until all held their watches; Rest a window of
	// every agent idle; Flip a namespace labelled ambient until every
	// agent had the event; Status the DaemonSet status writes until the
	// agents' watches were quiet; Restart every agent starting again at
	// once (the watch cache warm); APIRestart from the API server ready
	// again after a restart, its watch cache new, until every running
	// agent held its watches again (each by its own back-off).
	Idle    FleetPhase `json:"idle"`
	Start   FleetPhase `json:"start"`
	Rest    FleetPhase `json:"rest"`
	Flip    FleetPhase `json:"flip"`
	Status  FleetPhase `json:"status"`
	Restart FleetPhase `json:"restart"`
	// APIRestartSeconds is from the API server ready again until every
	// agent held its watches.
	APIRestart        FleetPhase `json:"apiRestart"`
	APIRestartSeconds float64    `json:"apiRestartSeconds"`
	// APIRestartError says why the API server's restart was not measured
	// (it failed to start again): the other phases stand.
	APIRestartError string `json:"apiRestartError,omitempty"`
	// SimCPUSeconds is the simulator's own CPU over the run: it shares
	// the machine with the API server.
	SimCPUSeconds float64 `json:"simCpuSeconds"`
}

// simSystem is one system's way of simulating its agents.
type simSystem interface {
	name() string
	// user is its ServiceAccount as the audit log names it.
	user() string
	// install makes what its chart installs once per cluster and returns
	// its DaemonSet and the agents' credentials.
	install(ctx context.Context, env *kubeenv.Env) (dsNS, dsName string, sa *rest.Config, err error)
	agent(node string, sa *rest.Config, src net.IP, n *simCounts) (simAgent, error)
}

// RunFleetSim runs the fleet simulation for each N: ours, then
// istio-cni's when its chart is at hand.
func RunFleetSim(ctx context.Context, o FleetSimOptions) (res *FleetSimResult, err error) {
	if o.Log == nil {
		o.Log = io.Discard
	}
	if len(o.Nodes) == 0 {
		o.Nodes = []int{100, 1000}
		if o.Quick {
			o.Nodes = []int{20}
		}
	}
	sz := o.sizes()
	ctx, cancel := context.WithTimeout(ctx, sz.deadline)
	defer cancel()
	res = &FleetSimResult{
		Started: time.Now(), Quick: o.Quick, Commit: commit(o.RepoRoot), IstioMissing: o.IstioMissing,
		Machine: Machine{CPUs: runtime.NumCPU(), Kernel: kernel(), Go: runtime.Version(), LoadStart: procstat.LoadAvg()},
	}
	defer func() {
		res.Machine.LoadEnd = procstat.LoadAvg()
		res.Seconds = time.Since(res.Started).Seconds()
	}()
	chart, err := simnode.CommittedChart()
	if err != nil {
		return res, err
	}
	systems := []simSystem{&ourSim{chart: chart}}
	if o.IstioMissing == "" {
		ic, err := renderIstioChart(ctx, o.IstioChart, false)
		if err != nil {
			res.IstioMissing = err.Error()
		} else {
			systems = append(systems, &istioSim{chart: ic})
		}
	}
	var errs error
	for _, n := range o.Nodes {
		for _, s := range systems {
			r := &FleetSimRun{System: s.name(), Nodes: n}
			res.Runs = append(res.Runs, r)
			if err := runFleetSim(ctx, o, sz, s, r); err != nil {
				r.Error = err.Error()
				errs = errors.Join(errs, fmt.Errorf("%s, %d nodes: %w", s.name(), n, err))
			}
		}
	}
	return res, errs
}

// simSource is node i's source address: one of loopback's, so the audit
// log tells the nodes apart as it does real agents, by address.
func simSource(i int) net.IP {
	return net.IPv4(127, 1+byte(i/62500), byte(i/250%250), byte(i%250+1))
}

// simFleet is one run's simulated agents.
type simFleet struct {
	sys    simSystem
	sa     *rest.Config
	nodes  []string
	srcs   []net.IP
	counts []*simCounts
	agents []simAgent
	stop   context.CancelFunc
	wg     sync.WaitGroup
}

// start makes a fresh agent on every node (a new process) and runs them
// all at once.
func (f *simFleet) start(ctx context.Context) error {
	agents := make([]simAgent, len(f.nodes))
	for i, node := range f.nodes {
		a, err := f.sys.agent(node, f.sa, f.srcs[i], f.counts[i])
		if err != nil {
			return err
		}
		agents[i] = a
	}
	f.agents = agents
	actx, cancel := context.WithCancel(ctx)
	f.stop = cancel
	for _, a := range agents {
		f.wg.Go(func() { _ = a.run(actx) })
	}
	return nil
}

// halt ends every agent: its watches end, its connection closes.
func (f *simFleet) halt() {
	if f.stop != nil {
		f.stop()
		f.wg.Wait()
		f.stop = nil
	}
}

func (f *simFleet) allSynced() bool {
	for _, a := range f.agents {
		if !a.synced() {
			return false
		}
	}
	return true
}

// total adds up one counter of every agent.
func (f *simFleet) total(get func(*simCounts) int64) int64 {
	var t int64
	for _, c := range f.counts {
		t += get(c)
	}
	return t
}

func runFleetSim(ctx context.Context, o FleetSimOptions, sz fleetSimSizes, sys simSystem, r *FleetSimRun) (err error) {
	logf := func(format string, args ...any) {
		fmt.Fprintf(o.Log, "%s, %d nodes: "+format+"\n", append([]any{sys.name(), r.Nodes}, args...)...)
	}
	simCPU0, _ := procstat.ReadCPU(os.Getpid())
	defer func() {
		if c, err := procstat.ReadCPU(os.Getpid()); err == nil {
			r.SimCPUSeconds = (c.Own - simCPU0.Own).Seconds()
		}
	}()
	work, err := os.MkdirTemp("", "afleetsim-")
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, os.RemoveAll(work)) }()
	policy, auditPath := filepath.Join(work, "audit-policy.yaml"), filepath.Join(work, "audit.log")
	if err := os.WriteFile(policy, []byte(fleetAuditPolicy(sys.user())), 0o644); err != nil {
		return err
	}
	logf("starting etcd and kube-apiserver")
	env, err := kubeenv.Launch(ctx, kubeenv.Options{Dir: filepath.Join(work, "kube"), APIServerArgs: auditArgs(policy, auditPath)})
	if err != nil {
		return fmt.Errorf("start API server (build it with %s): %w", kubeenv.BuildCommand, err)
	}
	defer env.Stop()
	dsNS, dsName, sa, err := sys.install(ctx, env)
	if err != nil {
		return err
	}

	f := &simFleet{sys: sys, sa: sa}
	defer f.halt()
	tag := testnet.RandName("", 4)
	ipToNode := map[string]string{}
	for i := range r.Nodes {
		node := fmt.Sprintf("sim-%s-%04d", tag, i)
		f.nodes, f.srcs, f.counts = append(f.nodes, node), append(f.srcs, simSource(i)), append(f.counts, &simCounts{})
		ipToNode[simSource(i).String()] = node
	}
	logf("making %d nodes", r.Nodes)
	if err := parallel(ctx, r.Nodes, 8, "nodes", func(string, ...any) {}, func(ctx context.Context, i int) error {
		return createNode(ctx, env.Client, f.nodes[i])
	}); err != nil {
		return err
	}
	flipNS, err := createNamespace(ctx, env.Client, "fleet-flip", nil)
	if err != nil {
		return err
	}
	for i := range min(sz.flipNodes, r.Nodes) {
		for j := range sz.podsPerNode {
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: flipNS, Name: fmt.Sprintf("app-%02d-%d", i, j), Labels: map[string]string{"app": "flip"}},
				Spec:       corev1.PodSpec{NodeName: f.nodes[i], Containers: []corev1.Container{{Name: "app", Image: "app:1"}}},
			}
			if _, err := env.Client.CoreV1().Pods(flipNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("create pod %s/%s: %w", flipNS, pod.Name, err)
			}
		}
	}

	audit := newFleetAudit(auditPath, sys.user(), ipToNode)
	logf("the API server without agents for %v", sz.idle)
	s0, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	if err := sleep(ctx, sz.idle); err != nil {
		return err
	}
	s1, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.Idle = s1.since(s0)

	logf("starting %d agents at once", r.Nodes)
	t0 := time.Now()
	if err := f.start(ctx); err != nil {
		return err
	}
	if r.WatchesPerAgent, err = waitSimEstablished(ctx, f, audit, ipToNode); err != nil {
		return err
	}
	r.StartSeconds = time.Since(t0).Seconds()
	s2, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.Start = s2.since(s1)
	logf("every agent established and synced in %.1f s: %s", r.StartSeconds, watchList(r.WatchesPerAgent))

	logf("at rest for %v", sz.rest)
	if err := sleep(ctx, sz.rest); err != nil {
		return err
	}
	s3, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.Rest = s3.since(s2)

	logf("labelling namespace %s %s=%s", flipNS, ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
	nsBefore := make([]int64, len(f.counts))
	for i, c := range f.counts {
		nsBefore[i] = c.namespaces.Load()
	}
	all0 := f.total(func(c *simCounts) int64 { return c.pods.Load() + c.namespaces.Load() + c.services.Load() })
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
	if _, err := env.Client.CoreV1().Namespaces().Patch(ctx, flipNS, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("label namespace %s: %w", flipNS, err)
	}
	if err := pollUntil(ctx, 5*time.Minute, "every agent to get the namespace's event", func() bool {
		for i, c := range f.counts {
			if c.namespaces.Load() <= nsBefore[i] {
				return false
			}
		}
		return true
	}); err != nil {
		return err
	}
	s4, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.Flip = s4.since(s3)
	r.FlipAgentEvents = f.total(func(c *simCounts) int64 { return c.pods.Load() + c.namespaces.Load() + c.services.Load() }) - all0

	// The DaemonSet controller writes the status as the agents' pods
	// become ready: about once per node in a rollout.
	logf("writing the DaemonSet's status %d times", sz.statusWrites)
	all1 := f.total(func(c *simCounts) int64 { return c.pods.Load() + c.namespaces.Load() + c.services.Load() })
	for i := range sz.statusWrites {
		ds, err := env.Client.AppsV1().DaemonSets(dsNS).Get(ctx, dsName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n := int32(r.Nodes)
		ds.Status.DesiredNumberScheduled, ds.Status.CurrentNumberScheduled = n, n
		ds.Status.NumberReady, ds.Status.NumberAvailable, ds.Status.UpdatedNumberScheduled = int32(i+1), int32(i+1), int32(i+1)
		ds.Status.ObservedGeneration = ds.Generation
		if _, err := env.Client.AppsV1().DaemonSets(dsNS).UpdateStatus(ctx, ds, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("write the DaemonSet's status: %w", err)
		}
	}
	r.StatusWrites = sz.statusWrites
	if err := waitSettled(ctx, func() int64 {
		return f.total(func(c *simCounts) int64 { return c.pods.Load() + c.namespaces.Load() + c.services.Load() })
	}); err != nil {
		return err
	}
	s5, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.Status = s5.since(s4)
	r.StatusAgentEvents = f.total(func(c *simCounts) int64 { return c.pods.Load() + c.namespaces.Load() + c.services.Load() }) - all1

	logf("stopping every agent")
	f.halt()
	if err := pollUntil(ctx, 5*time.Minute, "every agent's watches to end", func() bool {
		ow, err := audit.openWatches()
		return err == nil && len(ow) == 0
	}); err != nil {
		return err
	}
	s6, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	logf("restarting %d agents at once", r.Nodes)
	t1 := time.Now()
	if err := f.start(ctx); err != nil {
		return err
	}
	again, err := waitSimEstablished(ctx, f, audit, ipToNode)
	if err != nil {
		return err
	}
	if !maps.Equal(again, r.WatchesPerAgent) {
		return fmt.Errorf("after the restart every agent holds %s, before %s", watchList(again), watchList(r.WatchesPerAgent))
	}
	r.RestartSeconds = time.Since(t1).Seconds()
	s7, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.Restart = s7.since(s6)
	logf("restart wave %.1f s, API server CPU %.1f s; restarting the API server", r.RestartSeconds, r.Restart.APIServerCPUSeconds)

	env.StopAPIServer()
	// The stopped server's watches are gone whether or not it logged their
	// end; forgotten now, before the new one starts: agents reconnect
	// while it is still starting (its post-start hooks take long at 1,000
	// agents), and a watch begun then, forgotten after, would count as
	// missing until its timeout (up to 10 minutes) renewed it.
	if err := audit.forgetOpen(); err != nil {
		return err
	}
	if err := env.StartAPIServer(ctx, 5*time.Minute); err != nil {
		// On a loaded machine its post-start hooks can time out: the
		// phases before stand.
		msg, _, _ := strings.Cut(err.Error(), "\n")
		r.APIRestartError = "the API server did not start again: " + msg
		logf("%s", r.APIRestartError)
		return nil
	}
	t2 := time.Now()
	s8, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	again, err = waitEstablished(ctx, audit, ipToNode, 10*time.Minute)
	if err != nil {
		return fmt.Errorf("after the API server's restart: %w", err)
	}
	if !maps.Equal(again, r.WatchesPerAgent) {
		return fmt.Errorf("after the API server's restart every agent holds %s, before %s", watchList(again), watchList(r.WatchesPerAgent))
	}
	r.APIRestartSeconds = time.Since(t2).Seconds()
	s9, err := sampleAPI(ctx, env, audit)
	if err != nil {
		return err
	}
	r.APIRestart = s9.since(s8)
	logf("done: every agent back on the restarted API server in %.1f s", r.APIRestartSeconds)
	return nil
}

// waitSimEstablished waits until every agent has its initial state and
// every node holds the same watches, unchanged for five seconds.
func waitSimEstablished(ctx context.Context, f *simFleet, audit *fleetAudit, ipToNode map[string]string) (map[string]int, error) {
	if err := pollUntil(ctx, 10*time.Minute, "every agent's initial state", f.allSynced); err != nil {
		return nil, err
	}
	return waitEstablished(ctx, audit, ipToNode, 10*time.Minute)
}

// pollUntil polls cond every 200 ms until it holds, or fails after within.
func pollUntil(ctx context.Context, within time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("waited %v for %s", within, what)
		}
		if err := sleep(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// waitSettled waits until count has not moved for two seconds (at most
// five minutes): the writes' events all delivered.
func waitSettled(ctx context.Context, count func() int64) error {
	last, since := count(), time.Now()
	return pollUntil(ctx, 5*time.Minute, "the DaemonSet's events to settle", func() bool {
		if c := count(); c != last {
			last, since = c, time.Now()
		}
		return time.Since(since) >= 2*time.Second
	})
}

// ourSim simulates our agents from the chart's committed rendering.
type ourSim struct{ chart *simnode.Shipped }

func (s *ourSim) name() string { return "ambient-cni" }

func (s *ourSim) user() string {
	return "system:serviceaccount:" + simnode.ReleaseNamespace + ":" + s.chart.ServiceAccount
}

// install creates the chart's ServiceAccounts and DaemonSet, and the
// agent's and the plugin's RBAC as the chart grants it.
func (s *ourSim) install(ctx context.Context, env *kubeenv.Env) (string, string, *rest.Config, error) {
	dsNS, dsName, err := installChart(ctx, env, s.chart.Manifest, simnode.ReleaseNamespace)
	if err != nil {
		return "", "", nil, err
	}
	roles, err := kubeenv.ExtractRoles(s.chart.Manifest)
	if err != nil {
		return "", "", nil, err
	}
	sa, err := env.ServiceAccountConfig(ctx, simnode.ReleaseNamespace, s.chart.ServiceAccount, roles)
	if err != nil {
		return "", "", nil, err
	}
	if plugin := s.chart.Env["AMBIENT_PLUGIN_SERVICE_ACCOUNT"]; plugin != "" {
		pluginRoles, err := kubeenv.ExtractPluginRoles(s.chart.Manifest)
		if err != nil {
			return "", "", nil, err
		}
		if _, err := env.ServiceAccountConfig(ctx, simnode.ReleaseNamespace, plugin, pluginRoles); err != nil {
			return "", "", nil, err
		}
	}
	return dsNS, dsName, sa, nil
}

func (s *ourSim) agent(node string, sa *rest.Config, src net.IP, n *simCounts) (simAgent, error) {
	return newOurSimAgent(s.chart, node, sa, src, n)
}

// istioSim simulates istio-cni's agents with its chart's ServiceAccount
// and RBAC.
type istioSim struct{ chart *istioChart }

func (s *istioSim) name() string { return "istio-cni" }

func (s *istioSim) user() string { return istioUser }

func (s *istioSim) install(ctx context.Context, env *kubeenv.Env) (string, string, *rest.Config, error) {
	dsNS, dsName, err := installChart(ctx, env, s.chart.Manifest, istioNamespace)
	if err != nil {
		return "", "", nil, err
	}
	sa, err := env.ServiceAccountConfig(ctx, istioNamespace, s.chart.ServiceAccount, s.chart.RBAC)
	if err != nil {
		return "", "", nil, err
	}
	return dsNS, dsName, sa, nil
}

func (s *istioSim) agent(node string, sa *rest.Config, src net.IP, n *simCounts) (simAgent, error) {
	return newIstioSimAgent(node, sa, src, n), nil
}
