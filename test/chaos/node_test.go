package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/vishvananda/netlink"
	"k8s.io/client-go/rest"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/bench"
	"github.com/ambient-cni/ambient-cni/test/cnibin"
	"github.com/ambient-cni/ambient-cni/test/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/kubesim"
	"github.com/ambient-cni/ambient-cni/test/testnet"
	"github.com/ambient-cni/ambient-cni/test/ztunnel"
)

// keepEnv keeps a failed test's node directory (the agent's and the
// plugin's logs) for a look: AMBIENT_CHAOS_KEEP=1.
const keepEnv = "AMBIENT_CHAOS_KEEP"

// primaryConf is the node's primary CNI config the installer chains into.
const primaryConf = "10-bridge.conflist"

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
	// subnet is the pod network (a /16: host-local hands out addresses in
	// order, and a wrap within a run would reuse a deleted pod's IP).
	subnet netip.Prefix
}

// node is one node: the shipped install-cni as its own process with the
// chart's environment (node-local settings only pointed at this node, as
// make bench does), a ztunnel stand-in on its ZDS socket, and a kubelet
// simulator whose pods go through the primary conflist the installer
// chained the shipped plugin into.
type node struct {
	t       *testing.T
	env     *kubeenv.Env
	sh      *shipped
	name    string
	dir     string
	binDir  string
	confDir string
	bridge  string
	cfg     *installcni.Config
	environ []string
	logPath string
	health  string
	metrics string
	// rules reads pods' rules and the host probe set with the backend the
	// agent chose (the chart's auto), in this process's (private) host
	// netns, which is the agent's too.
	rules *rulesbackend.Backend

	mu      sync.Mutex
	agent   *bench.Process
	starts  int      // agent processes started
	crashed []string // agents found exited without being killed

	ztMu   sync.Mutex
	zt     *ztunnel.StandIn
	ztStop func()
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
	if !o.subnet.IsValid() {
		o.subnet = netip.MustParsePrefix("10.64.0.0/16")
	}
	n := &node{t: t, env: env, sh: sh, name: testnet.RandName("chaos-", 6)}
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
	n.binDir, n.confDir = filepath.Join(n.dir, "bin"), filepath.Join(n.dir, "net.d")
	for _, d := range []string{n.binDir, n.confDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range cnibin.ReferencePlugins {
		b, err := os.ReadFile(filepath.Join(cnibin.Paths(t)[0], p))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(n.binDir, p), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.bridge = testnet.RandName("ach", 8)
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(n.bridge); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	primary := cnibin.Conflist(cnibin.Network{Bridge: n.bridge, Subnet: o.subnet, DataDir: filepath.Join(n.dir, "ipam")})
	if err := os.WriteFile(filepath.Join(n.confDir, primaryConf), primary, 0o644); err != nil {
		t.Fatal(err)
	}

	ctx := context.Background()
	saCfg, err := env.ServiceAccountConfig(ctx, bench.ReleaseNamespace, sh.chart.ServiceAccount, sh.roles)
	if err != nil {
		t.Fatal(err)
	}
	if o.apiHost != "" {
		saCfg = rest.CopyConfig(saCfg)
		saCfg.Host = o.apiHost
	}
	kubeconfig := filepath.Join(n.dir, "agent.kubeconfig")
	if err := kubeenv.WriteKubeconfig(saCfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	envMap, err := bench.AgentEnv(sh.chart, bench.Node{
		Name: n.name, PodName: "ambient-cni-" + n.name,
		CNIBinDir: n.binDir, CNIConfDir: n.confDir, PluginBinary: sh.plugin,
		AgentSocket: filepath.Join(n.dir, "run", "ambient-cni", "agent.sock"),
		ZDSSocket:   filepath.Join(n.dir, "run", "ztunnel", "ztunnel.sock"),
		Kubeconfig:  kubeconfig,
	}, bench.Backend{})
	if err != nil {
		t.Fatal(err)
	}
	if n.cfg, err = installcni.Parse(nil, func(k string) string { return envMap[k] }, io.Discard); err != nil {
		t.Fatalf("install-cni refuses the chart's environment: %v", err)
	}
	n.environ = bench.Environ(envMap)
	n.health = bench.HealthURL(n.cfg.HealthAddr)
	n.metrics = bench.HealthURL(n.cfg.MetricsAddr)
	n.logPath = filepath.Join(n.dir, "install-cni.log")
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
		n.stopStandIn()
		if err := n.stopAgent(); err != nil {
			t.Errorf("install-cni shutdown: %v", err)
		}
		if t.Failed() {
			t.Logf("install-cni warnings and errors (log %s):\n%s", n.logPath, n.logTail(60, true))
		}
	})
	n.startAgent()
	n.waitReady(waitReadyTimeout)
	n.startStandIn()
	n.waitStandIn(time.Minute, "the stand-in's first snapshot", func() bool { return n.standIn().Ready() })

	chained, err := os.ReadFile(filepath.Join(n.confDir, primaryConf))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(chained), `"`+n.cfg.PluginType+`"`) {
		t.Fatalf("the agent is ready but did not chain %s into %s:\n%s", n.cfg.PluginType, primaryConf, chained)
	}
	n.kube = kubesim.NewNode(t, env.Client, n.name, []string{n.binDir}, chained)
	// The plugins' own logs (the shipped plugin warns on every call while
	// the agent is down) go to a file of the node, not the test output.
	pluginLog, err := os.OpenFile(filepath.Join(n.dir, "plugins.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pluginLog.Close() })
	n.kube.CNI = libcni.NewCNIConfigWithCacheDir([]string{n.binDir}, filepath.Join(n.dir, "cni-cache"),
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: pluginLog}, PluginDecoder: version.PluginDecoder{}})
	return n
}

// startAgent starts a new install-cni process, its output appended to the
// node's log.
func (n *node) startAgent() {
	n.t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.agent != nil && !n.agent.Exited() {
		n.t.Fatal("an agent is already running")
	}
	n.starts++
	if f, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
		fmt.Fprintf(f, "{\"msg\":\"chaos: starting install-cni #%d\"}\n", n.starts)
		_ = f.Close()
	}
	p, err := bench.StartProcess(n.sh.installCNI, n.sh.chart.Args, n.environ, n.logPath)
	if err != nil {
		n.t.Fatal(err)
	}
	n.agent = p
}

// killAgent SIGKILLs the running agent, as an OOM kill or a node problem
// would: nothing of its shutdown runs.
func (n *node) killAgent() {
	n.mu.Lock()
	p := n.agent
	n.mu.Unlock()
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
func (n *node) noteCrash(p *bench.Process) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.crashed = append(n.crashed, fmt.Sprintf("pid %d: %v; log tail:\n%s", p.Pid(), p.Err(), n.logTail(20, false)))
}

// crashes lists the agents that exited on their own so far (the current
// one included).
func (n *node) crashes() []string {
	if p := n.agentProc(); p != nil && p.Exited() {
		n.noteCrash(p)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.crashed...)
}

// agentStarts is how many agent processes were started.
func (n *node) agentStarts() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.starts
}

// stopAgent stops the agent as the kubelet would (SIGTERM); with no
// DaemonSet in the API this is an uninstall.
func (n *node) stopAgent() error {
	n.mu.Lock()
	p := n.agent
	n.agent = nil
	n.mu.Unlock()
	if p == nil {
		return nil
	}
	if p.Exited() {
		return nil // killed, or exited (reported where it was seen)
	}
	return p.Stop(30 * time.Second)
}

// agentProc is the current agent process.
func (n *node) agentProc() *bench.Process {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.agent
}

// agentPID is the current agent's pid; the test fails if it is not
// running.
func (n *node) agentPID() int {
	n.t.Helper()
	p := n.agentProc()
	if p == nil || p.Exited() {
		n.t.Fatalf("install-cni is not running; log tail:\n%s", n.logTail(30, false))
	}
	return p.Pid()
}

// ready reports whether the agent answers /readyz with 200.
func (n *node) ready() bool {
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(n.health + "/readyz")
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// waitReady waits for /readyz; the agent exiting meanwhile fails the test.
func (n *node) waitReady(within time.Duration) {
	n.t.Helper()
	deadline := time.Now().Add(within)
	for !n.ready() {
		if p := n.agentProc(); p == nil || p.Exited() {
			n.t.Fatalf("install-cni exited during start; log tail:\n%s", n.logTail(30, false))
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("install-cni not ready after %v; log tail:\n%s", within, n.logTail(30, false))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// startStandIn starts a fresh ztunnel stand-in (no workloads, as a
// restarted ztunnel) on the node's ZDS socket.
func (n *node) startStandIn() {
	n.ztMu.Lock()
	defer n.ztMu.Unlock()
	n.ztRuns++
	z := ztunnel.New(ztunnel.Config{SocketPath: n.cfg.ZDSSocket, Logger: slog.New(slog.DiscardHandler)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- z.Run(ctx) }()
	var once sync.Once
	n.zt = z
	n.ztStop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				n.t.Errorf("stand-in: %v", err)
			}
		})
	}
}

// stopStandIn stops the stand-in as a killed ztunnel goes: its connection
// closes and every pod it served is dropped with it.
func (n *node) stopStandIn() {
	n.ztMu.Lock()
	stop := n.ztStop
	n.ztStop = nil
	n.ztMu.Unlock()
	if stop != nil {
		stop()
	}
}

// standIn is the current stand-in.
func (n *node) standIn() *ztunnel.StandIn {
	n.ztMu.Lock()
	defer n.ztMu.Unlock()
	return n.zt
}

// waitStandIn waits (bounded) for cond over the stand-in's state.
func (n *node) waitStandIn(within time.Duration, what string, cond func() bool) {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if err := n.standIn().Wait(ctx, cond); err != nil {
		n.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// logTail returns the agent log's last lines (only warnings and errors
// when problems is set).
func (n *node) logTail(lines int, problems bool) string {
	b, err := os.ReadFile(n.logPath)
	if err != nil {
		return err.Error()
	}
	var keep []string
	for l := range strings.SplitSeq(strings.TrimRight(string(b), "\n"), "\n") {
		// Lines that are not JSON log records (the process's last words
		// on stderr, a panic) are always problems.
		if problems && strings.HasPrefix(l, "{") && !strings.Contains(l, `"level":"WARN"`) && !strings.Contains(l, `"level":"ERROR"`) && !strings.Contains(l, "chaos:") {
			continue
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
	st, err := bench.ReadStatus(pid, "VmRSS")
	if err != nil {
		return u, err
	}
	u.rss = float64(st["VmRSS"])
	m, err := bench.Scrape(n.metricsURL(), "go_goroutines", "go_memstats_heap_inuse_bytes")
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
func (n *node) metricsURL() string { return n.metrics }

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
	es, _ := nodefiles.List(nodefiles.ForSocket(n.cfg.AgentSocket).DelSpool())
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
		c0, err := bench.ReadCPU(pid)
		if err != nil {
			n.t.Fatal(err)
		}
		time.Sleep(time.Second)
		c1, err := bench.ReadCPU(pid)
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
