package chaos

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/scrape"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// keepEnv keeps a failed test's node directory (the agent's and the
// plugin's logs) for a look: AMBIENT_CHAOS_KEEP=1.
const keepEnv = "AMBIENT_CHAOS_KEEP"

// waitReadyTimeout bounds an agent's start until /readyz: generous for a
// loaded 2-core machine.
const waitReadyTimeout = 2 * time.Minute

// nodeOptions shape one test node.
type nodeOptions struct {
	// env is the API server (default: the package's shared one).
	env *kubeenv.Env
	// apiHost, when set, is where the agent reaches env's API server (a
	// proxy in front of it, see apiProxy).
	apiHost string
	// subnet is the pod network (default simnode's /16).
	subnet netip.Prefix
	// namespace is the agent's namespace, for a node with a DaemonSet of
	// its own (default: the chart's, shared, with none).
	namespace string
	// verifyPeriod, when set, is the agent's verify period instead of the
	// chart's (a scenario that needs every pod proven within its window).
	verifyPeriod time.Duration
}

// node is one simulated node (test/lib/simnode: the shipped install-cni as
// its own process with the chart's environment, a ztunnel stand-in, a
// kubelet simulator), with what the scenarios count: agents that crashed
// on their own, stand-in restarts.
type node struct {
	t      *testing.T
	env    *kubeenv.Env
	sim    *simnode.Node
	name   string
	dir    string
	bridge string
	cfg    *installcni.Config
	// rules reads pods' rules and the host probe set with the backend the
	// agent chose (the chart's auto), in this process's (private) host
	// netns, which is the agent's too.
	rules *rulesbackend.Backend

	mu      sync.Mutex
	crashed []string // agents found exited without being killed

	ztMu   sync.Mutex
	ztRuns int

	kube *kubesim.Node
}

// newNode builds a node, starts its agent and stand-in and returns once
// the agent is ready and the stand-in has its first snapshot.
func newNode(t *testing.T, o nodeOptions) *node {
	t.Helper()
	requireLong(t)
	sh := shippedBuild(t)
	env := o.env
	if env == nil {
		env = kube.Env(t)
	}
	n := &node{t: t, env: env, name: testnet.RandName("chaos-", 6)}
	var err error
	// A short directory: socket paths must fit in sun_path.
	if n.dir, err = os.MkdirTemp("", "achaos-"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() && os.Getenv(keepEnv) != "" {
			t.Logf("kept the node's directory (agent log, plugin log): %s", n.dir)
			return
		}
		_ = os.RemoveAll(n.dir)
	})
	var settings map[string]string
	if o.verifyPeriod > 0 {
		settings = map[string]string{"verify-period": o.verifyPeriod.String()}
	}
	n.sim, err = simnode.Prepare(context.Background(), simnode.Options{
		Env: env, Chart: sh.chart, InstallCNI: sh.installCNI, Plugin: sh.plugin,
		ReferencePlugins: cnibin.Paths(t)[0], Dir: n.dir, Name: n.name, Subnet: o.subnet, APIHost: o.apiHost,
		Namespace: o.namespace, Settings: settings,
	})
	if err != nil {
		t.Fatal(err)
	}
	n.bridge, n.cfg = n.sim.Bridge, n.sim.Config
	n.rules, err = rulesbackend.New(rulesbackend.Config{
		Backend: n.cfg.RulesBackend,
		Probe:   ruleset.HostProbeConfig{ProbeSNATv4: n.cfg.ProbeSNATv4, ProbeSNATv6: n.cfg.ProbeSNATv6},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.rules.Close() })

	// Registered before the kubelet simulator's cleanup, so it runs after
	// it: pods are torn down (CNI DEL) while the agent still runs.
	t.Cleanup(func() {
		if err := n.sim.Close(); err != nil {
			t.Errorf("node shutdown: %v", err)
		}
		if t.Failed() {
			t.Logf("install-cni warnings and errors (log %s):\n%s", n.sim.LogPath, n.logTail(60, true))
		}
	})
	n.startAgent()
	n.waitReady(waitReadyTimeout)
	n.startStandIn()
	n.waitStandIn(time.Minute, "the stand-in's first snapshot", func() bool { return n.standIn().Ready() })

	chained, err := os.ReadFile(filepath.Join(n.sim.ConfDir, simnode.PrimaryConf))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(chained), `"`+n.cfg.PluginType+`"`) {
		t.Fatalf("the agent is ready but did not chain %s into %s:\n%s", n.cfg.PluginType, simnode.PrimaryConf, chained)
	}
	n.sim.Chained = chained
	if n.kube, err = n.sim.Kubelet(t); err != nil {
		t.Fatal(err)
	}
	return n
}

// startAgent starts a new install-cni process, its output appended to the
// node's log.
func (n *node) startAgent() {
	n.t.Helper()
	if _, err := n.sim.StartAgent(); err != nil {
		n.t.Fatal(err)
	}
}

// killAgent SIGKILLs the running agent, as an OOM kill or a node problem
// would: nothing of its shutdown runs.
func (n *node) killAgent() {
	p := n.sim.Agent()
	if p == nil {
		return
	}
	if p.Exited() {
		n.noteCrash(p)
		return
	}
	p.Kill()
}

// noteCrash records an agent that exited without being killed.
func (n *node) noteCrash(p *childproc.Proc) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.crashed = append(n.crashed, fmt.Sprintf("pid %d: %v; log tail:\n%s", p.Pid(), p.Err(), n.logTail(20, false)))
}

// crashes lists the agents that exited on their own so far (the current
// one included).
func (n *node) crashes() []string {
	if p := n.sim.Agent(); p != nil && p.Exited() {
		n.noteCrash(p)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.crashed...)
}

// agentStarts is how many agent processes were started.
func (n *node) agentStarts() int { return n.sim.AgentStarts() }

// agentPID is the current agent's pid; the test fails if it is not
// running.
func (n *node) agentPID() int {
	n.t.Helper()
	p := n.sim.Agent()
	if p == nil || p.Exited() {
		n.t.Fatalf("install-cni is not running; log tail:\n%s", n.logTail(30, false))
	}
	return p.Pid()
}

// ready reports whether the agent answers /readyz with 200.
func (n *node) ready() bool { return n.sim.Ready() }

// waitReady waits for /readyz; the agent exiting meanwhile fails the test.
func (n *node) waitReady(within time.Duration) {
	n.t.Helper()
	if err := n.sim.WaitReady(context.Background(), within); err != nil {
		n.t.Fatal(err)
	}
}

// startStandIn starts a fresh ztunnel stand-in (no workloads, as a
// restarted ztunnel) on the node's ZDS socket.
func (n *node) startStandIn() {
	n.ztMu.Lock()
	n.ztRuns++
	n.ztMu.Unlock()
	n.sim.StartStandIn(ztunnel.Faults{})
}

// stopStandIn stops the stand-in as a killed ztunnel goes: its connection
// closes and every pod it served is dropped with it.
func (n *node) stopStandIn() {
	if err := n.sim.StopStandIn(); err != nil {
		n.t.Errorf("stand-in: %v", err)
	}
}

// standIn is the current stand-in.
func (n *node) standIn() *ztunnel.StandIn { return n.sim.StandIn() }

// waitStandIn waits (bounded) for cond over the stand-in's state.
func (n *node) waitStandIn(within time.Duration, what string, cond func() bool) {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if err := n.standIn().Wait(ctx, cond); err != nil {
		n.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// logTime is a log record's time, text or JSON.
var logTime = regexp.MustCompile(`^time=\S+ |"time":"[^"]*",?`)

// logTail returns the agent log's last lines (only warnings and errors
// when problems is set).
func (n *node) logTail(lines int, problems bool) string {
	b, err := os.ReadFile(n.sim.LogPath)
	if err != nil {
		return err.Error()
	}
	// A record repeated with only its time changed (a retry every few
	// seconds) is kept once, where it last appeared, with its count: it
	// must not push the other problems out of the tail.
	var order []string
	last := map[string]string{}
	count := map[string]int{}
	for l := range strings.SplitSeq(strings.TrimRight(string(b), "\n"), "\n") {
		// Lines that are not log records, text or JSON (the process's
		// last words on stderr, a panic) are always problems.
		record := strings.HasPrefix(l, "{") || strings.HasPrefix(l, "time=")
		problem := strings.Contains(l, `"level":"WARN"`) || strings.Contains(l, `"level":"ERROR"`) || strings.Contains(l, " level=WARN ") || strings.Contains(l, " level=ERROR ")
		if problems && record && !problem && !strings.Contains(l, "simnode:") {
			continue
		}
		key := l
		if record {
			key = logTime.ReplaceAllString(l, "")
		}
		if count[key] > 0 {
			order = slices.DeleteFunc(order, func(k string) bool { return k == key })
		}
		order = append(order, key)
		last[key] = l
		count[key]++
	}
	keep := make([]string, 0, len(order))
	for _, k := range order {
		l := last[k]
		if count[k] > 1 {
			l += fmt.Sprintf(" (logged %d times)", count[k])
		}
		keep = append(keep, l)
	}
	if len(keep) > lines {
		keep = keep[len(keep)-lines:]
	}
	return strings.Join(keep, "\n")
}

// usage is what the agent holds: descriptors (all, and network
// namespaces among them), goroutines and resident memory.
type usage struct {
	fds, netns int
	goroutines int
	rss, heap  float64 // bytes
}

func (u usage) String() string {
	return fmt.Sprintf("%d fds (%d netns), %d goroutines, RSS %.1f MiB, heap in use %.1f MiB",
		u.fds, u.netns, u.goroutines, u.rss/(1<<20), u.heap/(1<<20))
}

// usage reads the running agent's usage from /proc and its /metrics.
func (n *node) usage() (usage, error) {
	pid := n.agentPID()
	var u usage
	var err error
	if u.fds, u.netns, err = fdCounts(pid); err != nil {
		return u, err
	}
	st, err := procstat.ReadStatus(pid, "VmRSS")
	if err != nil {
		return u, err
	}
	u.rss = float64(st["VmRSS"])
	m, err := scrape.Values(n.metricsURL(), "go_goroutines", "go_memstats_heap_inuse_bytes")
	if err != nil {
		return u, err
	}
	g, ok := m["go_goroutines"]
	if !ok {
		return u, errors.New("no go_goroutines in /metrics")
	}
	u.goroutines, u.heap = int(g), m["go_memstats_heap_inuse_bytes"]
	return u, nil
}

// metricsURL is where the agent serves /metrics (its own address, not
// the health one).
func (n *node) metricsURL() string { return n.sim.MetricsURL }

// heldNetns counts the network namespaces the agent holds open.
func (n *node) heldNetns() (int, error) {
	_, held, err := fdCounts(n.agentPID())
	return held, err
}

// fdCounts counts pid's open descriptors, and the network namespaces
// among them.
func fdCounts(pid int) (fds, netns int, err error) {
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, 0, err
	}
	for _, e := range ents {
		fds++
		if l, err := os.Readlink(dir + "/" + e.Name()); err == nil && strings.HasPrefix(l, "net:[") {
			netns++
		}
	}
	return fds, netns, nil
}

// spooled lists DELs the plugin spooled and the agent has not replayed.
func (n *node) spooled() int {
	es, _ := nodefiles.List(n.cfg.Layout().DelSpool())
	return len(es)
}

// idle waits until the agent used under 20 ms of CPU (own and children's)
// for a whole second: work it does after a CNI call returned or an
// informer event is then done.
func (n *node) idle(within time.Duration) {
	n.t.Helper()
	deadline := time.Now().Add(within)
	for {
		pid := n.agentPID()
		c0, err := procstat.ReadCPU(pid)
		if err != nil {
			n.t.Fatal(err)
		}
		time.Sleep(time.Second)
		c1, err := procstat.ReadCPU(pid)
		if err != nil {
			n.t.Fatal(err)
		}
		if c1.Sub(c0).Total() < 20*time.Millisecond {
			return
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("the agent stayed busy for %v", within)
		}
	}
}
