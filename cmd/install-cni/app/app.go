// Package app assembles the install-cni process (the DaemonSet container)
// for cmd/install-cni, which calls Main, and for the end-to-end tests,
// which run New and Run in-process. options.go holds every setting: flag,
// environment variable, default (the owning package's constant),
// validation, and the table rendered into docs/install-cni.md. app.go
// wires the installer, the pod cache, the node agent with its plugin event
// server and ZDS server, the pod controller, the host probe set and the
// health/metrics server (New), and runs them until a signal (Run).
package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/explain"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/pkg/kubeadapter"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/metrics"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/nodedirs"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// Main is install-cni: it parses args and the environment, connects to
// the API server, and runs until SIGTERM or SIGINT.
func Main(args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := Parse(args, getenv, stderr)
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return err
	}
	log := slog.New(NewLogHandler(cfg.LogFormat, stderr, &slog.HandlerOptions{Level: level}))
	// The first line says which build runs and how it is set up.
	log.Info("install-cni starting", "version", buildinfo.Version(), "commit", buildinfo.Commit(), "node", cfg.NodeName, cfg.SettingsAttr(args, getenv))
	klog.SetSlogLogger(log.With("component", "client-go"))
	setMemoryLimit(getenv, log)

	var rc *rest.Config
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	client, err := kubeclient.NewForConfig(cfg.KubeClientConfig(rc))
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	ca := rc.CAData
	if len(ca) == 0 && rc.CAFile != "" {
		if ca, err = os.ReadFile(rc.CAFile); err != nil {
			return fmt.Errorf("API server CA: %w", err)
		}
	}
	a, err := New(Options{Config: cfg, Client: client, Logger: log, APIServer: rc.Host, APICA: ca})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-a.Hung():
	}
	// Run is shutting down after the watchdog; what hung may hang that
	// too, and the process must end for kubelet to restart it.
	t := time.NewTimer(hungExitGrace)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return fmt.Errorf("the watchdog gave up on the plugin event server and the shutdown did not end within %s: exiting as a crash would", hungExitGrace)
	}
}

// Options are what New needs besides the parsed configuration.
type Options struct {
	Config *Config
	// Client talks to the API server with the agent's own identity.
	Client kubeclient.Interface
	Logger *slog.Logger
	// Metrics defaults to a fresh set.
	Metrics *metrics.Metrics
	// HostNetns is where the host probe set lives: "" is this process's
	// own (host) network namespace; tests point it at a stand-in.
	HostNetns string
	// HealthReady and MetricsReady, when set, receive the health and
	// metrics servers' bound addresses (health only when health-addr is
	// set; metrics once bound, which may be after Run started).
	HealthReady, MetricsReady func(net.Addr)
	// MetricsRetry is the wait between attempts to bind a metrics address
	// that is taken; zero is 30 seconds.
	MetricsRetry time.Duration
	// APIServer and APICA are the API server's URL and CA bundle (PEM) as
	// the agent reaches it: the plugin's credential carries them. Empty
	// APIServer writes no credential.
	APIServer string
	APICA     []byte
	// PluginCredentialRetry is the wait between attempts to obtain the
	// plugin's credential after a failure; zero is 10 seconds.
	PluginCredentialRetry time.Duration
	// AgentHook, when set, may change the node agent's configuration
	// before the agent is built: tests wrap its side effects (rules,
	// ztunnel, annotations) to stop it at a chosen step.
	AgentHook func(*nodeagent.Config)
	// ServerHook, when set, may change the plugin event server's
	// configuration before it is built: tests slow or hang its answers.
	ServerHook func(*nodeagent.ServerConfig)
	// WatchdogPeriod is the time between the watchdog's checks of the
	// event server; zero is watchdogPeriod.
	WatchdogPeriod time.Duration
	// StartupStepBound is how long one start-up step may run while what
	// it waits on answers before liveness fails; zero is startupStepBound.
	// Tests shorten it; it is not a setting.
	StartupStepBound time.Duration
}

// shutdownTimeout bounds the upgrade check and the uninstall at shutdown.
const shutdownTimeout = 10 * time.Second

// annotationFlushTimeout bounds the wait for queued annotation writes at
// shutdown.
const annotationFlushTimeout = 2 * time.Second

// releaseTimeout bounds releasing the captured pods on an uninstall.
const releaseTimeout = 12 * time.Second

// ztunnelDelTimeout bounds the wait for ztunnel's acks of the released
// pods' Dels on an uninstall.
const ztunnelDelTimeout = 3 * time.Second

// The watchdog: every watchdogPeriod the agent asks its own event server
// for STATUS through the plugin's socket (each bounded by
// health.LiveTimeout); after watchdogFailures failures in a row Run ends
// with an error and install-cni exits non-zero, so kubelet restarts it.
// A hung event server costs pods about half a minute, never more.
const (
	watchdogPeriod   = 10 * time.Second
	watchdogFailures = 3
)

// hungExitGrace bounds the shutdown after the watchdog tripped: a part of
// the agent that hangs may hang the shutdown too; past this Main returns
// anyway (the next agent finds the node as a crash leaves it).
const hungExitGrace = 20 * time.Second

// snapshotRefresh is how often the enablement snapshot is brought up to
// date with this node's pods.
const snapshotRefresh = 15 * time.Second

// hostProbeResync is how often the host probe SNAT is put back (another
// tool removed it, or got a rule above it in POSTROUTING).
const hostProbeResync = 30 * time.Second

// App is one install-cni process.
type App struct {
	cfg     *Config
	log     *slog.Logger
	opts    Options
	metrics *metrics.Metrics

	installer *installer.Installer
	upgrade   *kubeadapter.DaemonSetUpgradeChecker
	rules     *rulesbackend.Backend
	events    *kubeadapter.Events
	pods      *podcache.Cache
	agent     *nodeagent.Agent
	server    *nodeagent.Server
	zds       *zds.Server
	ctrl      *controller.Controller
	health    *health.Server
	startup   *health.Startup
	explain   *explain.Explainer
	cred      *plugincred.Rotator // nil when no plugin credential is configured
	verifier  *verifier.Verifier  // nil when verify-period is 0

	// hung is closed when the watchdog gave up on the event server.
	hung     chan struct{}
	hungOnce sync.Once
	// unchained is set once an uninstall took the plugin out of every
	// config (leave, or shutdown's second try).
	unchained bool
	// leaving is set once leave decided on an uninstall: the DaemonSet
	// watch no longer clears the uninstall marker.
	leaving atomic.Bool
}

// New builds every part; nothing runs or touches the node until Run.
func New(o Options) (*App, error) {
	c := o.Config
	if c == nil || o.Client == nil {
		return nil, errors.New("install-cni: Config and Client are required")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New()
	}
	a := &App{cfg: c, log: o.Logger, opts: o, metrics: o.Metrics, hung: make(chan struct{})}
	m := a.metrics

	// Rules in pods and the host probe SNAT: nothing is dialled or
	// installed until used; Run closes what the backend holds.
	rules, err := rulesbackend.New(rulesbackend.Config{Backend: c.RulesBackend, HostNetns: o.HostNetns, Logger: a.log,
		Probe: ruleset.HostProbeConfig{ProbeSNATv4: c.ProbeSNATv4, ProbeSNATv6: c.ProbeSNATv6, IPv4Only: !c.IPv6,
			NoBranchENI: !c.AWSBranchENIProbe}})
	if err != nil {
		return nil, fmt.Errorf("rules backend: %w", err)
	}
	a.rules = rules
	a.log.Info("rules backend", "backend", rules.Name)

	// The plugin on the node: binary and conflist entry.
	entry, err := json.Marshal(ambient.PluginConf{
		AgentSocket: c.AgentSocket, StateDir: c.StateDir, ControlPlaneNamespaces: c.ControlPlane(), Timeout: c.PluginTimeout.String(),
		LogLevel: c.PluginLogLevel, ExcludedNamespaces: nonNil(c.ExcludedNamespaces),
		StatusRequiresAgent: c.StatusChecksAgent, AgentUnreachable: c.AgentUnreachable,
		AgentDownAfter: c.AgentDownAfter.String(),
	})
	if err != nil {
		return nil, err
	}
	a.events = kubeadapter.NewEvents(o.Client, c.NodeName)
	layout := c.Layout()
	var istioGone func(string) error
	if c.IstioCNIRunDir != "" {
		istioGone = installer.IstioCNIAgentGone(c.IstioCNIRunDir)
	}
	a.installer, err = installer.New(installer.Config{
		BinDir: c.CNIBinDir, ExtraBinDirs: c.CNIExtraBinDirs, ConfDir: c.CNIConfDir, PluginBinary: c.PluginBinary, PluginName: c.PluginType,
		PrimaryConfName: c.CNIConfName, PluginConfig: entry,
		Owned: c.CNIOwnedConfig, OwnedConfName: c.CNIOwnedConfName,
		IstioCNIGone: istioGone,
		StateFile:    layout.InstallerState(),
		OnReinstall:  m.InstallerReinstalls.Inc,
		OnOutcome:    func(o installer.Outcome) { m.ObserveInstall(istioInstallResult(o)) },
		// Said on the agent's own pod, where kubectl describe shows why
		// it is not ready.
		OnRefused: func(err error) {
			reason := "IstioCNIChained"
			if errors.Is(err, installer.ErrPrimaryContested) {
				reason = "PrimaryCNIRemovesEntry"
			}
			a.events.Eventf(&corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: c.PodNamespace, Name: c.PodName},
				corev1.EventTypeWarning, reason, "%v", err)
		},
		Logger: a.log,
	})
	if err != nil {
		return nil, fmt.Errorf("installer: %w", err)
	}
	a.upgrade = kubeadapter.NewDaemonSetUpgradeChecker(o.Client, c.PodNamespace, c.DaemonSet, c.NodeName, a.log)
	a.upgrade.OnChange(a.daemonSetChanged)

	// What the agent decides with: the pod cache.
	policy := c.EnablementPolicy()
	a.pods = podcache.New(podcache.Config{
		Client: o.Client, NodeName: c.NodeName,
		Policy:  policy,
		OnEvent: m.ObserveEvent,
		Logger:  a.log,
	})

	// The agent and what it drives: rules, host probe set, ztunnel,
	// annotations.
	a.zds = zds.NewServer(zds.Config{
		SocketPath: c.ZDSSocket, Logger: a.log.With("component", "zds"),
		// Every ztunnel that connects (a restarted one, or ours after an
		// agent restart) must get the enrolled pods, or it drops them all.
		// The agent exists before Run lets the server listen.
		Snapshot: func() []zds.Workload { return a.agent.Workloads() },
		// A pod left pending (its ADD timed out waiting for ztunnel, or a
		// previous agent crashed first) is enabled once a snapshot acks it.
		SnapshotAcked: func(uid string, netns *os.File) { a.agent.SnapshotAcked(uid, netns) },
	})
	a.events = kubeadapter.NewEvents(o.Client, c.NodeName)
	// Which netns paths the runtime may name (the agent's DELs and the
	// plugin's events alike), and how running pods' namespaces are found
	// (the controller's enrollment and the explainer alike).
	netnsPolicy := netns.Policy{Roots: c.NetnsDirs, ProcRoot: c.ProcRoot}
	finder := netns.Scanner{ProcRoot: c.ProcRoot, Logger: a.log}
	agentCfg := nodeagent.Config{
		Events:             a.events,
		Rules:              rules.Rules,
		HostProbe:          rules.Probe,
		Ztunnel:            a.zds,
		ZtunnelTimeout:     c.ZtunnelWait,
		Annotator:          kubeadapter.Annotator{Client: o.Client},
		AnnotationQPS:      float64(c.AnnotationQPS),
		AnnotationBurst:    c.AnnotationBurst,
		Pods:               a.pods,
		Layout:             layout,
		Netns:              netnsPolicy,
		Enablement:         a.pods,
		ExcludedNamespaces: nonNil(c.ExcludedNamespaces),
		DNSCapture:         c.DNSCapture,
		ProbeSNATv4:        c.ProbeSNATv4,
		ProbeSNATv6:        c.ProbeSNATv6,
		IPv4Only:           !c.IPv6,
		OnRuleError:        func(op string) { m.RuleErrors.WithLabelValues(op).Inc() },
		OnDriftRepaired:    m.RuleDrift.Inc,
		Logger:             a.log,
	}
	if o.AgentHook != nil {
		o.AgentHook(&agentCfg)
	}
	a.agent, err = nodeagent.NewAgent(agentCfg)
	if err != nil {
		return nil, err
	}

	// The two ways in: the plugin's events (decide, capture) and the pod
	// controller (decide, find, capture).
	serverCfg := nodeagent.ServerConfig{
		Layout: layout, Netns: netnsPolicy,
		HandlerTimeout: ambient.HandlerTimeout(c.PluginTimeout),
		Observe: func(verb, result string, took time.Duration) {
			m.ObserveRequest(verb, result, nodeagent.ResultStatus(result), took)
		},
		// The agent's (a hook may have changed it): an ADD's timings
		// span both.
		Logger: agentCfg.Logger,
	}
	if c.AgentUnreachable != ambient.AgentUnreachableFailClosed {
		// Under fail-closed the control plane waits too, agent or not.
		serverCfg.ControlPlaneNamespaces = c.ControlPlane()
	}
	if o.ServerHook != nil {
		o.ServerHook(&serverCfg)
	}
	a.server = nodeagent.NewServer(serverCfg, a.pods, a.agent)
	a.ctrl = controller.New(controller.Config{
		Pods:   a.pods,
		Agent:  a.agent,
		Finder: finder,
		Events: a.events,
		Logger: a.log,
		OnScan: func(int, int, time.Duration) { m.NetnsScans.Inc() },
	})
	// The plugin's fallback snapshot follows the cluster once the pods of a
	// previous agent are restored (an early one would be empty).
	a.pods.OnEnablementChange(func() {
		if closed(a.ctrl.Restored()) {
			_ = a.agent.RefreshSnapshot()
		}
	})

	// What the agent remembers per pod goes with the pod's object.
	a.pods.OnPodDeleted(a.agent.PodGone)

	// Every captured pod proven again on a period; drift repaired through
	// the agent's capture, uncaptured pods handed to the controller.
	if c.VerifyPeriod > 0 {
		for _, k := range verifier.Kinds() {
			m.VerifyDrift.WithLabelValues(string(k))
		}
		a.verifier = verifier.New(verifier.Config{
			Agent: a.agent, Pods: a.pods, Probe: rules.Probe, Finder: finder,
			Ztunnels:   a.zds.ReadyConnections,
			Requeue:    a.ctrl.Requeue,
			Events:     a.events,
			Period:     c.VerifyPeriod,
			OnDrift:    func(k verifier.Kind) { m.VerifyDrift.WithLabelValues(string(k)).Inc() },
			OnUnproven: func(n int) { m.PodsUnproven.Set(float64(n)) },
			Logger:     a.log,
		})
	}

	a.health = health.New()
	a.explain = &explain.Explainer{
		Pods: a.pods, Agent: a.agent,
		Finder:    finder,
		Backend:   rules.Name,
		Ztunnels:  a.zds.Connections,
		DaemonSet: a.upgrade.Seen,
		Policy:    policy,
	}
	if a.verifier != nil {
		a.explain.Verified = a.verification
	}
	// Alive is making progress: until the event server listens, no
	// start-up step may overrun its bound while what it waits on answers
	// (startupStepBound); then the event server must answer the plugin's
	// cheapest request through its socket.
	bound := o.StartupStepBound
	if bound <= 0 {
		bound = startupStepBound
	}
	a.startup = health.NewStartup(bound, nil, a.log.With("component", "startup"))
	a.health.AddLiveCheck("startup", a.startup.Check)
	a.health.AddLiveCheck("event-server", func(ctx context.Context) error {
		if !a.server.Listening() {
			return nil
		}
		return a.server.Answering(ctx)
	})
	a.health.AddCheck("installer", a.installer.Check)
	// No readiness check for the plugin's credential: the plugin is
	// chained without one (unchained, pods that must be captured would
	// start uncaptured while the agent is up), and an unready agent would
	// hold a rollout and the node's startup taint for a credential only
	// needed while the agent is away. Its metrics and alerts tell.
	a.cred = a.pluginRotator()
	a.health.AddCheck("restore", func() error {
		if !closed(a.ctrl.Restored()) {
			return errors.New("startup reconcile not done")
		}
		return nil
	})
	a.health.AddCheck("sockets", func() error {
		if !a.server.Listening() || !a.zds.Listening() {
			return errors.New("event and ZDS servers not listening yet")
		}
		return nil
	})
	// Pods can be captured only once a ztunnel has the node's pods; the
	// agent's own pod is ready before (ztunnel may come later).
	a.health.AddCaptureCheck("ztunnel", func() error {
		if a.zds.ReadyConnections() == 0 {
			return errors.New("no ztunnel has acknowledged its snapshot yet")
		}
		return nil
	})
	return a, nil
}

// verification is the verifier's last proof of uid, as explain shows it.
func (a *App) verification(uid types.UID) (explain.Verification, bool) {
	p, ok := a.verifier.Last(uid)
	if !ok {
		return explain.Verification{}, false
	}
	v := explain.Verification{At: p.At, Proven: p.OK, Repaired: p.Repaired, Problem: p.Problem}
	for _, f := range p.Found {
		v.Found = append(v.Found, f.String())
	}
	if !p.LastDriftAt.IsZero() {
		at := p.LastDriftAt
		v.LastDriftAt = &at
		for _, f := range p.LastDrift {
			v.LastDrift = append(v.LastDrift, f.String())
		}
	}
	return v, true
}

// Verifier is the verifier (for tests); nil when verify-period is 0.
func (a *App) Verifier() *verifier.Verifier { return a.verifier }

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Agent is the node agent core (for tests and debugging).
func (a *App) Agent() *nodeagent.Agent { return a.agent }

// DaemonSetSeen is what the watch on the agent's DaemonSet last saw: ""
// (nothing yet), "present", "being deleted" or "deleted".
func (a *App) DaemonSetSeen() string { return a.upgrade.Seen() }

// DebugSocket is where the debug endpoints are served: in the agent
// socket's (root-only) directory.
func (a *App) DebugSocket() string {
	return a.cfg.Layout().DebugSocket()
}

// RulesBackend names the rules backend in use ("nftables", "iptables-nft"
// or "iptables-legacy").
func (a *App) RulesBackend() string { return a.rules.Name }

// Ready lists what is not ready yet; empty means ready.
func (a *App) Ready() []string { return a.health.Ready() }

// CaptureReady lists what keeps the agent from capturing the node's pods
// yet (Ready's checks and a ztunnel that acked its snapshot); empty means
// the startup taint may go.
func (a *App) CaptureReady() []string { return a.health.CaptureReady() }

// Run runs everything until ctx ends, then shuts down: servers stop, the
// held netns handles are released (rules stay in the pods), and unless
// this is an upgrade the plugin and the host probe set are removed. Last,
// once every goroutine using them has stopped, the rules backend's
// connections are closed.
func (a *App) Run(ctx context.Context) (err error) {
	c := a.cfg
	defer func() {
		if cerr := a.rules.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close rules backend: %w", cerr))
		}
	}()
	// Private directories for the sockets and the node files, noted as
	// found so an uninstall leaves them as they were.
	layout := c.Layout()
	if err := nodedirs.Ensure(layout.NodeDirsLedger(), layout.Dir(), filepath.Dir(c.ZDSSocket)); err != nil {
		return err
	}
	if err := a.agent.EnsureHostProbe(); err != nil {
		return err
	}
	// What the plugin decides by while the agent cannot answer, in place
	// before the installer chains it when the API server grants a token.
	a.writePluginFiles(ctx)
	// What a previous agent recorded it captured; restored with the
	// annotated pods once the pod cache is synced.
	if err := a.agent.LoadRecords(); err != nil {
		a.log.Warn("capture records", "err", err)
	}
	a.events.Start()
	defer a.events.Shutdown()

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The ZDS server outlives the other components: an uninstall releases
	// the pods after everything else stopped, and ztunnel must get their
	// Dels before the server closes. shutdown stops it.
	zdsCtx, stopZDS := context.WithCancel(context.WithoutCancel(ctx))
	defer stopZDS()
	var wg, zdsWG sync.WaitGroup
	stopZtunnel := func() {
		stopZDS()
		_ = a.zds.Close() // one that never served releases its listener
		zdsWG.Wait()
	}
	errs := make(chan error, 10)
	start := func(wg *sync.WaitGroup, ctx context.Context, name string, f func(context.Context) error) {
		wg.Go(func() {
			if err := f(ctx); err != nil && ctx.Err() == nil {
				select {
				case errs <- fmt.Errorf("%s: %w", name, err):
				default: // one failure already stops everything
					a.log.Error("component failed", "component", name, "err", err)
				}
			}
		})
	}
	run := func(name string, f func(context.Context) error) { start(&wg, runCtx, name, f) }
	// Health for kubelet on the root-only debug socket (exec probes), and
	// on a TCP address only if one is set; metrics for Prometheus on their
	// own TCP address; the debug endpoints (pod names, IPs, netns paths)
	// only on the debug socket, in the agent's private directory.
	if c.HealthAddr != "" {
		ln, err := health.ListenTCP(c.HealthAddr)
		if err != nil {
			cancel()
			wg.Wait()
			return fmt.Errorf("health: %w", err)
		}
		if a.opts.HealthReady != nil {
			a.opts.HealthReady(ln.Addr())
		}
		run("health", func(ctx context.Context) error { return health.ServeListener(ctx, ln, a.health.Handler()) })
	}
	if c.MetricsAddr != "" {
		// A taken port costs the metrics only, never the node's pods.
		run("metrics-server", func(ctx context.Context) error {
			a.serveMetrics(ctx)
			return nil
		})
	}
	debugLn, err := health.ListenUnix(a.DebugSocket())
	if err != nil {
		cancel()
		wg.Wait()
		return fmt.Errorf("debug socket: %w", err)
	}
	run("debug", func(ctx context.Context) error {
		return health.ServeListener(ctx, debugLn, health.Debug{
			Pods:       func() any { return a.agent.Pods() },
			Explain:    func(ctx context.Context, ns, name string) (any, error) { return a.explain.Explain(ctx, ns, name) },
			ExplainAll: func(ctx context.Context) any { return a.explain.ExplainAll(ctx) },
			Health:     a.health,
			Logger:     a.log.With("component", "debug"),
		}.Handler())
	})
	// An uninstall cut short left its marker, which makes the plugin let
	// every pod through while no agent answers; this agent chains the
	// plugin again, so the mesh is back on the node: the marker goes
	// first.
	if had, err := nodefiles.ClearUninstalling(layout); err != nil {
		cancel()
		wg.Wait()
		return err
	} else if had {
		a.log.Info("removed the marker of an uninstall cut short; the plugin is chained again", "marker", layout.Uninstalling())
	}
	run("installer", a.installer.Run)
	if a.cred != nil {
		run("plugin-credential", a.cred.Run)
	}
	run("snapshot-refresh", func(ctx context.Context) error {
		// The snapshot lists this node's pods by UID; pods come and go
		// without an enablement change, so it is refreshed on a timer too
		// (it is rewritten only when it changed).
		t := time.NewTicker(snapshotRefresh)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
				if closed(a.ctrl.Restored()) {
					_ = a.agent.RefreshSnapshot()
				}
			}
		}
	})
	run("daemonset-watch", a.upgrade.Run)
	a.startup.Begin("pod cache sync", a.apiServer())
	run("pod-cache", a.pods.Run)
	run("annotations", a.agent.Run)
	run("controller", a.ctrl.Run)
	run("metrics", func(ctx context.Context) error {
		return a.metrics.RunGauges(ctx, a.agent.StateCounts, a.zds.Connections, a.installer.Ready, a.agent.TableSizes)
	})
	run("host-probe", func(ctx context.Context) error {
		rulesbackend.KeepHostProbe(ctx, a.rules.Probe, hostProbeResync, a.log)
		return nil
	})

	// ztunnel must not get a snapshot before the pods enrolled by a
	// previous agent are back in the state, or it would drop them all:
	// listen only once the controller restored them.
	for _, step := range []struct {
		done <-chan struct{}
		next string // the step that begins once done is closed
	}{
		{a.ctrl.Synced(), "restore of the pods captured before"},
		{a.ctrl.Restored(), "enablement snapshot"},
	} {
		select {
		case <-step.done:
			a.startup.Begin(step.next, nil)
		case err := <-errs:
			cancel()
			wg.Wait()
			return err
		case <-ctx.Done():
			upgrade, leaveErr := a.leave()
			cancel()
			wg.Wait()
			return errors.Join(leaveErr, a.shutdown(upgrade, stopZtunnel))
		}
	}
	if err := a.agent.RefreshSnapshot(); err != nil {
		a.log.Error("enablement snapshot", "err", err)
	}
	a.startup.Begin("DEL spool drain", nil)
	if _, err := a.agent.DrainSpool(runCtx); err != nil {
		a.log.Warn("drain DEL spool", "err", err)
	}
	a.startup.Begin("host probe set sync", nil)
	if err := a.agent.SyncHostProbe(); err != nil {
		a.log.Warn("sync host probe set", "err", err)
	}
	a.startup.Begin("listen", nil)
	if err := a.zds.Listen(); err != nil {
		cancel()
		wg.Wait()
		return fmt.Errorf("zds: %w", err)
	}
	if err := a.server.Listen(); err != nil {
		cancel()
		wg.Wait()
		_ = a.zds.Close()
		return fmt.Errorf("event server: %w", err)
	}
	a.startup.Done()
	start(&zdsWG, zdsCtx, "zds", a.zds.Serve)
	run("event-server", a.server.Serve)
	run("watchdog", a.watchdog)
	run("spool", a.agent.RunSpoolDrain)
	if a.verifier != nil {
		// Once the pods are restored and the servers listen: a proof
		// before a ztunnel connected would find every pod unheld.
		run("verifier", a.verifier.Run)
	}
	if c.StartupTaint {
		run("startup-taint", nodetaint.Untainter{
			Client: a.opts.Client, Node: c.NodeName, Ready: a.health.CaptureReady,
			Logger: a.log.With("component", "startup-taint"),
		}.Run)
	}
	a.log.Info("node agent ready", "node", c.NodeName, "pods", len(a.agent.Pods()))
	returnStartupGarbage()

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errs:
		a.log.Error("component failed; shutting down", "err", runErr)
	}
	upgrade, leaveErr := a.leave()
	if upgrade && runErr == nil {
		// Give the annotation writes queued by the last captures a
		// moment; whatever is left the next agent repairs.
		fctx, fcancel := context.WithTimeout(context.Background(), annotationFlushTimeout)
		if err := a.agent.FlushAnnotations(fctx); err != nil {
			a.log.Info("annotation writes left to the next agent", "pending", a.agent.PendingAnnotations())
		}
		fcancel()
	}
	cancel()
	wg.Wait()
	return errors.Join(runErr, leaveErr, a.shutdown(upgrade, stopZtunnel))
}

// watchdog gives up on an event server that stopped answering (see
// watchdogPeriod): its error ends Run, and Hung is closed.
func (a *App) watchdog(ctx context.Context) error {
	period := a.opts.WatchdogPeriod
	if period <= 0 {
		period = watchdogPeriod
	}
	err := health.Watchdog{
		Name: "the plugin event server", Check: a.server.Answering,
		Period: period, Timeout: health.LiveTimeout, Failures: watchdogFailures,
		Failed: func(err error, inARow int) {
			a.log.Warn("the plugin event server did not answer the watchdog", "in_a_row", inARow, "exit_at", watchdogFailures, "err", err)
		},
	}.Run(ctx)
	if err != nil {
		a.hungOnce.Do(func() { close(a.hung) })
	}
	return err
}

// Hung is closed when the watchdog gave up on the event server; Run then
// shuts down and returns its error.
func (a *App) Hung() <-chan struct{} { return a.hung }

// metricsRetry is how often a metrics address that could not be bound is
// tried again.
// (Options.MetricsRetry overrides it).
const metricsRetry = 30 * time.Second

// serveMetrics serves /metrics until ctx ends. When the address is taken,
// the agent says so where an operator looks (an error in the log, a
// Warning Event on its own pod) and tries again every metricsRetry; CNI is
// served meanwhile.
func (a *App) serveMetrics(ctx context.Context) {
	addr, every := a.cfg.MetricsAddr, a.opts.MetricsRetry
	if every <= 0 {
		every = metricsRetry
	}
	health.ServeRetrying(ctx, addr, health.MetricsHandler(a.metrics.Registry), health.Retry{
		Every: every,
		Bound: func(bound net.Addr) {
			a.log.Info("serving metrics", "addr", bound.String())
			if a.opts.MetricsReady != nil {
				a.opts.MetricsReady(bound)
			}
		},
		Failed: func(err error, attempt int) {
			a.log.Error("metrics unavailable: cannot serve /metrics; CNI is served without it, retrying", "addr", addr,
				"retry_in", every.String(), "attempt", attempt, "err", err)
			if attempt == 1 {
				a.warnOwnPod(ctx, "MetricsUnavailable",
					fmt.Sprintf("cannot serve /metrics on %s (%v); the node agent serves CNI without metrics and retries every %s", addr, err, every))
			}
		},
	})
}

// warnOwnPod records a Warning Event on the agent's own pod, found in the
// pod cache so the Event carries its UID (kubectl describe matches on it);
// with no pod name configured it only logs.
func (a *App) warnOwnPod(ctx context.Context, reason, msg string) {
	c := a.cfg
	if c.PodName == "" || c.PodNamespace == "" {
		return
	}
	ref := &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: c.PodNamespace, Name: c.PodName}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if a.pods.WaitForSync(wctx) == nil {
		if p, err := a.pods.Pod(c.PodNamespace, c.PodName); err == nil {
			ref.UID = p.UID
		}
	}
	a.events.Event(ref, corev1.EventTypeWarning, reason, msg)
}

// daemonSetChanged follows the DaemonSet watch: a DaemonSet being deleted
// (helm uninstall's hook deletes it in the foreground before the agents
// get SIGTERM) or gone means an uninstall, so the marker is written at
// once and a kill anywhere in the shutdown to come finds it there; one
// that comes back (deleted and created again, orphaning its pods) or is
// replaced (another DaemonSet of the chart present: a rename, whose agent
// takes the node over) takes the marker away, unless this agent already
// decided to uninstall.
func (a *App) daemonSetChanged(prev, next string) {
	layout := a.cfg.Layout()
	switch {
	case next == "being deleted" || next == "deleted":
		note := fmt.Sprintf("agent DaemonSet %s/%s %s, seen by agent pod %s/%s on node %s", a.cfg.PodNamespace, a.cfg.DaemonSet, next, a.cfg.PodNamespace, a.cfg.PodName, a.cfg.NodeName)
		if err := nodefiles.MarkUninstalling(layout, note); err != nil {
			a.log.Error("uninstall: cannot write the uninstall marker", "err", err)
			return
		}
		a.log.Info("uninstall: marker written", "why", "agent DaemonSet "+next, "marker", layout.Uninstalling())
	case (next == "present" || next == "replaced") && (prev == "being deleted" || prev == "deleted") && !a.leaving.Load():
		why := "is back"
		if next == "replaced" {
			why = "replaced by another DaemonSet of the chart"
		}
		if had, err := nodefiles.ClearUninstalling(layout); err != nil {
			a.log.Error("cannot remove the uninstall marker of a DaemonSet that "+why, "err", err)
		} else if had {
			a.log.Info("agent DaemonSet " + why + ": uninstall marker removed")
		}
	}
}

// leave is the first step of a stop, taken while every component still
// runs (the event server answers, the annotation writer writes): the
// upgrade decision (kubeadapter's DaemonSet check), and on an uninstall the
// uninstall marker, then the plugin unchained (the runtime no longer calls
// it for new pods). The marker comes first so that a kill at any later
// step leaves a plugin that, finding no agent, lets pods through.
func (a *App) leave() (upgrade bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	upgrade = kubeadapter.IsUpgrade(ctx, a.upgrade, a.log)
	if upgrade {
		// The watch may have written the marker for a deletion the
		// decision found to be a rename (the other DaemonSet seen late):
		// the next agent takes the node over, and a marker left behind
		// would let every pod through in any later outage.
		if seen := a.upgrade.Seen(); seen == "being deleted" || seen == "deleted" || seen == "replaced" {
			if had, err := nodefiles.ClearUninstalling(a.cfg.Layout()); err != nil {
				a.log.Error("upgrade: cannot remove the uninstall marker the DaemonSet watch wrote", "err", err)
			} else if had {
				a.log.Info("upgrade: the uninstall marker the DaemonSet watch wrote removed")
			}
		}
		return true, nil
	}
	a.leaving.Store(true)
	layout := a.cfg.Layout()
	note := fmt.Sprintf("uninstall of ambient-cni from node %s begun by agent pod %s/%s", a.cfg.NodeName, a.cfg.PodNamespace, a.cfg.PodName)
	if err := nodefiles.MarkUninstalling(layout, note); err != nil {
		// Unchain anyway: a plugin left chained without an agent blocks
		// the node's pods for good.
		a.log.Error("uninstall: cannot write the uninstall marker; unchaining the plugin without it", "err", err)
	} else {
		a.log.Info("uninstall: marker written", "marker", layout.Uninstalling())
	}
	if err := a.installer.Shutdown(ctx, false); err != nil {
		return false, fmt.Errorf("installer shutdown: %w", err)
	}
	a.unchained = true
	a.log.Info("uninstall: plugin unchained; releasing the pods")
	return false, nil
}

// shutdown finishes a stop once every other component stopped (leave
// made the decision, and on an uninstall unchained the plugin). On an
// upgrade the next agent takes over: pods keep their rules, new pods
// wait for it, and the startup taint may go back on the node. On an
// uninstall the node goes back to plain networking: every captured pod is
// released (annotation, rules, and a Del to ztunnel, whose acks are
// awaited, bounded, before stopZtunnel closes the ZDS server), then the
// host probe set and the agent's node files go, the node directories are
// put back as they were, and, last, the uninstall marker. stopZtunnel
// stops the ZDS server.
func (a *App) shutdown(upgrade bool, stopZtunnel func()) error {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	var errs []error
	if upgrade && a.cfg.StartupTaintOnShutdown {
		// First, so that nothing is scheduled onto the node while it has no
		// agent; on an uninstall the taint would never go again.
		if added, err := nodetaint.Add(ctx, a.opts.Client, a.cfg.NodeName); err != nil {
			errs = append(errs, fmt.Errorf("startup taint: %w", err))
		} else if added {
			a.log.Info("startup taint put back until the next agent is ready", "node", a.cfg.NodeName)
		}
	}
	if !upgrade {
		// Its own budget (within the chart's 30 s grace period): one API
		// call and one rule removal per pod.
		rctx, rcancel := context.WithTimeout(context.Background(), releaseTimeout)
		if err := a.agent.ReleaseAll(rctx); err != nil {
			errs = append(errs, fmt.Errorf("release pods: %w", err))
		}
		rcancel()
		dctx, dcancel := context.WithTimeout(context.Background(), ztunnelDelTimeout)
		if err := a.zds.Drain(dctx); err != nil {
			a.log.Warn("ztunnel did not ack every Del of the released pods; it drops them when it reconnects or stops", "err", err)
		}
		dcancel()
	}
	stopZtunnel()
	_ = a.agent.Close()
	ictx, icancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer icancel()
	if upgrade || !a.unchained {
		// An upgrade leaves the plugin; an uninstall whose unchaining
		// failed in leave tries once more.
		if err := a.installer.Shutdown(ictx, upgrade); err != nil {
			errs = append(errs, fmt.Errorf("installer shutdown: %w", err))
		} else if !upgrade {
			a.unchained = true
		}
	}
	if !upgrade {
		layout := a.cfg.Layout()
		if err := a.agent.RemoveHostProbe(); err != nil {
			errs = append(errs, err)
		}
		if err := a.agent.RemoveNodeFiles(); err != nil {
			errs = append(errs, err)
		}
		// The plugin's side of the agent-down fallback: unchained now, so
		// neither the heartbeat nor the ADD spool has a reader left.
		if err := nodefiles.RemoveHeartbeat(layout.Heartbeat()); err != nil {
			errs = append(errs, err)
		}
		if err := os.RemoveAll(layout.AddSpool()); err != nil {
			errs = append(errs, fmt.Errorf("remove ADD spool: %w", err))
		}
		if err := nodedirs.Restore(layout.NodeDirsLedger()); err != nil {
			errs = append(errs, err)
		}
		// Last, and only once no config names the plugin: until then it
		// is what lets pods through.
		if a.unchained {
			if _, err := nodefiles.ClearUninstalling(layout); err != nil {
				errs = append(errs, err)
			}
		}
	}
	a.log.Info("install-cni stopped", "upgrade", upgrade)
	return errors.Join(errs...)
}

// istioInstallResult is istio_cni_installs_total's result for an
// installer outcome.
func istioInstallResult(o installer.Outcome) string {
	switch o {
	case installer.OutcomeInstalled:
		return metrics.InstallSuccess
	case installer.OutcomeCopyFailed:
		return metrics.InstallCopyFailure
	}
	return metrics.InstallConfigFailure
}
