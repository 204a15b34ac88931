package nodeagent

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"time"

	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// Ztunnel hands pods to ztunnel over ZDS (pkg/zds.Server). Add returns
// once the newest ztunnel acknowledged the pod; Del once every connected
// ztunnel did. DelNoWait queues the Del on every connection, ordered
// before any later Add of the pod, and returns without waiting for acks.
type Ztunnel interface {
	Add(ctx context.Context, w zds.Workload) error
	Del(ctx context.Context, uid string) error
	DelNoWait(uid string) error
}

// HostProbe keeps the host's probe SNAT set (pkg/rulesbackend): the
// IPs of enrolled pods, whose kubelet probes are SNATed to the probe
// address so the in-pod rules let them reach the application directly.
type HostProbe interface {
	// Ensure creates the set and its rule; Remove takes both away.
	Ensure() error
	Remove() error
	AddIP(ip netip.Addr) error
	DelIP(ip netip.Addr) error
	IPs() ([]netip.Addr, error)
}

// EventRecorder records Kubernetes events on pods (client-go's
// record.EventRecorder satisfies it).
type EventRecorder interface {
	Eventf(object runtime.Object, eventtype, reason, messageFmt string, args ...any)
}

// DefaultZtunnelTimeout is how long a capture waits for ztunnel's ack of
// the pod by default.
const DefaultZtunnelTimeout = 5 * time.Second

// DefaultAnnotationQPS and DefaultAnnotationBurst pace the redirection
// annotation writes by default: the kubelet's own API client limit
// (50/s, burst 100), below the agent client's 80/160, so the requests a
// capture may need (a pod the cache has not seen yet) always find tokens
// left. docs/install-cni.md gives the reasoning from the API server's
// priority-and-fairness defaults.
const (
	DefaultAnnotationQPS   = 50
	DefaultAnnotationBurst = 100
)

// Config configures an Agent. Rules is required.
type Config struct {
	Rules ruleset.Applier
	// Ztunnel receives enrolled pods; nil means no ztunnel handoff (pods
	// count as enabled once their rules are in place).
	Ztunnel Ztunnel
	// ZtunnelTimeout bounds the wait for ztunnel's ack of an Add (default
	// DefaultZtunnelTimeout); past it the capture fails as retryable.
	ZtunnelTimeout time.Duration
	// HostProbe, when set, gets each enrolled pod's IPs.
	HostProbe HostProbe
	// Annotator writes the redirection annotation (off the capture's
	// critical path, see Run); nil writes none.
	Annotator Annotator
	// AnnotationQPS and AnnotationBurst pace the annotation writes (a
	// token bucket of their own, in front of the API client's); defaults
	// DefaultAnnotationQPS and DefaultAnnotationBurst.
	AnnotationQPS   float64
	AnnotationBurst int
	// Pods, when set, is the pod cache (see PodLister).
	Pods PodLister
	// Events, when set, gets a Warning on a captured pod whose annotations
	// the agent ignores because they do not parse.
	Events EventRecorder
	// Layout names the node files the agent keeps and reads (required, no
	// default: a default would be the real node's run directory, which a
	// caller that forgot it, a test, would then write into): the capture
	// records, the enablement snapshot and the plugin's DEL spool.
	Layout nodefiles.Layout
	// Netns decides which netns paths of CNI DELs (and spooled DELs) the
	// agent may open (nil roots: netns.DefaultRoots; and /proc).
	Netns netns.Policy
	// Enablement feeds the snapshot file; nil writes no snapshot.
	Enablement EnablementSource
	// ExcludedNamespaces are recorded in the snapshot (default kube-system).
	ExcludedNamespaces []string
	// DNSCapture is the default for pods without the dns-capture annotation.
	DNSCapture bool
	// ProbeSNATv4 and ProbeSNATv6 override the kubelet probe sources.
	ProbeSNATv4, ProbeSNATv6 netip.Addr
	// IPv4Only leaves pods' IPv6 alone (Istio's ambient.ipv6: false); see
	// ruleset.PodConfig.IPv4Only.
	IPv4Only bool
	// OnRuleError, when set, is told about every failed rule operation
	// ("apply", "verify", "remove"); OnDriftRepaired about every drifted
	// rule set re-applied at restore. Wire metrics here.
	OnRuleError     func(op string)
	OnDriftRepaired func()
	// OnAddAcked, when set, is told for each pod a CNI ADD captured how
	// long after the ADD reached the agent ztunnel acked the pod.
	OnAddAcked func(time.Duration)
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

// PodInfo identifies the pod of a CNI request.
type PodInfo struct {
	Namespace, Name string
	// UID may be empty when the runtime does not pass K8S_POD_UID.
	UID       types.UID
	SandboxID string
	IPs       []netip.Addr
	// Network is the CNI network of the request.
	Network string
}

// EnrolledPod is a copy of one entry of the agent's state.
type EnrolledPod struct {
	UID                             types.UID
	Namespace, Name, ServiceAccount string
	// SandboxID is empty for pods enrolled by the controller.
	SandboxID string
	// Network is the CNI network the sandbox was attached through (empty
	// for the controller's pods).
	Network string
	// Netns is where the namespace was found; NetnsID its inode.
	Netns   string
	NetnsID uint64
	IPs     []netip.Addr
	State   PodState
	Rules   ruleset.PodConfig
	Since   time.Time
	// Unresolved marks a pod restored from its annotation whose netns was
	// not found (RestoreUnresolved): Netns is empty, its rules were not
	// verified, and ztunnel is told to keep what it has (ZDS Keep) until
	// the pod is captured again or released.
	Unresolved bool
}

// Sandbox is what the runtime says about a pod's sandbox at CNI ADD: its
// id, which a later DEL names, and the IPs the primary CNI gave it (the
// pod's status does not show them yet).
type Sandbox struct {
	ID  string
	IPs []netip.Addr
	// Network is the CNI network (conflist name) of the ADD.
	Network string
}

type entry struct {
	EnrolledPod
	ns *netns.Handle
	// verifiedGen is the nf_tables generation of ns when Inspect last
	// found its rules exactly in place (0: not known): while it holds,
	// the next Inspect need not read them again (ruleset.GenVerifier).
	// Guarded by the pod's lock; a capture makes a new entry.
	verifiedGen uint32
	// snapshotAcked: a ztunnel acked the entry in its snapshot while its
	// capture was in flight (guarded by Agent.mu); the capture makes the
	// pod enabled once it holds it, whatever its own Add gets.
	snapshotAcked bool
}

// record is the capture record of the entry.
func (e *entry) record() Record {
	r := Record{
		UID: e.UID, Namespace: e.Namespace, Name: e.Name, SandboxID: e.SandboxID, Network: e.Network,
		Netns: e.Netns, IPs: e.IPs,
	}
	if e.ns != nil {
		r.NetnsDev, r.NetnsIno = e.ns.Identity().Dev, e.ns.Identity().Ino
	}
	return r
}

// Agent is the node agent's core: the one way pods get in (Capture, and
// Restore after a restart) and out (Unenroll, RemoveSandbox, GC). It owns
// the enrolled-pod state and the netns handles in it. Deciding whether a
// pod should be captured is its callers' job: the plugin event server and
// the pod controller decide with the pod cache, then call Capture.
type Agent struct {
	cfg         Config
	log         *slog.Logger
	snapshot    *snapshotWriter
	records     *recordStore
	annotations *annotationWriter

	// lifeTable holds every pod the agent knows by uid (see podLife);
	// its mu guards the lives and the fields below.
	lifeTable
	// invalidTransitions counts the state transitions transit refused.
	invalidTransitions uint64
	// probePruneDeferred: SyncHostProbe left the probe set unpruned
	// because an unresolved pod's IPs are unknown; the prune runs once
	// the last such pod is resolved or gone.
	probePruneDeferred bool

	// recaptureGap, in tests, runs in Recapture after it let go of the
	// pod's lock and before it captures.
	recaptureGap func(uid types.UID)
}

// NewAgent checks cfg and returns an agent with empty state.
func NewAgent(cfg Config) (*Agent, error) {
	if cfg.Rules == nil {
		return nil, errors.New("nodeagent: Rules is required")
	}
	if cfg.ZtunnelTimeout <= 0 {
		cfg.ZtunnelTimeout = DefaultZtunnelTimeout
	}
	if cfg.Layout.AgentSocket() == "" {
		return nil, errors.New("nodeagent: Layout is required")
	}
	if cfg.ExcludedNamespaces == nil {
		cfg.ExcludedNamespaces = []string{ambient.DefaultExcludedNamespace}
	}
	if cfg.AnnotationQPS <= 0 {
		cfg.AnnotationQPS = DefaultAnnotationQPS
	}
	if cfg.AnnotationBurst <= 0 {
		cfg.AnnotationBurst = DefaultAnnotationBurst
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	log := cfg.Logger.With("component", "nodeagent")
	a := &Agent{
		cfg:       cfg,
		log:       log,
		snapshot:  newSnapshotWriter(cfg.Layout.Snapshot(), cfg.Layout.ExplicitStateSnapshot()),
		lifeTable: lifeTable{lives: map[types.UID]*podLife{}},
	}
	a.records = newRecordStore(cfg.Layout.Records(), &a.lifeTable)
	a.annotations = newAnnotationWriter(cfg.Annotator, cfg.Pods, &a.lifeTable,
		rate.NewLimiter(rate.Limit(cfg.AnnotationQPS), cfg.AnnotationBurst), log.With("component", "annotations"))
	return a, nil
}

// LoadRecords reads the capture records a previous agent left (call it
// once at startup, before restoring). Unusable record files are removed
// and reported; the usable ones are loaded regardless.
func (a *Agent) LoadRecords() error {
	return a.records.load()
}

// ForgetHandedOver drops every capture record, touching no pod, and
// returns how many there were: the pods were handed over to istio-cni
// (a give-back, or a broken agent's node rolled back), whose agent
// adopted them by their annotation, so no later stop of ours may release
// them. Call it only on an agent that holds no pod (standing by).
func (a *Agent) ForgetHandedOver() (int, error) {
	return a.records.removeAll()
}

// Run writes the redirection annotations the agent's captures and
// removals want, until ctx ends.
func (a *Agent) Run(ctx context.Context) error {
	a.annotations.run(ctx)
	return nil
}

// FlushAnnotations waits until every wanted annotation is written (or
// dropped because its pod is gone), or ctx ends.
func (a *Agent) FlushAnnotations(ctx context.Context) error {
	return a.annotations.flush(ctx)
}

// HoldAnnotations defers the annotation writes that have not started
// until release is called, for at most a couple of seconds: the pod
// controller holds them while it captures a batch of running pods (a
// namespace label), so the captures get the node's CPU (and the API
// server's, where it shares the node) first. Captures and ztunnel
// handoffs never wait for it; release is idempotent.
func (a *Agent) HoldAnnotations() (release func()) {
	return a.annotations.hold()
}

// PendingAnnotations is how many pods wait for an annotation write.
func (a *Agent) PendingAnnotations() int {
	return a.annotations.pending()
}

// wantAnnotation hands the pod's wanted annotation value to the writer.
func (a *Agent) wantAnnotation(e *EnrolledPod, value PodState, then func()) {
	a.annotations.set(e.Namespace, e.Name, e.UID, string(value), then)
}

// workload is the pod as ZDS names it; an unresolved pod has no netns
// file, which makes a snapshot send Keep for it.
func (a *Agent) workload(e *entry) zds.Workload {
	w := zds.Workload{
		UID:  string(e.UID),
		Info: zds.WorkloadInfo{Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount},
	}
	if e.ns != nil {
		w.Netns = e.ns.File()
	}
	return w
}

// ruleConfig is the rule set options for one pod.
func (a *Agent) ruleConfig(pod *corev1.Pod) ruleset.PodConfig {
	return ruleset.PodConfig{
		ProbeSNATv4:       a.cfg.ProbeSNATv4,
		ProbeSNATv6:       a.cfg.ProbeSNATv6,
		IPv4Only:          a.cfg.IPv4Only,
		DNSCapture:        enablement.DNSCapture(pod, a.cfg.DNSCapture),
		BypassInbound:     enablement.BypassInbound(pod),
		VirtualInterfaces: enablement.VirtualInterfaces(pod),
	}
}
