// Package daemon assembles the install-cni process from its parts: the
// installer, the node agent core, the plugin event server, the ZDS server,
// the pod controller, the host probe set, and the health/metrics server.
// cmd/install-cni wires flags into it; end-to-end tests run it in-process.
package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-cni/ambient-cni/pkg/agentconfig"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/metrics"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/plugin"
	"github.com/ambient-cni/ambient-cni/pkg/plugin/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// Options are what New needs besides the parsed configuration.
type Options struct {
	Config *agentconfig.Config
	// Client talks to the API server with the agent's own identity.
	Client kubernetes.Interface
	Logger *slog.Logger
	// Metrics defaults to a fresh set.
	Metrics *metrics.Metrics
	// HostNetns is where the host probe set lives: "" is this process's
	// own (host) network namespace; tests point it at a stand-in.
	HostNetns string
	// HealthReady, when set, receives the health server's bound address.
	HealthReady func(net.Addr)
}

// Daemon is one running install-cni process.
type Daemon struct {
	cfg       *agentconfig.Config
	log       *slog.Logger
	client    kubernetes.Interface
	metrics   *metrics.Metrics
	installer *installer.Installer
	agent     *nodeagent.Agent
	events    *nodeagent.Server
	zds       *zds.Server
	ctrl      *controller.Controller
	probe     rulesbackend.HostProbe
	health    *health.Server
	recorder  record.EventRecorder
	broadcast record.EventBroadcaster
	opts      Options

	restored  atomic.Bool
	listening atomic.Bool
}

// lateController lets the agent use the controller (as its Decider and
// EnablementSource) although the controller, which needs the agent as its
// Enroller, is built after it. Nothing calls it before Run.
type lateController struct{ c *controller.Controller }

func (l *lateController) Decide(ctx context.Context, namespace, name, uid string) (enablement.Decision, *corev1.Pod, error) {
	return l.c.Decide(ctx, namespace, name, uid)
}

func (l *lateController) EnablementState() ([]string, bool) { return l.c.EnablementState() }

// New builds every part; nothing runs or touches the node until Run.
func New(o Options) (*Daemon, error) {
	c := o.Config
	if c == nil || o.Client == nil {
		return nil, errors.New("daemon: Config and Client are required")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New()
	}
	d := &Daemon{cfg: c, log: o.Logger, client: o.Client, metrics: o.Metrics, opts: o}

	backend, err := rulesbackend.New(rulesbackend.Config{Backend: c.IPTablesBackend, HostNetns: o.HostNetns, Logger: d.log,
		Probe: iptables.HostProbeConfig{ProbeSNATv4: c.ProbeSNATv4, ProbeSNATv6: c.ProbeSNATv6}})
	if err != nil {
		return nil, fmt.Errorf("rules backend: %w", err)
	}
	d.log.Info("rules backend", "backend", backend.Name)
	rules := backend.Rules
	d.probe = backend.Probe

	entry, err := json.Marshal(plugin.Entry{
		Type: c.PluginType, AgentSocket: c.AgentSocket, Timeout: c.PluginTimeout.String(),
		LogLevel: c.PluginLogLevel, ExcludedNamespaces: nonNil(c.ExcludedNamespaces),
		StatusRequiresAgent: c.StatusChecksAgent,
	})
	if err != nil {
		return nil, err
	}
	d.installer, err = installer.New(installer.Config{
		BinDir: c.CNIBinDir, ConfDir: c.CNIConfDir, PluginBinary: c.PluginBinary, PluginName: c.PluginType,
		PrimaryConfName: c.CNIConfName, PluginConfig: entry,
		StateFile:   filepath.Join(filepath.Dir(c.AgentSocket), "installer-state.json"),
		OnReinstall: d.metrics.InstallerReinstalls.Inc,
		Logger:      d.log,
	})
	if err != nil {
		return nil, fmt.Errorf("installer: %w", err)
	}

	d.broadcast = record.NewBroadcaster()
	d.recorder = d.broadcast.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "ambient-cni", Host: c.NodeName})

	d.zds = zds.NewServer(zds.Config{
		SocketPath: c.ZDSSocket, Logger: d.log.With("component", "zds"),
		// Every ztunnel that connects (a restarted one, or ours after an
		// agent restart) must get the enrolled pods, or it drops them all.
		// The agent exists before Run lets the server listen.
		Snapshot: func() []zds.Workload { return d.agent.Workloads() },
	})
	policy := enablement.Policy{ExcludedNamespaces: c.ExcludedNamespaces}
	late := &lateController{}
	d.agent, err = nodeagent.NewAgent(nodeagent.Config{
		Decider:            late,
		Rules:              rules,
		Ztunnel:            d.zds,
		ZtunnelTimeout:     c.ZtunnelWait,
		HostProbe:          d.probe,
		Annotator:          controller.Annotator{Client: o.Client},
		Enablement:         late,
		SnapshotFile:       nodefiles.SnapshotPath(c.AgentSocket),
		SpoolDir:           nodefiles.SpoolDir(c.AgentSocket),
		ExcludedNamespaces: nonNil(c.ExcludedNamespaces),
		DNSCapture:         c.DNSCapture,
		ProbeSNATv4:        c.ProbeSNATv4,
		ProbeSNATv6:        c.ProbeSNATv6,
		OnRuleError:        func(op string) { d.metrics.RuleErrors.WithLabelValues(op).Inc() },
		OnDriftRepaired:    d.metrics.RuleDrift.Inc,
		Logger:             d.log,
	})
	if err != nil {
		return nil, err
	}
	d.ctrl = controller.New(controller.Config{
		Client: o.Client, NodeName: c.NodeName, Policy: policy,
		Self:      types.NamespacedName{Namespace: c.PodNamespace, Name: c.PodName},
		Enroller:  eventingEnroller{Enroller: d.agent, rec: d.recorder},
		Annotator: controller.Annotator{Client: o.Client},
		Finder:    controller.ProcFinder{Scanner: podnetns.Scanner{ProcRoot: c.ProcRoot}, Logger: d.log},
		Logger:    d.log,
		OnEnablementChange: func() {
			if d.restored.Load() {
				_ = d.agent.RefreshSnapshot()
			}
		},
		AssumePodLevelEnablement: c.AssumePodLevelEnablement,
		OnScan:                   func(int, int, time.Duration) { d.metrics.NetnsScans.Inc() },
	})
	late.c = d.ctrl

	d.events = nodeagent.NewServer(nodeagent.ServerConfig{
		Socket: c.AgentSocket, NetnsRoots: c.NetnsDirs, ProcRoot: c.ProcRoot,
		// Answer the plugin before its own timeout fires.
		HandlerTimeout: c.PluginTimeout - time.Second,
		Observe: func(verb, result string, took time.Duration) {
			d.metrics.CNIRequests.WithLabelValues(verb, result).Inc()
			if verb == "ADD" {
				d.metrics.AddLatency.Observe(took.Seconds())
			}
		},
		Logger: d.log,
	}, d.agent)

	d.health = health.New(d.log, d.metrics.Registry, func() any { return d.agent.Pods() })
	d.health.AddCheck("installer", d.installer.Check)
	d.health.AddCheck("restore", func() error {
		if !d.restored.Load() {
			return errors.New("startup reconcile not done")
		}
		return nil
	})
	d.health.AddCheck("sockets", func() error {
		if !d.listening.Load() {
			return errors.New("event and ZDS servers not listening yet")
		}
		return nil
	})
	return d, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// eventingEnroller records a Kubernetes Event on the pod when the
// controller's enroll fails, so operators see why a pod is not captured.
type eventingEnroller struct {
	controller.Enroller
	rec record.EventRecorder
}

func (e eventingEnroller) Enroll(ctx context.Context, pod *corev1.Pod, netnsPath string) error {
	err := e.Enroller.Enroll(ctx, pod, netnsPath)
	if err != nil {
		e.rec.Eventf(pod, corev1.EventTypeWarning, "AmbientEnrollFailed", "could not enroll pod in the ambient mesh: %v", err)
	}
	return err
}

// Agent is the node agent core (for tests and debugging).
func (d *Daemon) Agent() *nodeagent.Agent { return d.agent }

// Ready lists what is not ready yet; empty means ready.
func (d *Daemon) Ready() []string { return d.health.Ready() }

// Run runs everything until ctx ends, then shuts down: servers stop, the
// held netns handles are released (rules stay in the pods), and the
// installer removes the plugin unless this is an upgrade.
func (d *Daemon) Run(ctx context.Context) error {
	c := d.cfg
	for _, dir := range []string{filepath.Dir(c.AgentSocket), filepath.Dir(c.ZDSSocket)} {
		if err := installer.EnsurePrivateDir(dir); err != nil {
			return err
		}
	}
	if err := d.probe.Ensure(); err != nil {
		return fmt.Errorf("host probe set: %w", err)
	}
	d.broadcast.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: d.client.CoreV1().Events("")})
	defer d.broadcast.Shutdown()

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	run := func(name string, f func(context.Context) error) {
		wg.Go(func() {
			if err := f(runCtx); err != nil && runCtx.Err() == nil {
				errs <- fmt.Errorf("%s: %w", name, err)
			}
		})
	}
	run("health", func(ctx context.Context) error { return d.health.Serve(ctx, c.HealthAddr, d.opts.HealthReady) })
	run("installer", d.installer.Run)
	run("controller", d.ctrl.Run)
	run("metrics", d.pollMetrics)
	run("host-probe", func(ctx context.Context) error {
		rulesbackend.KeepHostProbe(ctx, d.probe, 30*time.Second, d.log)
		return nil
	})

	// ztunnel must not get a snapshot before the pods enrolled by a
	// previous agent are back in the state, or it would drop them all:
	// listen only once the controller restored them.
	select {
	case <-d.ctrl.Restored():
	case err := <-errs:
		cancel()
		wg.Wait()
		return err
	case <-ctx.Done():
		cancel()
		wg.Wait()
		return d.shutdown()
	}
	d.restored.Store(true)
	if err := d.agent.RefreshSnapshot(); err != nil {
		d.log.Error("enablement snapshot", "err", err)
	}
	if _, err := d.agent.DrainSpool(runCtx); err != nil {
		d.log.Warn("drain DEL spool", "err", err)
	}
	if err := d.agent.SyncHostProbe(); err != nil {
		d.log.Warn("sync host probe set", "err", err)
	}
	if err := d.zds.Listen(); err != nil {
		cancel()
		wg.Wait()
		return fmt.Errorf("zds: %w", err)
	}
	if err := d.events.Listen(); err != nil {
		cancel()
		wg.Wait()
		_ = d.zds.Close()
		return fmt.Errorf("event server: %w", err)
	}
	d.listening.Store(true)
	run("zds", d.zds.Serve)
	run("event-server", d.events.Serve)
	run("spool", d.drainSpoolLoop)
	d.log.Info("node agent ready", "node", c.NodeName, "pods", len(d.agent.Pods()))

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errs:
		d.log.Error("component failed; shutting down", "err", runErr)
	}
	cancel()
	wg.Wait()
	return errors.Join(runErr, d.shutdown())
}

// shutdown releases state and decides whether the plugin stays installed.
// During an upgrade (the DaemonSet lives on) the plugin, its config entry
// and the host probe set stay, so pods keep their probes and new pods wait
// for the next agent; otherwise all three are removed.
func (d *Daemon) shutdown() error {
	_ = d.agent.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	checker := controller.DaemonSetUpgradeChecker{Client: d.client, Namespace: d.cfg.PodNamespace, Name: d.cfg.DaemonSet}
	upgrade := installer.IsUpgrade(ctx, checker, d.log)
	var errs []error
	if err := d.installer.Shutdown(ctx, upgrade); err != nil {
		errs = append(errs, fmt.Errorf("installer shutdown: %w", err))
	}
	if !upgrade {
		if err := d.probe.Remove(); err != nil {
			errs = append(errs, fmt.Errorf("remove host probe set: %w", err))
		}
	}
	d.log.Info("install-cni stopped", "upgrade", upgrade)
	return errors.Join(errs...)
}

// drainSpoolLoop replays DELs the plugin spooled while it could not reach
// the agent (a timeout while the agent stayed up), not just at startup.
func (d *Daemon) drainSpoolLoop(ctx context.Context) error {
	t := time.NewTicker(30 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if _, err := d.agent.DrainSpool(ctx); err != nil {
				d.log.Warn("drain DEL spool", "err", err)
			}
		}
	}
}

// pollMetrics keeps the gauges current.
func (d *Daemon) pollMetrics(ctx context.Context) error {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		counts := map[nodeagent.PodState]int{}
		for _, p := range d.agent.Pods() {
			counts[p.State]++
		}
		for _, st := range []nodeagent.PodState{nodeagent.StatePending, nodeagent.StateEnabled} {
			d.metrics.EnrolledPods.WithLabelValues(string(st)).Set(float64(counts[st]))
		}
		d.metrics.ZtunnelConnections.Set(float64(d.zds.Connections()))
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
