package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/metrics"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// kube is the package's one etcd + kube-apiserver.
var kube kubeenv.Shared

// TestMain runs the package in a network namespace of its own: its nodes
// use the test process's namespace as their host (bridges and pod
// gateways, the API server's and agents' loopback ports) and the
// host-clean checks read it, so nothing here meets another package's
// nodes, another test run or a real node on the machine. The reference
// CNI plugins are built first, outside, where their modules can be
// downloaded.
func TestMain(m *testing.M) {
	os.Exit(testnet.MainInOwnNetns(cnibin.Prefetch, func() int { return kube.Run(m) }))
}

const (
	// agentSA is the chart's ServiceAccount for the agent, bound (by
	// simnode) to the shipped RBAC.
	agentSA = "ambient-cni"
	// appPort is where each pod's HTTP app listens.
	appPort = 8080
	// waitLong bounds every "eventually" that is not itself an acceptance
	// figure: generous for a loaded 2-core CI machine.
	waitLong = 30 * time.Second
)

// nodeOptions shape one test node.
type nodeOptions struct {
	// ZtunnelWait is the agent's --ztunnel-wait (default: the agent's).
	ZtunnelWait time.Duration
	// NoStandIn leaves the ztunnel stand-in out; startStandIn adds it.
	NoStandIn bool
	// Upgrade creates the agent's DaemonSet, so a daemon that stops treats
	// it as an upgrade and leaves the plugin installed, as on a rolling
	// update.
	Upgrade bool
	// Faults make the stand-in misbehave from the start.
	Faults ztunnel.Faults
	// LogLevel of the agent's and stand-in's logs (default info).
	LogLevel slog.Level
	// AgentHook changes each daemon's agent configuration (fault
	// injection; see crash_test.go). Not a setting: the agent's flags stay
	// the shipped ones.
	AgentHook func(*nodeagent.Config)
	// ServerHook changes each daemon's event server configuration (slow
	// or hung answers; see watchdog_test.go); WatchdogPeriod shortens the
	// watchdog's period. Not settings either.
	ServerHook     func(*nodeagent.ServerConfig)
	WatchdogPeriod time.Duration
	// AgentTransport wraps the transport of the agent's API client (an
	// API server that hangs or fails for the agent only; see
	// startuplive_test.go); StartupStepBound shortens the bound of each
	// start-up step. Not settings either.
	AgentTransport   func(http.RoundTripper) http.RoundTripper
	StartupStepBound time.Duration
	// MetricsAddr is the agent's --metrics-addr (default: a free loopback
	// port); TestMetricsPortTaken points it at a port already held.
	MetricsAddr string
	// StartupTaint registers the node with the startup taint (and another)
	// and runs the agent with the chart's startupTaint.enabled: its flag
	// and the nodes rule it adds to the RBAC; StartupTaintOnShutdown adds
	// startupTaint.restoreOnShutdown.
	StartupTaint, StartupTaintOnShutdown bool
	// EnablementSelector is the agent's --enablement-selector (default:
	// the chart's, Istio's list).
	EnablementSelector string
	// VerifyPeriod is the agent's --verify-period (default: the chart's).
	VerifyPeriod time.Duration
	// PluginCredential hands the daemon the API server's URL and CA, as
	// install-cni reads them from its kubeconfig, so it writes the plugin
	// its credential (a token of the chart's plugin ServiceAccount, bound
	// to the node); a failed attempt is retried after 100 ms.
	PluginCredential bool
	// NoWaitReady returns from newNode once the daemon runs, before it is
	// ready: no stand-in, no kubelet simulator.
	NoWaitReady bool
}

// startupTaintRBAC is the rule startupTaint.enabled adds to the chart's
// ClusterRole (test/deploy checks the chart and its admission policy).
const startupTaintRBAC = `---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: %s
rules:
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["get", "patch"]
`

// node is one simulated Kubernetes node: a bridge pod network whose
// primary conflist the daemon's installer chains our plugin into, the
// daemon itself (in-process, under the shipped RBAC), a ztunnel stand-in
// on its ZDS socket, and a kubelet simulator using the chained conflist.
type node struct {
	t       testing.TB
	env     *kubeenv.Env
	Name    string
	sim     *simnode.Node
	dir     string
	confDir string
	binDir  string
	bridge  string
	subnet  netip.Prefix
	hostNS  ns.NetNS // stands in for the host netns of the probe SNAT set
	// rules reads pods' rules and the host probe set in the backend the
	// agent chose (see openRules).
	rules *rulesbackend.Backend

	agentNS, agentPod string
	client            kubernetes.Interface // the agent's ServiceAccount, as a full clientset
	agentClient       *kubeclient.Client   // the agent's own client
	// apiRequests counts the agent client's requests other than watches
	// (a watch is one long request; its events are not requests).
	apiRequests atomic.Int64
	// traffic counts them by resource, and the bytes of each watch.
	traffic apiTraffic
	cfg     *installcni.Config
	logs    *logSink
	log     *slog.Logger

	d           *installcni.App
	hook        func(*nodeagent.Config)
	metrics     *metrics.Metrics
	metricsAddr string // the daemon's /metrics address, once bound
	maddr       chan string
	stopD       func()

	zt     *ztunnel.StandIn
	stopZT func()

	kube *kubesim.Node

	opts nodeOptions
	// exited is closed when the daemon's Run returned (runErr waits for
	// it); exitExpected keeps stopDaemon from failing the test on it.
	exited       chan struct{}
	runErr       func() error
	exitExpected bool
}

func randByte() byte {
	var b [1]byte
	_, _ = rand.Read(b[:])
	return b[0]
}

// newNode builds a node and starts its daemon (and stand-in unless
// NoStandIn), returning once the daemon reports ready.
func newNode(t testing.TB, opts nodeOptions) *node {
	t.Helper()
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "ip", "nsenter", "sleep")
	cnibin.Paths(t) // skips under AMBIENT_UNIT_ONLY before an apiserver starts; builds the plugins once
	env := kube.Env(t)
	n := &node{t: t, env: env, Name: testnet.RandName("node-", 8), hook: opts.AgentHook, opts: opts}
	var err error
	n.logs = &logSink{t: t}
	t.Cleanup(n.logs.stop) // registered first: runs after every other cleanup
	n.log = slog.New(slog.NewTextHandler(n.logs, &slog.HandlerOptions{Level: opts.LogLevel}))

	// A short private dir: socket paths must fit in sun_path.
	if n.dir, err = os.MkdirTemp("", "ae2e-"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(n.dir) })
	chart, err := simnode.CommittedChart()
	if err != nil {
		t.Fatal(err)
	}
	n.agentNS = testnet.RandName("agent-", 8)
	n.subnet = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 200 + randByte()%50, randByte(), 0}), 24)
	var extraRBAC []byte
	if opts.StartupTaint {
		extraRBAC = []byte(fmt.Sprintf(startupTaintRBAC, "startup-taint-"+n.agentNS))
		n.registerTainted()
	}
	n.sim, err = simnode.Prepare(context.Background(), simnode.Options{
		Env: env, Chart: chart, Plugin: cnibin.Plugin(t), ReferencePlugins: cnibin.Paths(t)[0],
		Dir: n.dir, Name: n.Name, Namespace: n.agentNS, Settings: nodeSettings(opts), ExtraRBAC: extraRBAC,
		Subnet:  n.subnet,
		StandIn: ztunnel.Config{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, Logger: n.log.With("component", "ztunnel-stand-in")},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.sim.Close(); err != nil {
			t.Errorf("simulated node: %v", err)
		}
	})
	n.confDir, n.binDir, n.bridge, n.cfg = n.sim.ConfDir, n.sim.BinDir, n.sim.Bridge, n.sim.Config
	n.hostNS = testnet.NewNS(t)
	n.agentPod = n.cfg.PodName
	saConfig := n.sim.AgentConfig

	n.openRules()
	// The agent's client is built as install-cni builds it, with the
	// shipped rate limit; kubeenv's raised QPS is for the test's own
	// clients (kubesim, assertions) only. requireShippedClient pins it.
	agentConfig := n.cfg.KubeClientConfig(saConfig)
	if opts.AgentTransport != nil {
		agentConfig.Wrap(opts.AgentTransport)
	}
	agentConfig.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if r.URL.Query().Get("watch") != "true" {
				n.apiRequests.Add(1)
			}
			return n.traffic.roundTrip(rt, r)
		})
	})
	if n.agentClient, err = kubeclient.NewForConfig(agentConfig); err != nil {
		t.Fatal(err)
	}
	requireShippedClient(t, n.agentClient)
	// The same identity and settings through the full clientset, for
	// the tests' checks of what that identity may do.
	if n.client, err = kubernetes.NewForConfig(n.cfg.KubeClientConfig(saConfig)); err != nil {
		t.Fatal(err)
	}
	if opts.Upgrade {
		n.createDaemonSet()
	}

	// One cleanup for whichever daemon and stand-in run at the end,
	// registered before the kubelet simulator's, so pods are torn down
	// (CNI DEL) while the agent still runs.
	t.Cleanup(func() {
		if n.stopZT != nil {
			n.stopZT()
		}
		if n.stopD != nil {
			n.stopD()
		}
	})
	n.startDaemon()
	if opts.NoWaitReady {
		return n
	}
	if !opts.NoStandIn {
		n.startStandIn(opts.Faults)
	}
	conf, err := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(conf, []byte(`"`+cnibin.PluginName+`"`)) {
		t.Fatalf("daemon is ready but the primary conflist does not name our plugin:\n%s", conf)
	}
	// The runtime finds our plugin where the installer put it, beside the
	// reference plugins.
	n.kube = kubesim.NewNode(t, env.Client, n.Name, []string{n.binDir}, conf)
	return n
}

// roundTripFunc is an http.RoundTripper from a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

// RoundTrip calls f.
func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// nodeSettings are the agent's settings on a test node beyond the chart's
// environment and simnode's NodeLocal ones (and the pod-namespace simnode
// sets for a node's own namespace); TestHarnessRunsShippedDefaults fails
// if one beyond harnessSettings creeps in.
func nodeSettings(opts nodeOptions) map[string]string {
	s := map[string]string{
		"metrics-addr": "127.0.0.1:0",
	}
	if opts.MetricsAddr != "" {
		s["metrics-addr"] = opts.MetricsAddr
	}
	if opts.ZtunnelWait > 0 {
		s["ztunnel-wait"] = opts.ZtunnelWait.String()
	}
	if opts.StartupTaint {
		s["startup-taint"] = "true"
	}
	if opts.StartupTaintOnShutdown {
		s["startup-taint-on-shutdown"] = "true"
	}
	if opts.EnablementSelector != "" {
		s["enablement-selector"] = opts.EnablementSelector
	}
	if opts.VerifyPeriod > 0 {
		s["verify-period"] = opts.VerifyPeriod.String()
	}
	return s
}

// registerTainted creates the node's Node object as kubelet would with
// --register-with-taints: the startup taint, and another that is not ours.
func (n *node) registerTainted() {
	n.t.Helper()
	_, err := n.env.Client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.Name},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{nodetaint.Taint, otherTaint}},
	}, metav1.CreateOptions{})
	if err != nil {
		n.t.Fatalf("register node: %v", err)
	}
	n.t.Cleanup(func() { _ = n.env.Client.CoreV1().Nodes().Delete(context.Background(), n.Name, metav1.DeleteOptions{}) })
}

// otherTaint is someone else's taint on a node registered tainted
// (PreferNoSchedule: the test DaemonSet, which tolerates nothing, still
// targets the node, so a stop with it is an upgrade).
var otherTaint = corev1.Taint{Key: "example.com/dedicated", Value: "mesh", Effect: corev1.TaintEffectPreferNoSchedule}

// taints are the node's taints: whether the startup taint and otherTaint
// are there.
func (n *node) taints() (startup, other bool) {
	n.t.Helper()
	node, err := n.env.Client.CoreV1().Nodes().Get(context.Background(), n.Name, metav1.GetOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	for _, t := range node.Spec.Taints {
		startup = startup || t.MatchTaint(&nodetaint.Taint)
		other = other || (t.MatchTaint(&otherTaint) && t.Value == otherTaint.Value)
	}
	return startup, other
}

// requireShippedClient fails the test unless the agent's client is rate
// limited exactly as install-cni's defaults (= the chart's) say: a test
// environment that raised it hid a 5 pods/s cap once.
func requireShippedClient(t testing.TB, c *kubeclient.Client) {
	t.Helper()
	shipped, err := installcni.Parse([]string{"--node-name=x"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	rl := c.RateLimiter()
	if rl == nil || rl.QPS() != shipped.KubeClientQPS {
		t.Fatalf("the agent's client is not limited to the shipped %v requests/s (limiter %v)", shipped.KubeClientQPS, rl)
	}
}

// createDaemonSet creates the agent's DaemonSet (as admin), which makes
// the agent's shutdown an upgrade, and the release's signal unless it
// exists.
func (n *node) createDaemonSet() {
	n.t.Helper()
	if err := kubeenv.CreateReleaseSignal(context.Background(), n.env.Client, n.agentNS, n.cfg.ReleaseSignal); err != nil {
		n.t.Fatal(err)
	}
	labels := map[string]string{"app": "ambient-cni"}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: n.cfg.DaemonSet, Namespace: n.agentNS},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{
					Name: "install-cni", Image: "docker.io/local/ambient-cni:1", ImagePullPolicy: corev1.PullNever,
				}}},
			},
		},
	}
	if _, err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Create(context.Background(), ds, metav1.CreateOptions{}); err != nil {
		n.t.Fatalf("create daemonset: %v", err)
	}
}

// deleteReleaseSignal deletes the release's signal, as helm's uninstall
// and its hook do before the DaemonSet.
func (n *node) deleteReleaseSignal() {
	n.t.Helper()
	if err := kubeenv.DeleteReleaseSignal(context.Background(), n.env.Client, n.agentNS, n.cfg.ReleaseSignal); err != nil {
		n.t.Fatal(err)
	}
}

// startDaemon runs a fresh daemon (new metrics, new state) with the
// node's config until the test ends or stopDaemon, and waits until it
// reports ready.
func (n *node) startDaemon() {
	t := n.t
	t.Helper()
	n.metrics = metrics.New()
	// Health as kubelet reads it: over the debug socket (install-cni
	// probe); /metrics once its address is bound, which a taken port
	// delays without delaying readiness.
	maddr := make(chan string, 1)
	n.metricsAddr, n.maddr = "", maddr
	var apiServer string
	var apiCA []byte
	if n.opts.PluginCredential {
		apiServer = n.sim.AgentConfig.Host
		var err error
		if apiCA, err = os.ReadFile(n.env.CAFile); err != nil {
			t.Fatal(err)
		}
	}
	d, err := installcni.New(installcni.Options{
		Config: n.cfg, Client: n.agentClient, Logger: n.log, Metrics: n.metrics,
		HostNetns: n.hostNS.Path(),
		MetricsReady: func(a net.Addr) {
			select {
			case maddr <- a.String():
			default:
			}
		},
		MetricsRetry:          200 * time.Millisecond,
		APIServer:             apiServer,
		APICA:                 apiCA,
		PluginCredentialRetry: 100 * time.Millisecond,
		AgentHook:             n.hook,
		ServerHook:            n.opts.ServerHook,
		WatchdogPeriod:        n.opts.WatchdogPeriod,
		StartupStepBound:      n.opts.StartupStepBound,
	})
	if err != nil {
		t.Fatalf("daemon: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}) // closed when Run returned runErr
	var runErr error
	go func() { runErr = d.Run(ctx); close(done) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			<-done
			if runErr != nil && !n.exitExpected {
				t.Errorf("daemon Run: %v", runErr)
			}
			// Every pod went only where the agent's state diagram goes.
			if a := d.Agent(); a != nil && a.InvalidTransitions() != 0 {
				t.Errorf("the agent refused %d invalid pod state transitions (see its log)", a.InvalidTransitions())
			}
		})
	}
	n.d, n.stopD = d, stop
	n.exited, n.runErr = done, func() error { <-done; return runErr }
	n.requireAgentBackend()
	if n.opts.NoWaitReady {
		return
	}

	deadline := time.After(waitLong)
	for {
		failed := d.Ready()
		if len(failed) == 0 {
			return
		}
		select {
		case <-done:
			t.Fatalf("daemon exited during start: %v", runErr)
		case <-deadline:
			t.Fatalf("daemon not ready after %v: %v", waitLong, failed)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stopDaemon stops the daemon as SIGTERM would.
func (n *node) stopDaemon() {
	n.t.Helper()
	n.stopD()
}

// startStandIn connects a ztunnel stand-in to the daemon's ZDS socket and
// waits for its first snapshot.
func (n *node) startStandIn(f ztunnel.Faults) {
	t := n.t
	t.Helper()
	z := n.sim.StartStandIn(f)
	stop := func() {
		if err := n.sim.StopStandIn(); err != nil {
			t.Errorf("stand-in: %v", err)
		}
	}
	n.zt, n.stopZT = z, stop
	n.waitStandIn(func() bool { return z.Ready() }, "stand-in snapshot")
}

// waitStandIn waits (bounded) for cond over the stand-in's state.
func (n *node) waitStandIn(cond func() bool, what string) {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	if err := n.zt.Wait(ctx, cond); err != nil {
		n.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// namespace creates a namespace with a random name starting with prefix.
func (n *node) namespace(prefix string, labels map[string]string) string {
	n.t.Helper()
	return n.env.CreateNamespace(n.t, testnet.RandName(prefix+"-", 6), labels).Name
}

// ambientLabel is the label set that enables a namespace or pod.
var ambientLabel = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}

// labelPatch is a merge patch setting (or, for "", removing) the
// dataplane-mode label.
func labelPatch(value string) []byte {
	var v any
	if value != "" {
		v = value
	}
	b, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{ambient.DataplaneModeLabel: v}}})
	return b
}

// setNamespaceMode sets the namespace's dataplane-mode label ("" removes it).
func (n *node) setNamespaceMode(name, value string) {
	n.t.Helper()
	if _, err := n.env.Client.CoreV1().Namespaces().Patch(context.Background(), name, types.MergePatchType, labelPatch(value), metav1.PatchOptions{}); err != nil {
		n.t.Fatalf("label namespace %s: %v", name, err)
	}
}

// setPodMode sets the pod's dataplane-mode label ("" removes it).
func (n *node) setPodMode(p *kubesim.Pod, value string) {
	n.t.Helper()
	if _, err := n.env.Client.CoreV1().Pods(p.Obj.Namespace).Patch(context.Background(), p.Obj.Name, types.MergePatchType, labelPatch(value), metav1.PatchOptions{}); err != nil {
		n.t.Fatalf("label pod %s: %v", p.Obj.Name, err)
	}
}

// podSpec is a pod object for kubesim.
func podSpec(namespace, name string, labels, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Namespace: namespace, Name: name, Labels: labels, Annotations: annotations,
	}}
}

// runPod creates and starts a pod (netns, CNI ADD, process, status
// Running) and serves an HTTP app on appPort inside it.
func (n *node) runPod(pod *corev1.Pod) *kubesim.Pod {
	n.t.Helper()
	p, err := n.kube.Run(context.Background(), pod)
	if err != nil {
		n.t.Fatalf("run pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	serveApp(n.t, p)
	return p
}

// serveApp runs an HTTP app on appPort inside the pod that says who it is.
func serveApp(t testing.TB, p *kubesim.Pod) {
	t.Helper()
	var ln net.Listener
	if err := p.NS.Do(func(ns.NetNS) error {
		var err error
		ln, err = net.Listen("tcp", fmt.Sprintf(":%d", appPort))
		return err
	}); err != nil {
		t.Fatalf("app listener in %s: %v", p.Obj.Name, err)
	}
	name := p.Obj.Name
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = fmt.Fprintf(w, "hello from %s", name)
		}),
		ReadHeaderTimeout: 5 * time.Second,
	}
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(ln) })
	t.Cleanup(func() { _ = srv.Close(); wg.Wait() })
}

// netip4Port is the pod's IPv4 address with port.
func netip4Port(p *kubesim.Pod, port int) netip.AddrPort {
	return netip.AddrPortFrom(p.Addr(4), uint16(port))
}

// app is the pod's HTTP app address.
func app(p *kubesim.Pod) netip.AddrPort { return netip.AddrPortFrom(p.Addr(4), appPort) }

// get makes one HTTP request from inside pod from to to's app.
func get(from, to *kubesim.Pod) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return testnet.HTTPGet(ctx, from.NS, "http://"+app(to).String()+"/")
}

// mustGet requires a successful request from one pod to another's app.
func mustGet(t testing.TB, from, to *kubesim.Pod) {
	t.Helper()
	body, err := get(from, to)
	if err != nil {
		t.Fatalf("%s -> %s: %v", from.Obj.Name, to.Obj.Name, err)
	}
	if want := "hello from " + to.Obj.Name; body != want {
		t.Fatalf("%s -> %s: body %q, want %q", from.Obj.Name, to.Obj.Name, body, want)
	}
}

// dial opens a TCP connection from inside pod from.
func dial(t testing.TB, from *kubesim.Pod, to netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	if err := from.NS.Do(func(ns.NetNS) error {
		var err error
		c, err = net.DialTimeout("tcp", to.String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatalf("%s dial %s: %v", from.Obj.Name, to, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// listening reports whether something accepts TCP on port inside the pod.
func listening(p *kubesim.Pod, port int) bool {
	ok := false
	_ = p.NS.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second)
		if err == nil {
			ok = true
			_ = c.Close()
		}
		return nil
	})
	return ok
}

// hasRecord reports whether the stand-in proxied a connection matching m.
func (n *node) hasRecord(m func(ztunnel.Record) bool) bool {
	return slices.ContainsFunc(n.zt.Records(), m)
}

// requireTunneled requires that the stand-in carried a connection from
// client to server's app over client's 15001 and server's 15008.
func (n *node) requireTunneled(client, server *kubesim.Pod) {
	n.t.Helper()
	if !n.hasRecord(func(r ztunnel.Record) bool {
		return r.UID == string(client.Obj.UID) && r.Port == ambient.ZtunnelOutboundPort && r.OrigDst == app(server) && r.Tunneled && r.Err == ""
	}) {
		n.t.Fatalf("no 15001 record on %s for %s: %+v", client.Obj.Name, app(server), n.zt.Records())
	}
	if !n.hasRecord(func(r ztunnel.Record) bool {
		return r.UID == string(server.Obj.UID) && r.Port == ambient.ZtunnelInboundHBONEPort && r.OrigDst == app(server) && r.Err == ""
	}) {
		n.t.Fatalf("no 15008 record on %s for %s: %+v", server.Obj.Name, app(server), n.zt.Records())
	}
}

// annotation reads the pod's redirection annotation from the API.
func (n *node) annotation(p *kubesim.Pod) string {
	n.t.Helper()
	obj, err := n.env.Client.CoreV1().Pods(p.Obj.Namespace).Get(context.Background(), p.Obj.Name, metav1.GetOptions{})
	if err != nil {
		n.t.Fatalf("get pod %s: %v", p.Obj.Name, err)
	}
	return obj.Annotations[ambient.RedirectionAnnotation]
}

// enrolled reports whether the pod is fully enrolled as far as the API
// and ztunnel see it.
func (n *node) enrolled(p *kubesim.Pod) bool {
	_, served := n.zt.Workload(string(p.Obj.UID))
	return served && n.annotation(p) == ambient.RedirectionEnabled
}

// waitEnrolled waits (at most within) until every pod is annotated
// enabled and served by the stand-in, then checks its rules and listeners.
func (n *node) waitEnrolled(within time.Duration, pods ...*kubesim.Pod) {
	n.t.Helper()
	deadline := time.Now().Add(within)
	for _, p := range pods {
		if poll.Wait(context.Background(), time.Until(deadline), func() bool { return n.enrolled(p) }) != nil {
			_, served := n.zt.Workload(string(p.Obj.UID))
			n.t.Fatalf("pod %s not enrolled within %v: annotation %q, served by stand-in %v",
				p.Obj.Name, within, n.annotation(p), served)
		}
	}
	for _, p := range pods {
		if !n.hasRules(p) {
			n.t.Fatalf("pod %s is enabled but has no redirection rules:\n%s", p.Obj.Name, n.rulesDump(p))
		}
		for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
			if !listening(p, port) {
				n.t.Fatalf("pod %s is enabled but nothing listens on %d", p.Obj.Name, port)
			}
		}
		if !n.inProbeSet(p) {
			n.t.Fatalf("pod %s is enabled but its IP is not in the host probe set", p.Obj.Name)
		}
	}
}

// requireNotEnrolled checks that a pod carries no trace of capture.
func (n *node) requireNotEnrolled(p *kubesim.Pod) {
	n.t.Helper()
	if a := n.annotation(p); a != "" {
		n.t.Errorf("pod %s has annotation %s=%q", p.Obj.Name, ambient.RedirectionAnnotation, a)
	}
	if ipt, nft := n.ourRules(p.NS.Path()); ipt || nft {
		n.t.Errorf("pod %s has redirection rules (iptables %v, nftables %v):\n%s", p.Obj.Name, ipt, nft, n.rulesDump(p))
	}
	if _, ok := n.zt.Workload(string(p.Obj.UID)); ok {
		n.t.Errorf("pod %s is served by the stand-in", p.Obj.Name)
	}
	for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
		if listening(p, port) {
			n.t.Errorf("pod %s: something listens on %d", p.Obj.Name, port)
		}
	}
	if _, ok := n.d.Agent().EnrolledUID(p.Obj.Namespace, p.Obj.Name); ok {
		n.t.Errorf("pod %s is in the agent's state", p.Obj.Name)
	}
	if n.inProbeSet(p) {
		n.t.Errorf("pod %s: its IP is in the host probe set", p.Obj.Name)
	}
}

// waitUnenrolled waits until the stand-in no longer serves any of the
// pods and the agent has finished removing them (it tells ztunnel, then
// drops its entry, then takes the IPs out of the host probe set), and then
// requires no trace of capture.
func (n *node) waitUnenrolled(pods ...*kubesim.Pod) {
	n.t.Helper()
	n.waitStandIn(func() bool {
		for _, p := range pods {
			if _, ok := n.zt.Workload(string(p.Obj.UID)); ok {
				return false
			}
		}
		return true
	}, "stand-in to drop the pods")
	deadline := time.Now().Add(waitLong)
	for _, p := range pods {
		var inState, probed bool
		if poll.Wait(context.Background(), time.Until(deadline), func() bool {
			_, inState = n.d.Agent().EnrolledUID(p.Obj.Namespace, p.Obj.Name)
			probed = n.inProbeSet(p)
			return !inState && !probed && n.annotation(p) == ""
		}) != nil {
			n.t.Fatalf("pod %s still enrolled: in state %v, in the host probe set %v, annotation %q",
				p.Obj.Name, inState, probed, n.annotation(p))
		}
		n.requireNotEnrolled(p)
	}
}

// logSink sends the agent's log lines to the test log and keeps the
// warnings and errors for assertions.
type logSink struct {
	t       testing.TB
	mu      sync.Mutex
	stopped bool
	warns   []string
	lines   []string
}

func (s *logSink) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	s.mu.Lock()
	defer s.mu.Unlock()
	if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") {
		s.warns = append(s.warns, line)
	}
	s.lines = append(s.lines, line)
	if !s.stopped {
		s.t.Log(line)
	}
	return len(p), nil
}

// mark is the position to pass to warningsSince.
func (s *logSink) mark() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.warns)
}

// warningsSince returns the warnings and errors logged since mark.
func (s *logSink) warningsSince(mark int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.warns[mark:])
}

// all returns every line logged so far.
func (s *logSink) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.lines)
}

func (s *logSink) stop() {
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
}
