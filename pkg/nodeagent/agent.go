package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/plugin/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// RuleApplier installs, verifies and removes the in-pod rules inside the
// namespace at a path (pkg/iptables.Applier).
type RuleApplier interface {
	Apply(netns string, cfg iptables.PodConfig) error
	Verify(netns string, cfg iptables.PodConfig) (iptables.Drift, error)
	Remove(netns string) error
}

// Ztunnel hands pods to ztunnel over ZDS (pkg/zds.Server). Add returns
// once the newest ztunnel acknowledged the pod.
type Ztunnel interface {
	Add(ctx context.Context, w zds.Workload) error
	Del(ctx context.Context, uid string) error
}

// Decider answers the CNI path's question: should this pod be captured?
// The pod controller implements it over its informer cache; tests use
// PolicyDecider.
type Decider interface {
	Decide(ctx context.Context, namespace, name, uid string) (enablement.Decision, *corev1.Pod, error)
}

// EnablementSource is the node-wide view the enablement snapshot is built
// from: namespaces labelled ambient, and whether pod-level enablement is in
// use.
type EnablementSource interface {
	EnablementState() (enabled []string, podLevel bool)
}

// Annotator writes the pod's redirection status annotation; value "" removes
// it.
type Annotator interface {
	SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error
}

// HostProbe keeps the host's probe SNAT set (pkg/iptables.HostProbe): the
// IPs of enrolled pods, whose kubelet probes are SNATed to the probe
// address so the in-pod rules let them reach the application directly.
type HostProbe interface {
	AddIP(ip netip.Addr) error
	DelIP(ip netip.Addr) error
	IPs() ([]netip.Addr, error)
}

// Config configures an Agent. Decider and Rules are required.
type Config struct {
	Decider Decider
	Rules   RuleApplier
	// Ztunnel receives enrolled pods; nil means no ztunnel handoff (pods
	// count as enabled once their rules are in place).
	Ztunnel Ztunnel
	// ZtunnelTimeout bounds the wait for ztunnel's ack of an Add (default
	// 5s); past it the enroll fails as retryable.
	ZtunnelTimeout time.Duration
	// HostProbe, when set, gets each enrolled pod's IPs.
	HostProbe HostProbe
	// Annotator writes the redirection annotation; nil writes none.
	Annotator Annotator
	// Enablement feeds the snapshot file; nil writes no snapshot.
	Enablement EnablementSource
	// SnapshotFile is the enablement snapshot path (default next to the
	// default agent socket).
	SnapshotFile string
	// SpoolDir is where the plugin spools DELs (default next to the default
	// agent socket).
	SpoolDir string
	// ExcludedNamespaces are recorded in the snapshot (default kube-system).
	ExcludedNamespaces []string
	// DNSCapture is the default for pods without the dns-capture annotation.
	DNSCapture bool
	// ProbeSNATv4 and ProbeSNATv6 override the kubelet probe sources.
	ProbeSNATv4, ProbeSNATv6 netip.Addr
	// OnRuleError, when set, is told about every failed rule operation
	// ("apply", "verify", "remove"); OnDriftRepaired about every drifted
	// rule set re-applied at restore. Wire metrics here.
	OnRuleError     func(op string)
	OnDriftRepaired func()
	// Logger receives structured logs (default: discarded).
	Logger *slog.Logger
}

// PodState is an enrolled pod's capture state, the value of the
// redirection annotation.
type PodState string

// Pod states.
const (
	// StatePending: rules are in place, ztunnel has not acked.
	StatePending PodState = ambient.RedirectionPending
	// StateEnabled: ztunnel acked (or no ztunnel handoff is configured).
	StateEnabled PodState = ambient.RedirectionEnabled
)

// PodInfo identifies a pod the runtime is starting (the CNI path).
type PodInfo struct {
	Namespace, Name string
	// UID may be empty when the runtime does not pass K8S_POD_UID.
	UID       types.UID
	SandboxID string
	IPs       []netip.Addr
}

// EnrolledPod is a copy of one entry of the agent's state.
type EnrolledPod struct {
	UID                             types.UID
	Namespace, Name, ServiceAccount string
	// SandboxID is empty for pods enrolled by the controller.
	SandboxID string
	// Netns is where the namespace was found; NetnsID its inode.
	Netns   string
	NetnsID uint64
	IPs     []netip.Addr
	State   PodState
	Rules   iptables.PodConfig
	Since   time.Time
}

type entry struct {
	EnrolledPod
	ns *Netns
}

// Agent is the node agent's core: the one way pods get in (Enroll,
// HandleAdd, Restore) and out (Unenroll, RemoveSandbox, GC). It owns the
// enrolled-pod state and the netns handles in it.
type Agent struct {
	cfg      Config
	log      *slog.Logger
	snapshot *SnapshotWriter

	mu   sync.Mutex
	pods map[types.UID]*entry
	busy map[types.UID]*podLock
}

// podLock serializes work on one pod while letting different pods proceed
// in parallel.
type podLock struct {
	mu   sync.Mutex
	refs int
}

// NewAgent checks cfg and returns an agent with empty state.
func NewAgent(cfg Config) (*Agent, error) {
	if cfg.Decider == nil || cfg.Rules == nil {
		return nil, errors.New("nodeagent: Decider and Rules are required")
	}
	if cfg.ZtunnelTimeout <= 0 {
		cfg.ZtunnelTimeout = 5 * time.Second
	}
	if cfg.SnapshotFile == "" {
		cfg.SnapshotFile = nodefiles.SnapshotPath(ambient.DefaultAgentSocket)
	}
	if cfg.SpoolDir == "" {
		cfg.SpoolDir = nodefiles.SpoolDir(ambient.DefaultAgentSocket)
	}
	if cfg.ExcludedNamespaces == nil {
		cfg.ExcludedNamespaces = []string{ambient.DefaultExcludedNamespace}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Agent{
		cfg:      cfg,
		log:      cfg.Logger.With("component", "nodeagent"),
		snapshot: NewSnapshotWriter(cfg.SnapshotFile),
		pods:     map[types.UID]*entry{},
		busy:     map[types.UID]*podLock{},
	}, nil
}

func (a *Agent) lock(uid types.UID) func() {
	a.mu.Lock()
	l := a.busy[uid]
	if l == nil {
		l = &podLock{}
		a.busy[uid] = l
	}
	l.refs++
	a.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		a.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(a.busy, uid)
		}
		a.mu.Unlock()
	}
}

func (a *Agent) get(uid types.UID) *entry {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.pods[uid]
}

// HandleAdd is the CNI ADD: decide, then enroll. It takes ownership of ns
// and answers only once the pod's rules are in place (and ztunnel acked).
func (a *Agent) HandleAdd(ctx context.Context, p PodInfo, ns *Netns) (ambient.Verdict, error) {
	d, pod, err := a.cfg.Decider.Decide(ctx, p.Namespace, p.Name, string(p.UID))
	if err != nil {
		_ = ns.Close()
		return "", Retryable(fmt.Errorf("decide on pod %s/%s: %w", p.Namespace, p.Name, err))
	}
	log := a.log.With("pod", p.Namespace+"/"+p.Name, "sandbox", p.SandboxID)
	if pod != nil && p.UID != "" && pod.UID != p.UID {
		_ = ns.Close()
		return "", Retryable(fmt.Errorf("pod %s/%s is uid %s, the runtime asked for %s", p.Namespace, p.Name, pod.UID, p.UID))
	}
	if !d.Enroll {
		_ = ns.Close()
		log.Info("pod not enrolled", "reason", d.Reason)
		return ambient.VerdictNotEnrolled, nil
	}
	if err := a.enroll(ctx, pod, p.SandboxID, ns, p.IPs); err != nil {
		return "", err
	}
	log.Info("pod enrolled", "reason", d.Reason, "uid", pod.UID)
	return ambient.VerdictEnrolled, nil
}

// Enroll captures a pod the controller decided to enroll, whose netns is
// at netnsPath (found by a /proc scan). Idempotent.
func (a *Agent) Enroll(ctx context.Context, pod *corev1.Pod, netnsPath string) error {
	ns, err := OpenNetns(netnsPath)
	if err != nil {
		return fmt.Errorf("enroll %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return a.enroll(ctx, pod, "", ns, enablement.PodIPs(pod))
}

// ruleConfig is the rule set options for one pod.
func (a *Agent) ruleConfig(pod *corev1.Pod) iptables.PodConfig {
	return iptables.PodConfig{
		ProbeSNATv4:       a.cfg.ProbeSNATv4,
		ProbeSNATv6:       a.cfg.ProbeSNATv6,
		DNSCapture:        enablement.DNSCapture(pod, a.cfg.DNSCapture),
		BypassInbound:     enablement.BypassInbound(pod),
		VirtualInterfaces: enablement.VirtualInterfaces(pod),
	}
}

// enroll is the one enroll path. It owns ns: kept in the state on
// success, closed otherwise.
func (a *Agent) enroll(ctx context.Context, pod *corev1.Pod, sandboxID string, ns *Netns, ips []netip.Addr) error {
	if pod == nil || pod.UID == "" {
		_ = ns.Close()
		return errors.New("enroll: pod without uid")
	}
	unlock := a.lock(pod.UID)
	defer unlock()
	log := a.log.With("pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID)

	cfg := a.ruleConfig(pod)
	if err := a.cfg.Rules.Apply(ns.Path(), cfg); err != nil {
		a.ruleError("apply")
		_ = ns.Close()
		return Retryable(fmt.Errorf("apply in-pod rules in netns %s: %w", ns.Source(), err))
	}
	e := &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		SandboxID: sandboxID, Netns: ns.Source(), NetnsID: ns.ID(), IPs: slices.Clone(ips),
		State: StatePending, Rules: cfg, Since: time.Now(),
	}}
	a.mu.Lock()
	old := a.pods[pod.UID]
	if old != nil && old.ns.SameAs(ns) && sandboxID == "" {
		// The controller re-enrolling a pod the CNI path enrolled.
		e.SandboxID = old.SandboxID
	}
	a.pods[pod.UID] = e
	a.mu.Unlock()
	if old != nil {
		// Same netns: a repeated ADD. Another netns: the sandbox was
		// recreated; ztunnel replaces the old netns on Add.
		_ = old.ns.Close()
		a.dropProbeIPs(log, old.IPs, ips)
	}
	a.addProbeIPs(log, ips)

	if a.cfg.Ztunnel != nil {
		zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
		err := a.cfg.Ztunnel.Add(zctx, a.workload(e))
		cancel()
		if err != nil {
			a.annotate(ctx, log, e, string(StatePending))
			return Retryable(fmt.Errorf("hand pod %s/%s to ztunnel: %w", pod.Namespace, pod.Name, err))
		}
	}
	a.mu.Lock()
	e.State = StateEnabled
	a.mu.Unlock()
	if err := a.annotate(ctx, log, e, string(StateEnabled)); err != nil {
		return Retryable(err)
	}
	return nil
}

func (a *Agent) ruleError(op string) {
	if a.cfg.OnRuleError != nil {
		a.cfg.OnRuleError(op)
	}
}

func (a *Agent) annotate(ctx context.Context, log *slog.Logger, e *entry, value string) error {
	if a.cfg.Annotator == nil {
		return nil
	}
	err := a.cfg.Annotator.SetRedirection(ctx, e.Namespace, e.Name, e.UID, value)
	if err != nil {
		if apierrors.IsNotFound(err) {
			// A deleted pod has nothing left to annotate: not worth a warning.
			log.Debug("pod gone; annotation not written", "value", value)
		} else {
			log.Warn("set redirection annotation", "value", value, "err", err)
		}
		return fmt.Errorf("annotate pod %s/%s %s=%q: %w", e.Namespace, e.Name, ambient.RedirectionAnnotation, value, err)
	}
	return nil
}

func (a *Agent) workload(e *entry) zds.Workload {
	return zds.Workload{
		UID:   string(e.UID),
		Info:  zds.WorkloadInfo{Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount},
		Netns: e.ns.File(),
	}
}

// Restore adopts a pod enrolled before the agent restarted: it verifies the
// rules (re-applying only on drift) and puts the pod in the state the ZDS
// snapshot is built from, without a ztunnel Add of its own.
func (a *Agent) Restore(ctx context.Context, pod *corev1.Pod, netnsPath string) error {
	ns, err := OpenNetns(netnsPath)
	if err != nil {
		return fmt.Errorf("restore %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	unlock := a.lock(pod.UID)
	defer unlock()
	cfg := a.ruleConfig(pod)
	drift, err := a.cfg.Rules.Verify(ns.Path(), cfg)
	if err != nil {
		a.ruleError("verify")
		_ = ns.Close()
		return Retryable(fmt.Errorf("verify rules of %s/%s: %w", pod.Namespace, pod.Name, err))
	}
	if !drift.Empty() {
		a.log.Warn("repairing drifted in-pod rules", "pod", pod.Namespace+"/"+pod.Name, "drift", drift.String())
		if err := a.cfg.Rules.Apply(ns.Path(), cfg); err != nil {
			a.ruleError("apply")
			_ = ns.Close()
			return Retryable(fmt.Errorf("repair rules of %s/%s: %w", pod.Namespace, pod.Name, err))
		}
		if a.cfg.OnDriftRepaired != nil {
			a.cfg.OnDriftRepaired()
		}
	}
	e := &entry{ns: ns, EnrolledPod: EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, ServiceAccount: pod.Spec.ServiceAccountName,
		Netns: ns.Source(), NetnsID: ns.ID(), IPs: enablement.PodIPs(pod), State: StateEnabled, Rules: cfg, Since: time.Now(),
	}}
	a.mu.Lock()
	old := a.pods[pod.UID]
	if old != nil {
		e.SandboxID = old.SandboxID
	}
	a.pods[pod.UID] = e
	a.mu.Unlock()
	if old != nil {
		_ = old.ns.Close()
	}
	a.addProbeIPs(a.log, e.IPs)
	return nil
}

// Unenroll removes capture from a pod the controller no longer wants
// captured (label removed, pod deleted or finished): annotation first, so
// istiod stops sending HBONE before the rules go, then rules, then ztunnel.
// The held netns handle keeps the namespace enterable even if the pod is
// gone. An unknown uid is fine.
func (a *Agent) Unenroll(ctx context.Context, uid types.UID) error {
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid)
	if err := a.annotate(ctx, log, e, ""); err != nil && !apierrors.IsNotFound(err) {
		return Retryable(err)
	}
	if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
		a.ruleError("remove")
		return Retryable(fmt.Errorf("remove rules of %s/%s: %w", e.Namespace, e.Name, err))
	}
	a.forget(ctx, log, e)
	return nil
}

// RemoveSandbox is the CNI DEL: forget the pod enrolled with this sandbox.
// The namespace is about to be destroyed, so every step is best effort and
// an unknown sandbox is fine; DEL must not wedge the runtime. A DEL for an
// older sandbox of a pod leaves the pod's current enrollment alone.
func (a *Agent) RemoveSandbox(ctx context.Context, sandboxID string, uid types.UID) error {
	if sandboxID == "" {
		return invalid(errors.New("remove sandbox: empty sandbox id"))
	}
	if uid == "" {
		uid = a.uidOfSandbox(sandboxID)
		if uid == "" {
			return nil
		}
	}
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil || e.SandboxID != sandboxID {
		return nil
	}
	log := a.log.With("pod", e.Namespace+"/"+e.Name, "uid", uid, "sandbox", sandboxID)
	_ = a.annotate(ctx, log, e, "")
	if err := a.cfg.Rules.Remove(e.ns.Path()); err != nil {
		a.ruleError("remove")
		log.Warn("remove rules of a departing sandbox", "err", err)
	}
	a.forget(ctx, log, e)
	return nil
}

// forget tells ztunnel, drops the entry and closes the netns handle.
// Called with the pod's lock held.
func (a *Agent) forget(ctx context.Context, log *slog.Logger, e *entry) {
	if a.cfg.Ztunnel != nil {
		zctx, cancel := context.WithTimeout(ctx, a.cfg.ZtunnelTimeout)
		if err := a.cfg.Ztunnel.Del(zctx, string(e.UID)); err != nil {
			// A ztunnel that missed the Del drops the pod at its next snapshot.
			log.Warn("ztunnel del", "err", err)
		}
		cancel()
	}
	a.mu.Lock()
	if a.pods[e.UID] == e {
		delete(a.pods, e.UID)
	}
	a.mu.Unlock()
	_ = e.ns.Close()
	a.dropProbeIPs(log, e.IPs, nil)
	log.Info("pod removed")
}

// addProbeIPs puts a pod's IPs in the host probe set. A failure costs the
// pod its kubelet probes' bypass, not its capture, so it is logged and
// counted rather than failing the enroll.
func (a *Agent) addProbeIPs(log *slog.Logger, ips []netip.Addr) {
	if a.cfg.HostProbe == nil {
		return
	}
	for _, ip := range ips {
		if err := a.cfg.HostProbe.AddIP(ip); err != nil {
			a.ruleError("probe")
			log.Warn("add pod IP to host probe set", "ip", ip, "err", err)
		}
	}
}

// dropProbeIPs removes IPs from the host probe set, except those in keep
// and those another enrolled pod holds (an IP reused before a late DEL).
func (a *Agent) dropProbeIPs(log *slog.Logger, ips, keep []netip.Addr) {
	if a.cfg.HostProbe == nil {
		return
	}
	inUse := a.enrolledIPs()
	for _, ip := range ips {
		if slices.Contains(keep, ip) || inUse[ip] {
			continue
		}
		if err := a.cfg.HostProbe.DelIP(ip); err != nil {
			a.ruleError("probe")
			log.Warn("remove pod IP from host probe set", "ip", ip, "err", err)
		}
	}
}

func (a *Agent) enrolledIPs() map[netip.Addr]bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[netip.Addr]bool{}
	for _, e := range a.pods {
		for _, ip := range e.IPs {
			out[ip] = true
		}
	}
	return out
}

// SyncHostProbe makes the host probe set hold exactly the enrolled pods'
// IPs. Call it once the state is restored after a restart: pods deleted
// while the agent was down leave their IPs behind otherwise.
func (a *Agent) SyncHostProbe() error {
	if a.cfg.HostProbe == nil {
		return nil
	}
	have, err := a.cfg.HostProbe.IPs()
	if err != nil {
		return fmt.Errorf("list host probe set: %w", err)
	}
	want := a.enrolledIPs()
	var errs []error
	inSet := make(map[netip.Addr]bool, len(have))
	for _, ip := range have {
		inSet[ip] = true
		if !want[ip] {
			errs = append(errs, a.cfg.HostProbe.DelIP(ip))
		}
	}
	for ip := range want {
		if !inSet[ip] {
			errs = append(errs, a.cfg.HostProbe.AddIP(ip))
		}
	}
	return errors.Join(errs...)
}

func (a *Agent) uidOfSandbox(sandboxID string) types.UID {
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid, e := range a.pods {
		if e.SandboxID == sandboxID {
			return uid
		}
	}
	return ""
}

// ErrDrift is wrapped by Check's error when the in-pod rules differ from
// what the agent applied.
var ErrDrift = errors.New("in-pod rules drifted")

// Check is the CNI CHECK: a pod that should be captured must be enrolled in
// this very namespace with its rules intact. It takes ownership of ns.
func (a *Agent) Check(ctx context.Context, p PodInfo, ns *Netns) error {
	defer ns.Close()
	d, pod, err := a.cfg.Decider.Decide(ctx, p.Namespace, p.Name, string(p.UID))
	if err != nil {
		return Retryable(fmt.Errorf("decide on pod %s/%s: %w", p.Namespace, p.Name, err))
	}
	uid := p.UID
	if uid == "" && pod != nil {
		uid = pod.UID
	}
	unlock := a.lock(uid)
	defer unlock()
	e := a.get(uid)
	if e == nil {
		if d.Enroll {
			return fmt.Errorf("pod %s/%s should be captured (%s) but is not enrolled", p.Namespace, p.Name, d.Reason)
		}
		return nil
	}
	if !e.ns.SameAs(ns) {
		return fmt.Errorf("pod %s/%s is enrolled in netns %s (inode %d), not %s", p.Namespace, p.Name, e.Netns, e.NetnsID, ns.Source())
	}
	drift, err := a.cfg.Rules.Verify(e.ns.Path(), e.Rules)
	if err != nil {
		a.ruleError("verify")
		return Retryable(fmt.Errorf("verify rules of %s/%s: %w", p.Namespace, p.Name, err))
	}
	if !drift.Empty() {
		return fmt.Errorf("%w in pod %s/%s: %s", ErrDrift, p.Namespace, p.Name, drift.String())
	}
	return nil
}

// GC forgets every CNI-enrolled pod whose sandbox is not in valid (pods the
// controller enrolled carry no sandbox id and are left to it). It returns
// how many it removed.
func (a *Agent) GC(ctx context.Context, valid []string) int {
	keep := make(map[string]bool, len(valid))
	for _, id := range valid {
		keep[id] = true
	}
	type stale struct {
		sandbox string
		uid     types.UID
	}
	var drop []stale
	a.mu.Lock()
	for uid, e := range a.pods {
		if e.SandboxID != "" && !keep[e.SandboxID] {
			drop = append(drop, stale{e.SandboxID, uid})
		}
	}
	a.mu.Unlock()
	for _, s := range drop {
		_ = a.RemoveSandbox(ctx, s.sandbox, s.uid)
	}
	if len(drop) > 0 {
		a.log.Info("gc removed stale sandboxes", "count", len(drop))
	}
	return len(drop)
}

// DrainSpool replays the DELs the plugin spooled while the agent was
// unreachable, removing each entry once handled (unusable entries are
// logged and removed). Call it at startup after restoring state.
func (a *Agent) DrainSpool(ctx context.Context) (int, error) {
	entries, err := nodefiles.List(a.cfg.SpoolDir)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, en := range entries {
		if en.Err != nil {
			a.log.Warn("dropping unusable spool entry", "path", en.Path, "err", en.Err)
			_ = nodefiles.Remove(en.Path)
			continue
		}
		if err := a.RemoveSandbox(ctx, en.Event.SandboxID, types.UID(en.Event.PodUID)); err != nil {
			a.log.Warn("replay spooled DEL", "sandbox", en.Event.SandboxID, "err", err)
			continue
		}
		if err := nodefiles.Remove(en.Path); err != nil {
			a.log.Warn("remove spool entry", "err", err)
		}
		n++
	}
	if n > 0 {
		a.log.Info("replayed spooled DELs", "count", n)
	}
	return n, nil
}

// Pending reports whether uid is enrolled with its rules in place but not
// yet acknowledged by ztunnel.
func (a *Agent) Pending(uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.pods[uid]
	return e != nil && e.State == StatePending
}

// EnrolledUID reports the uid enrolled under namespace/name, if any.
func (a *Agent) EnrolledUID(namespace, name string) (types.UID, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid, e := range a.pods {
		if e.Namespace == namespace && e.Name == name {
			return uid, true
		}
	}
	return "", false
}

// Pods returns a copy of the enrolled-pod state, sorted by namespace/name.
func (a *Agent) Pods() []EnrolledPod {
	a.mu.Lock()
	out := make([]EnrolledPod, 0, len(a.pods))
	for _, e := range a.pods {
		p := e.EnrolledPod
		p.IPs = slices.Clone(p.IPs)
		out = append(out, p)
	}
	a.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out
}

// Workloads lists every enrolled pod, including those whose ztunnel Add is
// still in flight, for the ZDS snapshot (zds.Config.Snapshot). It never
// waits on enroll work.
func (a *Agent) Workloads() []zds.Workload {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]zds.Workload, 0, len(a.pods))
	for _, e := range a.pods {
		out = append(out, a.workload(e))
	}
	return out
}

// RefreshSnapshot rewrites the enablement snapshot from cfg.Enablement if
// it changed. Wire it to the controller's OnEnablementChange: the first
// call should come once the controller's caches are synced, since a
// premature empty snapshot would let the plugin pass pods through.
func (a *Agent) RefreshSnapshot() error {
	if a.cfg.Enablement == nil {
		return nil
	}
	enabled, podLevel := a.cfg.Enablement.EnablementState()
	wrote, err := a.snapshot.Update(enabled, podLevel, a.cfg.ExcludedNamespaces)
	if err != nil {
		a.log.Error("write enablement snapshot", "err", err)
		return err
	}
	if wrote {
		a.log.Info("enablement snapshot written", "path", a.snapshot.Path(), "enabled", enabled, "podLevel", podLevel)
	}
	return nil
}

// Close releases every held netns handle; the rules stay, so a restarted
// agent can restore the pods without touching their traffic.
func (a *Agent) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid, e := range a.pods {
		_ = e.ns.Close()
		delete(a.pods, uid)
	}
	return nil
}
