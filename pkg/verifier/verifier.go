// Package verifier re-proves, on a period, that every pod the node agent
// captured is still captured: its in-pod rules are exactly the desired
// ones, ztunnel holds it (its in-pod listeners are up in the pod's
// network namespace, or ztunnel acknowledged it moments ago), the host
// probe set holds its IPs, and its redirection annotation says what the
// agent knows. What drifted is repaired through the agent's one capture
// path, told in a Warning Event on the pod and counted per kind. A pod
// that should be captured and is not (a missed ADD, a sandbox recreated
// while the plugin was unchained, a lost state) is found by the same loop
// and handed to the pod controller, which decides and captures it.
//
// Proofs are spread evenly over the period, one pod at a time, so the
// cost is flat; nothing is read from the API server (the pod cache is),
// and nothing is written unless something drifted.
package verifier

import (
	"cmp"
	"context"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
)

// DefaultPeriod is how often every captured pod is proven by default.
const DefaultPeriod = time.Minute

// MinGap is the least time between two proofs: on a node with more pods
// than a period holds at this pace, a round takes longer than the period
// rather than the verifier taking more CPU.
const MinGap = 20 * time.Millisecond

// DefaultSettle is how long a pod's annotation and a pod missing from the
// agent are given to settle (an annotation write queued, an ADD in
// flight) before either counts as drift.
const DefaultSettle = 10 * time.Second

// Kind is a kind of drift.
type Kind string

// Kinds of drift, the values of the drift counter's kind label.
const (
	// KindRules: the in-pod rules differ from the desired ones.
	KindRules Kind = "rules"
	// KindZtunnel: ztunnel's in-pod listeners are not up and ztunnel did
	// not just acknowledge the pod.
	KindZtunnel Kind = "ztunnel"
	// KindProbeSet: the host probe set lacks one of the pod's IPs.
	KindProbeSet Kind = "probe_set"
	// KindAnnotation: the redirection annotation differs from the
	// agent's state.
	KindAnnotation Kind = "annotation"
	// KindUncaptured: the pod should be captured and the agent does not
	// hold it.
	KindUncaptured Kind = "uncaptured"
	// KindSandbox: the namespace the agent holds the pod in has none of
	// the pod's IPs: its sandbox was recreated without the agent (the
	// plugin unchained), and the new one is not captured.
	KindSandbox Kind = "sandbox"
)

// Kinds lists every kind, for metrics that show them all at zero.
func Kinds() []Kind {
	return []Kind{KindRules, KindZtunnel, KindProbeSet, KindAnnotation, KindSandbox, KindUncaptured}
}

// ReasonDrift is the reason of the Warning Event on a pod found drifted.
const ReasonDrift = "AmbientCaptureDrift"

// ztunnelPorts are the ports ztunnel listens on inside every pod it
// serves (outbound, inbound plaintext, inbound HBONE) and, for a pod whose
// DNS is captured, its DNS proxy's: the pod's DNS goes there. ztunnel binds
// the DNS proxy's TCP and UDP sockets together (the pod's proxy does not
// start without both), so its TCP listener stands for the two.
func ztunnelPorts(dnsCapture bool) []uint16 {
	ports := []uint16{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort}
	if dnsCapture {
		ports = append(ports, ambient.ZtunnelDNSPort)
	}
	return ports
}

// repairPoll is the first wait between the proofs that follow a repair,
// doubling up to a second: what a repair restores asynchronously (the
// annotation, through the API server and the pod cache) usually shows
// within the first few.
const repairPoll = 50 * time.Millisecond

// Agent is the node agent as the verifier uses it (*nodeagent.Agent).
type Agent interface {
	Pods() []nodeagent.EnrolledPod
	Pod(uid types.UID) (nodeagent.EnrolledPod, bool)
	// Inspect verifies uid's rules now.
	Inspect(uid types.UID) (nodeagent.Inspection, bool)
	// InPod runs fn on the namespace uid is held in.
	InPod(uid types.UID, fn func(ns *os.File) error) error
	// Recapture captures an enrolled pod again in its held namespace.
	Recapture(ctx context.Context, pod *corev1.Pod, resetZtunnel bool) error
	// Capture captures a pod in ns (a recreated sandbox's), taking
	// ownership of ns.
	Capture(ctx context.Context, pod *corev1.Pod, ns *netns.Handle, sb *nodeagent.Sandbox) error
	EnrolledUID(namespace, name string) (types.UID, bool)
	// ReleasedSandbox reports when the runtime removed uid's captured
	// sandbox (CNI DEL) and the IPs it had, if no sandbox of it was
	// captured since.
	ReleasedSandbox(uid types.UID) (at time.Time, ips []netip.Addr, ok bool)
}

// Pods is the pod cache (pkg/podcache.Cache).
type Pods interface {
	Pods() ([]*corev1.Pod, error)
	Pod(namespace, name string) (*corev1.Pod, error)
	DecideCached(p *corev1.Pod) enablement.Decision
}

// Finder locates running pods' network namespaces (netns.Scanner).
type Finder interface {
	Find(pods map[types.UID][]netip.Addr) (map[types.UID]*netns.Handle, error)
}

// ProbeSet is the host probe set (the rules backend's host probe).
type ProbeSet interface {
	// Lacks returns those of ips the set lacks, without reading every
	// other pod's where it can: a proof's cost must not grow with the
	// node's pods.
	Lacks(ips []netip.Addr) ([]netip.Addr, error)
}

// EventRecorder records Events on pods (client-go's record.EventRecorder).
type EventRecorder interface {
	Eventf(object runtime.Object, eventtype, reason, messageFmt string, args ...any)
}

// Config configures a Verifier. Agent and Pods are required.
type Config struct {
	Agent Agent
	Pods  Pods
	// Probe, when set, is the host probe set the pods' IPs must be in.
	Probe ProbeSet
	// Ztunnels counts the ztunnels that acknowledged their snapshot; with
	// none, no pod can be proven held (nil: ztunnel is not checked).
	Ztunnels func() int
	// Look reads a pod's namespace: its addresses, and which of ports
	// have a TCP listener (default netns.AddrsAndTCPListening, which
	// enters the namespace once and looks the ports up one by one, so a
	// proof's cost does not grow with the node's listeners).
	Look func(ns *os.File, ports []uint16) ([]netip.Addr, map[uint16]bool, error)
	// Finder, when set, finds the namespace of a pod whose sandbox was
	// recreated without the agent, so it is captured there.
	Finder Finder
	// Requeue hands a pod that should be captured and is not to the pod
	// controller, which decides and captures it.
	Requeue func(types.NamespacedName)
	// Events, when set, gets a Warning on every pod found drifted.
	Events EventRecorder
	// Period is the time over which every captured pod is proven once
	// (default DefaultPeriod).
	Period time.Duration
	// Settle is the grace of a fresh capture's annotation, ztunnel
	// listeners, and of a pod not captured yet, and how long a repair is
	// given to show (default DefaultSettle, at most half the period); a
	// repair's own capture gets no grace.
	Settle time.Duration
	// OnDrift is told every drift found, by kind; OnUnproven the number
	// of pods not proven after every proof. Wire metrics here.
	OnDrift    func(Kind)
	OnUnproven func(int)
	Logger     *slog.Logger

	// now and sleep are the clock; tests replace them.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) bool
}

// Finding is one thing found wrong with a pod.
type Finding struct {
	Kind   Kind
	Detail string
}

// String is the finding as Events and explain show it: "kind: detail".
func (f Finding) String() string { return string(f.Kind) + ": " + f.Detail }

// Proof is the outcome of the last proof of one pod.
type Proof struct {
	At time.Time
	// OK: the pod was proven captured, after any repair.
	OK bool
	// Found is what the proof found wrong before repairing it.
	Found []Finding
	// Repaired: what was found was repaired and the pod proven again.
	Repaired bool
	// Problem says why the pod is not proven (a repair failed, a check
	// could not run, what is still wrong).
	Problem string
	// LastDriftAt and LastDrift are the latest proof of the pod that found
	// drift, kept across the clean proofs after it.
	LastDriftAt time.Time
	LastDrift   []Finding
}

// Verifier proves the captured pods. Create it with New, then Run it.
type Verifier struct {
	cfg Config
	log *slog.Logger

	mu     sync.Mutex
	proofs map[types.UID]Proof
	// missing are the pods found uncaptured, and since when.
	missing map[types.UID]*missingPod
	// caught are the pods found uncaptured that the agent now holds, until
	// their first proof, which shows that drift as its last.
	caught map[types.UID]missingPod
}

// New returns a verifier for cfg.
func New(cfg Config) *Verifier {
	if cfg.Period <= 0 {
		cfg.Period = DefaultPeriod
	}
	if cfg.Settle <= 0 {
		// At most half a period: a pod captured (or repaired) by one
		// proof is settled by its next, a period later.
		cfg.Settle = min(DefaultSettle, cfg.Period/2)
	}
	if cfg.Look == nil {
		cfg.Look = netns.AddrsAndTCPListening
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	if cfg.sleep == nil {
		cfg.sleep = sleepCtx
	}
	return &Verifier{cfg: cfg, log: cfg.Logger.With("component", "verifier"),
		proofs: map[types.UID]Proof{}, missing: map[types.UID]*missingPod{}, caught: map[types.UID]missingPod{}}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Run proves pods round after round until ctx ends.
func (v *Verifier) Run(ctx context.Context) error {
	for ctx.Err() == nil {
		v.round(ctx)
	}
	return nil
}

// Gap is the wait between two proofs when n pods share period: the period
// spread evenly, never below MinGap.
func Gap(n int, period time.Duration) time.Duration {
	if n <= 0 {
		return period
	}
	return max(period/time.Duration(n), MinGap)
}

// round looks for uncaptured pods, then proves every captured pod once,
// spread evenly over the period.
func (v *Verifier) round(ctx context.Context) {
	v.findUncaptured(ctx)
	pods := v.cfg.Agent.Pods()
	slices.SortFunc(pods, func(a, b nodeagent.EnrolledPod) int { return cmp.Compare(a.UID, b.UID) })
	v.forget(pods)
	gap := Gap(len(pods), v.cfg.Period)
	if len(pods) == 0 {
		v.cfg.sleep(ctx, gap)
		return
	}
	// Each pod has its slot in the round: the time a proof takes comes
	// out of the wait before the next, so a round lasts the period.
	start := v.cfg.now()
	for i, p := range pods {
		wait := start.Add(time.Duration(i+1) * gap).Sub(v.cfg.now())
		if !v.cfg.sleep(ctx, max(wait, MinGap)) {
			return
		}
		v.prove(ctx, p.UID)
	}
}

// forget drops the proofs of pods no longer enrolled.
func (v *Verifier) forget(enrolled []nodeagent.EnrolledPod) {
	keep := make(map[types.UID]bool, len(enrolled))
	for _, p := range enrolled {
		keep[p.UID] = true
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for uid := range v.proofs {
		if !keep[uid] {
			delete(v.proofs, uid)
		}
	}
	for uid := range v.caught {
		if !keep[uid] {
			delete(v.caught, uid)
		}
	}
	v.report()
}

// report tells OnUnproven how many pods are not proven. Called with v.mu
// held.
func (v *Verifier) report() {
	if v.cfg.OnUnproven != nil {
		v.cfg.OnUnproven(v.unprovenLocked())
	}
}

func (v *Verifier) unprovenLocked() int {
	n := 0
	for _, p := range v.proofs {
		if !p.OK {
			n++
		}
	}
	now := v.cfg.now()
	for _, m := range v.missing {
		if now.Sub(m.since) >= v.cfg.Settle {
			n++
		}
	}
	return n
}

// Unproven is how many pods are not proven captured now: those whose last
// proof failed, and those found uncaptured; 0 on a healthy node.
func (v *Verifier) Unproven() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.unprovenLocked()
}

// Last is uid's last proof; false before the first.
func (v *Verifier) Last(uid types.UID) (Proof, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	p, ok := v.proofs[uid]
	return p, ok
}
