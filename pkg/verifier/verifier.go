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
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
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

// missingPod is a pod found uncaptured: since when, and whether it was
// reported (once per time it goes missing), when and how.
type missingPod struct {
	since   time.Time
	told    bool
	toldAt  time.Time
	finding Finding
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

// findUncaptured hands the controller every pod that should be captured,
// has its network up (IPs), and was not held by the agent for Settle.
func (v *Verifier) findUncaptured(ctx context.Context) {
	all, err := v.cfg.Pods.Pods()
	if err != nil {
		v.log.Warn("list pods", "err", err)
		return
	}
	now := v.cfg.now()
	seen := map[types.UID]bool{}
	for _, p := range all {
		if ctx.Err() != nil {
			return
		}
		if !v.uncaptured(p) {
			continue
		}
		seen[p.UID] = true
		v.mu.Lock()
		m, known := v.missing[p.UID]
		if !known {
			m = &missingPod{since: now}
			v.missing[p.UID] = m
		}
		ripe := known && now.Sub(m.since) >= v.cfg.Settle
		tell := ripe && !m.told
		if tell {
			m.told = true
		}
		v.mu.Unlock()
		if !ripe {
			continue
		}
		if tell {
			d := v.cfg.Pods.DecideCached(p)
			f := Finding{Kind: KindUncaptured, Detail: fmt.Sprintf("the pod should be captured (%s) but the agent does not hold it; capturing it", d.Reason)}
			// Kept for the pod's first proof once captured.
			v.mu.Lock()
			m.toldAt, m.finding = now, f
			v.mu.Unlock()
			v.found(p, []Finding{f})
		}
		// Every round while it stays uncaptured: the controller's own
		// retries may have given up on it.
		if v.cfg.Requeue != nil {
			v.cfg.Requeue(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	}
	v.mu.Lock()
	for uid, m := range v.missing {
		if !seen[uid] {
			// Captured since (or gone: forget drops it then).
			if m.told {
				v.caught[uid] = *m
			}
			delete(v.missing, uid)
		}
	}
	v.report()
	v.mu.Unlock()
}

// uncaptured reports whether p should be captured (the pod cache's
// decision, which alone says what must be captured), has its network, is
// not going, and the agent does not hold it.
func (v *Verifier) uncaptured(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || len(enablement.PodIPs(p)) == 0 {
		return false
	}
	if uid, ok := v.cfg.Agent.EnrolledUID(p.Namespace, p.Name); ok && uid == p.UID {
		return false
	}
	if v.awaitingSandbox(p) {
		return false
	}
	return v.cfg.Pods.DecideCached(p).Enroll
}

// awaitingSandbox reports whether the runtime removed p's captured sandbox
// (CNI DEL) less than a period ago and p still shows that sandbox's IPs:
// its next sandbox's ADD brings it back, and meanwhile there is nothing to
// capture. A pod showing other IPs runs a sandbox no ADD brought to the
// agent (one started while our plugin was not in the runtime's config),
// and one still showing the old IPs a period on may run a new sandbox
// that got them again: both are captured as any other.
func (v *Verifier) awaitingSandbox(p *corev1.Pod) bool {
	at, ips, ok := v.cfg.Agent.ReleasedSandbox(p.UID)
	if !ok || v.cfg.now().Sub(at) >= v.cfg.Period {
		return false
	}
	for _, a := range enablement.PodIPs(p) {
		if len(ips) > 0 && !slices.Contains(ips, a) {
			return false
		}
	}
	return true
}

// prove checks one enrolled pod, repairs what drifted and proves it again.
func (v *Verifier) prove(ctx context.Context, uid types.UID) {
	e, pod, ok := v.subject(uid)
	if !ok {
		if e.Unresolved {
			// Its rules and ztunnel's hold cannot be read without its
			// namespace; the controller keeps looking for it.
			v.record(uid, Proof{At: v.cfg.now(), Problem: "restored without its network namespace after a restart: not found since"})
		}
		return
	}
	// The proof's time is when its checks began: a change made after it
	// is the next proof's to find.
	proof := Proof{At: v.cfg.now()}
	v.mu.Lock()
	if prev, ok := v.proofs[uid]; ok {
		proof.LastDriftAt, proof.LastDrift = prev.LastDriftAt, prev.LastDrift
	} else if m, ok := v.caught[uid]; ok {
		proof.LastDriftAt, proof.LastDrift = m.toldAt, []Finding{m.finding}
	}
	delete(v.caught, uid)
	v.mu.Unlock()
	found, problem := v.check(e, pod, false)
	proof.Found = found
	if len(found) > 0 {
		proof.LastDriftAt, proof.LastDrift = proof.At, found
	}
	switch {
	case len(found) > 0:
		v.found(pod, found)
		if err := v.repair(ctx, pod, found); err != nil {
			proof.Problem = fmt.Sprintf("repair failed: %v", err)
			v.log.Warn("repair drifted pod", "pod", pod.Namespace+"/"+pod.Name, "err", err)
			break
		}
		// Proven again from scratch, in full: a repair that did not hold
		// shows, and keeps the pod unproven.
		again, p2, ok := v.recheck(ctx, uid)
		if !ok {
			return
		}
		proof.Repaired = len(again) == 0 && p2 == ""
		proof.OK = proof.Repaired
		proof.Problem = joinProblems(again, p2)
	case problem != "":
		proof.Problem = problem
	default:
		proof.OK = true
	}
	v.record(uid, proof)
}

// recheck proves uid in full after a repair, again and again until it
// holds or Settle has passed: what the repair restores asynchronously (the
// annotation) is waited for, and nothing is passed on a fresh capture's
// grace (ztunnel acks an Add once the pod's listeners are bound, so
// listeners missing after the ack are missing). Either way the capture the
// repair made is past its grace by the pod's next proof, which is a full
// one too. False when the pod is no longer to be proven.
func (v *Verifier) recheck(ctx context.Context, uid types.UID) (found []Finding, problem string, ok bool) {
	deadline := v.cfg.now().Add(v.cfg.Settle)
	wait := repairPoll
	for {
		e, pod, ok := v.subject(uid)
		if !ok {
			return nil, "", false
		}
		found, problem = v.check(e, pod, true)
		left := deadline.Sub(v.cfg.now())
		if (len(found) == 0 && problem == "") || left <= 0 || !v.cfg.sleep(ctx, min(wait, left)) {
			return found, problem, true
		}
		wait = min(2*wait, time.Second)
	}
}

// record keeps uid's proof, keeping the last drift an earlier one found.
func (v *Verifier) record(uid types.UID, proof Proof) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if prev, ok := v.proofs[uid]; ok && proof.LastDriftAt.IsZero() {
		proof.LastDriftAt, proof.LastDrift = prev.LastDriftAt, prev.LastDrift
	}
	v.proofs[uid] = proof
	delete(v.missing, uid)
	v.report()
}

func joinProblems(found []Finding, problem string) string {
	var s []string
	for _, f := range found {
		s = append(s, f.String())
	}
	if problem != "" {
		s = append(s, problem)
	}
	return strings.Join(s, "; ")
}

// subject is uid's entry and its pod object, or false when it is not to
// be proven: gone, going, or no longer to be captured (the controller
// releases it), or restored without its namespace.
func (v *Verifier) subject(uid types.UID) (nodeagent.EnrolledPod, *corev1.Pod, bool) {
	e, found := v.cfg.Agent.Pod(uid)
	if !found || e.Unresolved {
		return e, nil, false
	}
	pod, err := v.cfg.Pods.Pod(e.Namespace, e.Name)
	if err != nil || pod.UID != uid || pod.DeletionTimestamp != nil {
		return e, nil, false
	}
	if !v.cfg.Pods.DecideCached(pod).Enroll {
		return e, nil, false
	}
	return e, pod, true
}

// repair puts right what check found: a recreated sandbox is captured in
// its new namespace; anything else by capturing the pod again in the one
// the agent holds (ztunnel told to drop it first when its listeners are
// gone).
func (v *Verifier) repair(ctx context.Context, pod *corev1.Pod, found []Finding) error {
	has := func(k Kind) bool { return slices.ContainsFunc(found, func(f Finding) bool { return f.Kind == k }) }
	if !has(KindSandbox) {
		return v.cfg.Agent.Recapture(ctx, pod, has(KindZtunnel))
	}
	if v.cfg.Finder == nil {
		return errors.New("no way to find the pod's new network namespace")
	}
	handles, err := v.cfg.Finder.Find(map[types.UID][]netip.Addr{pod.UID: enablement.PodIPs(pod)})
	ns, ok := handles[pod.UID]
	delete(handles, pod.UID)
	for _, h := range handles {
		_ = h.Close()
	}
	if !ok {
		return fmt.Errorf("the pod's new network namespace was not found (%v)", err)
	}
	return v.cfg.Agent.Capture(ctx, pod, ns, nil)
}

// check proves one pod: what drifted, and problem when something could
// not be proven but is not drift to repair (no ztunnel connected, a read
// that failed). full gives a fresh capture no grace.
func (v *Verifier) check(e nodeagent.EnrolledPod, pod *corev1.Pod, full bool) (found []Finding, problem string) {
	var problems []string
	settled := full || v.cfg.now().Sub(e.Since) >= v.cfg.Settle
	// One look into the pod's namespace serves the sandbox and ztunnel
	// checks: every entry into a namespace costs system time, and a node
	// proves several pods a second.
	seen := v.look(e)
	if f := v.checkSandbox(e, pod, seen); f != nil {
		// Whatever else holds in the old namespace serves nobody.
		return []Finding{*f}, ""
	}
	in, ok := v.cfg.Agent.Inspect(e.UID)
	switch {
	case !ok:
		return nil, "not enrolled any more"
	case in.VerifyError != "":
		problems = append(problems, "rules could not be read: "+in.VerifyError)
	case len(in.Drift) > 0:
		found = append(found, Finding{KindRules, strings.Join(in.Drift, "; ")})
	}

	if v.cfg.Ztunnels != nil {
		if v.cfg.Ztunnels() == 0 {
			problems = append(problems, "no ztunnel is connected")
		} else if f, p := v.checkZtunnel(in.EnrolledPod, settled, seen); f != nil {
			found = append(found, *f)
		} else if p != "" {
			problems = append(problems, p)
		}
	}

	if v.cfg.Probe != nil && len(in.IPs) > 0 {
		lacks, err := v.cfg.Probe.Lacks(in.IPs)
		if err != nil {
			problems = append(problems, "host probe set could not be read: "+err.Error())
		} else if len(lacks) > 0 {
			var lost []string
			for _, ip := range lacks {
				lost = append(lost, ip.String())
			}
			found = append(found, Finding{KindProbeSet, "the host probe set lacks " + strings.Join(lost, ", ")})
		}
	}

	if got := pod.Annotations[ambient.RedirectionAnnotation]; got != string(in.State) && settled {
		found = append(found, Finding{KindAnnotation, fmt.Sprintf("annotation %s is %q, the agent's state is %q", ambient.RedirectionAnnotation, got, in.State)})
	}
	return found, strings.Join(problems, "; ")
}

// podView is what one look into a pod's namespace saw.
type podView struct {
	addrs     []netip.Addr
	listening map[uint16]bool
	err       error
}

// look reads the namespace the agent holds e in: its addresses and
// ztunnel's listeners.
func (v *Verifier) look(e nodeagent.EnrolledPod) podView {
	var pv podView
	pv.err = v.cfg.Agent.InPod(e.UID, func(ns *os.File) error {
		var err error
		pv.addrs, pv.listening, err = v.cfg.Look(ns, ztunnelPorts(e.Rules.DNSCapture))
		return err
	})
	return pv
}

// checkSandbox proves the namespace the agent holds is still the pod's:
// it has one of the IPs the pod's status shows, or one of those the agent
// captured it with. The status lags the runtime: after an ordinary
// sandbox recreation the new sandbox's ADD moves the agent to its
// namespace seconds before kubelet's status update reaches the cache, and
// an API-server outage keeps that update away for as long as it lasts. A
// namespace that still has the addresses it was captured with is the
// sandbox the runtime runs; one recreated without the agent leaves the
// held namespace without them (the primary network's DEL took its
// interface).
func (v *Verifier) checkSandbox(e nodeagent.EnrolledPod, pod *corev1.Pod, seen podView) *Finding {
	want := enablement.PodIPs(pod)
	if len(want) == 0 || seen.err != nil {
		return nil
	}
	holds := func(a netip.Addr) bool { return slices.Contains(seen.addrs, a) }
	if slices.ContainsFunc(want, holds) || slices.ContainsFunc(e.IPs, holds) {
		return nil
	}
	return &Finding{KindSandbox, fmt.Sprintf("the network namespace the agent holds the pod in (%s) has none of its IPs %v: its sandbox was recreated without the agent; capturing the new one", e.Netns, want)}
}

// checkZtunnel proves ztunnel holds the pod: its in-pod listeners are up.
// Without them, a pod ztunnel acknowledged within Settle passes on the
// acknowledgement (ztunnel may still be binding); a pod it never
// acknowledged is handed to it again.
func (v *Verifier) checkZtunnel(e nodeagent.EnrolledPod, settled bool, seen podView) (*Finding, string) {
	ports, err := seen.listening, seen.err
	if errors.Is(err, nodeagent.ErrNotHeld) {
		return nil, ""
	}
	if err != nil {
		return nil, "ztunnel's listeners could not be read: " + err.Error()
	}
	var down []string
	for _, p := range ztunnelPorts(e.Rules.DNSCapture) {
		if !ports[p] {
			down = append(down, fmt.Sprint(p))
		}
	}
	if len(down) == 0 {
		return nil, ""
	}
	if e.State == nodeagent.StatePending {
		return &Finding{KindZtunnel, "ztunnel has not acknowledged the pod; handing it over again"}, ""
	}
	if !settled {
		return nil, ""
	}
	return &Finding{KindZtunnel, "ztunnel is not listening on " + strings.Join(down, ", ") + " in the pod"}, ""
}

// found logs, counts and reports drift on pod.
func (v *Verifier) found(pod *corev1.Pod, found []Finding) {
	msg := joinProblems(found, "")
	v.log.Warn("capture drifted; repairing", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "found", msg)
	for _, f := range found {
		if v.cfg.OnDrift != nil {
			v.cfg.OnDrift(f.Kind)
		}
	}
	if v.cfg.Events != nil {
		v.cfg.Events.Eventf(pod, corev1.EventTypeWarning, ReasonDrift, "verifier found %s; repairing", msg)
	}
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
