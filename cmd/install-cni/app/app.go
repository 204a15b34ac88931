// Package app assembles the install-cni process (the DaemonSet container)
// for cmd/install-cni, which calls Main, and for the end-to-end tests,
// which run New and Run in-process. By job:
//
//   - options.go, optionvalues.go: every setting (flag, environment
//     variable, default, validation) and the table rendered into
//     docs/install-cni.md.
//   - main.go: Main, the process (client, signals, the watchdog's exit).
//   - app.go: New wires the parts (installer, pod cache, node agent with
//     its plugin event server and ZDS server, pod controller, verifier,
//     host probe set); nothing runs or touches the node until Run.
//   - steps.go: a lifecycle as an ordered list of named steps, each with
//     its undo, and the one runner of such lists.
//   - start.go: Run, and the start as a list (startSteps), in the order
//     docs/how-it-works.md "The agent's start" gives.
//   - stop.go: the stop as a list, the upgrade's or the uninstall's
//     (in the order docs/deploy.md "Uninstall" gives), and the uninstall
//     marker the release signal's watch writes.
//   - health.go, startup.go: liveness (start-up steps, the event server,
//     the watchdog) and readiness; servers.go: the health, metrics and
//     debug servers.
//   - plugincred.go: what the plugin decides by while the agent cannot
//     answer (its credential, the fallback binary).
//   - debug.go: the `install-cni debug` and `install-cni probe` commands.
package app

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/explain"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/metrics"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

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

// snapshotRefresh is how often the enablement snapshot is brought up to
// date with this node's pods.
const snapshotRefresh = 15 * time.Second

// hostProbeResync is how often the host probe SNAT is put back (another
// tool removed it, or got a rule above it in POSTROUTING).
const hostProbeResync = 30 * time.Second

// App is one install-cni process.
type App struct {
	cfg *Config
	// layout is where the agent's node files are (Config.Layout), the
	// one copy every part takes its paths from.
	layout  nodefiles.Layout
	log     *slog.Logger
	opts    Options
	metrics *metrics.Metrics
	// started is when New began: the agent's start, for the time to its
	// first ztunnel (metrics.StartToZtunnel).
	started time.Time

	installer *installer.Installer
	upgrade   *apicalls.DaemonSetUpgradeChecker
	rules     *rulesbackend.Backend
	events    *apicalls.Events
	pods      *podcache.Cache
	agent     *nodeagent.Agent
	server    *nodeagent.Server
	zds       *zds.Server
	ctrl      *controller.Controller
	health    *health.Server
	startup   *health.Startup
	explain   *explain.Explainer
	cred      *plugincred.Rotator    // nil when no plugin credential is configured
	tokens    *apicalls.PluginTokens // the credential's source; nil as cred
	verifier  *verifier.Verifier     // nil when verify-period is 0

	// hung is closed when the watchdog gave up on the event server.
	hung     chan struct{}
	hungOnce sync.Once
	// unchained is set once an uninstall took the plugin out of every
	// config (uninstallSteps: the first try, or the second).
	unchained bool
	// leaving is set once the stop decided on an uninstall: the release
	// signal's watch no longer clears the uninstall marker.
	leaving atomic.Bool
	// standby is set while the agent waits for istio-cni to leave the
	// node (standbySteps): it is then ready, doing what it should.
	standby atomic.Bool
	// istioLeft reads istio-cni's DaemonSet, with the takeover on.
	istioLeft apicalls.IstioCNILeft
	// zdsDeferred is set by the start when another process listened on
	// ztunnel's socket (zdsguard.go): the socket and the host probe SNAT
	// wait for it to stop. Start steps only, in order.
	zdsDeferred bool
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
	a := &App{cfg: c, layout: c.Layout(), log: o.Logger, opts: o, metrics: o.Metrics, hung: make(chan struct{}), started: time.Now()}
	m := a.metrics

	// Rules in pods and the host probe SNAT: nothing is dialled or
	// installed until used; Run closes what the backend holds.
	rules, err := rulesbackend.New(rulesbackend.Config{Backend: c.RulesBackend, HostNetns: o.HostNetns, Logger: a.log,
		FollowIstioCNI: c.IstioCNIRunDir != "",
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
		AgentDownAfter: c.AgentDownAfter.String(), IstioCNIRunDir: c.IstioCNIRunDir,
		IstioCNIConfDir: istioCNIConfDir(c),
	})
	if err != nil {
		return nil, err
	}
	// The one event recorder (its broadcaster runs from here): every part
	// records through it, Run starts and stops it.
	a.events = apicalls.NewEvents(o.Client, c.NodeName)
	var istioGone func(string) error
	if c.IstioCNIRunDir != "" {
		a.istioLeft = apicalls.IstioCNILeft{Client: o.Client, Namespace: c.PodNamespace, DaemonSet: c.IstioCNIDaemonSet, Node: c.NodeName}
		istioGone = istioCNIGone(installer.IstioCNIAgentGone(c.IstioCNIRunDir), a.istioLeft)
	}
	a.installer, err = installer.New(installer.Config{
		BinDir: c.CNIBinDir, ExtraBinDirs: c.CNIExtraBinDirs, ConfDir: c.CNIConfDir, PluginBinary: c.PluginBinary, PluginName: c.PluginType,
		PrimaryConfName: c.CNIConfName, PluginConfig: entry,
		Owned: c.CNIOwnedConfig, OwnedConfName: c.CNIOwnedConfName, Sibling: c.CNIChainInNetworkFolder,
		IstioCNIGone: istioGone,
		StateFile:    a.layout.InstallerState(),
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
	// What the agent watches (APIWatches): the pod cache it decides
	// with, and the release's signal.
	watches := NewAPIWatches(c, o.Client, m.ObserveEvent, a.log)
	a.upgrade = watches.Upgrade
	a.upgrade.OnChange(a.releaseSignalChanged)
	a.pods = watches.Pods
	a.tokens = watches.Tokens

	// The agent and what it drives: rules, host probe set, ztunnel,
	// annotations.
	a.zds = zds.NewServer(zds.Config{
		SocketPath: c.ZDSSocket, Logger: a.log.With("component", "zds"),
		// Every ztunnel that connects (a restarted one, or ours after an
		// agent restart) must get the enrolled pods, or it drops them all.
		// The agent exists before Run lets the server serve.
		Snapshot: func() []zds.Workload { return a.agent.Workloads() },
		// A pod left pending (its ADD timed out waiting for ztunnel, or a
		// previous agent crashed first) is enabled once a snapshot acks it.
		SnapshotAcked: func(uid string, netns *os.File) { a.agent.SnapshotAcked(uid, netns) },
	})
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
		Annotator:          apicalls.Annotator{Client: o.Client},
		AnnotationQPS:      float64(c.AnnotationQPS),
		AnnotationBurst:    c.AnnotationBurst,
		Pods:               a.pods,
		Layout:             a.layout,
		Netns:              netnsPolicy,
		Enablement:         a.pods,
		ExcludedNamespaces: nonNil(c.ExcludedNamespaces),
		DNSCapture:         c.DNSCapture,
		ProbeSNATv4:        c.ProbeSNATv4,
		ProbeSNATv6:        c.ProbeSNATv6,
		IPv4Only:           !c.IPv6,
		OnRuleError:        func(op string) { m.RuleErrors.WithLabelValues(op).Inc() },
		OnDriftRepaired:    m.RuleDrift.Inc,
		OnAddAcked:         func(d time.Duration) { m.AddZtunnelAck.Observe(d.Seconds()) },
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
		Layout: a.layout, Netns: netnsPolicy,
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
		Finder:        finder,
		Backend:       rules.Name,
		Ztunnels:      a.zds.Connections,
		ReleaseSignal: a.upgrade.Seen,
		Policy:        c.EnablementPolicy(),
	}
	if a.verifier != nil {
		a.explain.Verified = a.verification
	}
	a.cred = a.pluginRotator()
	a.checkHealth()
	return a, nil
}

// verification is the verifier's last proof of uid, as explain shows it.
func (a *App) verification(uid types.UID) (explainwire.Verification, bool) {
	p, ok := a.verifier.Last(uid)
	if !ok {
		return explainwire.Verification{}, false
	}
	v := explainwire.Verification{At: p.At, Proven: p.OK, Repaired: p.Repaired, Problem: p.Problem}
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

// ReleaseSignalSeen is what the watch on the release's signal last saw:
// "" (nothing yet, or no signal), "present", "being deleted" or "deleted".
func (a *App) ReleaseSignalSeen() string { return a.upgrade.Seen() }

// DebugSocket is where the debug endpoints are served: in the agent
// socket's (root-only) directory.
func (a *App) DebugSocket() string {
	return a.layout.DebugSocket()
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
