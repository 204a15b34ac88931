package verifier

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
)

// fakeNode is the agent, pod cache, probe set and ztunnel of one node, in
// memory: what the verifier reads, and what a repair puts right.
type fakeNode struct {
	mu        sync.Mutex
	enrolled  map[types.UID]*nodeagent.EnrolledPod
	pods      map[types.UID]*corev1.Pod
	drift     map[types.UID][]string
	listening map[types.UID]map[uint16]bool
	probe     map[netip.Addr]bool
	ztunnels  int
	released  map[types.UID]released
	// recaptures are the repairs asked for, and whether each reset ztunnel.
	recaptures []string
	requeued   []types.NamespacedName
	failRepair error
	// deaf are the pods whose ztunnel listeners a repair does not bring
	// back (ztunnel acks the Add and never listens).
	deaf map[types.UID]bool
	// annotationLag is how long the annotation a repair writes takes to
	// reach the pod cache (the agent writes it asynchronously); negative:
	// it never does (the write fails). written holds the pending writes.
	annotationLag time.Duration
	written       map[types.UID]time.Time
	// clock is the node's time (the harness's).
	clock func() time.Time
	// current is the pod whose namespace InPod entered last.
	current types.UID
	// moved are the pods whose sandbox was recreated: the held namespace
	// has none of their IPs; found is what the finder finds.
	moved    map[types.UID]bool
	found    map[types.UID]bool
	captures []string
}

func newFakeNode() *fakeNode {
	return &fakeNode{
		enrolled: map[types.UID]*nodeagent.EnrolledPod{}, pods: map[types.UID]*corev1.Pod{},
		drift: map[types.UID][]string{}, listening: map[types.UID]map[uint16]bool{},
		probe: map[netip.Addr]bool{}, ztunnels: 1, released: map[types.UID]released{},
		moved: map[types.UID]bool{}, found: map[types.UID]bool{},
		deaf: map[types.UID]bool{}, written: map[types.UID]time.Time{}, clock: time.Now,
	}
}

// allPorts are ztunnel's listeners in a pod whose DNS is captured.
func allPorts() map[uint16]bool {
	m := map[uint16]bool{}
	for _, p := range ztunnelPorts(true) {
		m[p] = true
	}
	return m
}

// pod adds a pod that should be captured, with IP 10.0.0.<n>; captured
// makes the agent hold it, healthy, since long ago, its DNS captured (the
// default).
func (f *fakeNode) pod(n int, captured bool) *corev1.Pod {
	f.mu.Lock()
	defer f.mu.Unlock()
	uid := types.UID(fmt.Sprintf("uid-%03d", n))
	ip := netip.AddrFrom4([4]byte{10, 0, 0, byte(n)})
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: fmt.Sprintf("pod-%d", n), UID: uid, Labels: map[string]string{"mesh": "yes"}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIPs: []corev1.PodIP{{IP: ip.String()}}},
	}
	if captured {
		p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
		f.enrolled[uid] = &nodeagent.EnrolledPod{UID: uid, Namespace: "ns", Name: p.Name, IPs: []netip.Addr{ip},
			State: nodeagent.StateEnabled, Since: time.Unix(0, 0)}
		f.enrolled[uid].Rules.DNSCapture = true
		f.listening[uid] = allPorts()
		f.probe[ip] = true
	}
	f.pods[uid] = p
	return p
}

func (f *fakeNode) Pods() []nodeagent.EnrolledPod {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []nodeagent.EnrolledPod
	for _, e := range f.enrolled {
		out = append(out, *e)
	}
	return out
}

func (f *fakeNode) Pod(uid types.UID) (nodeagent.EnrolledPod, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	e := f.enrolled[uid]
	if e == nil {
		return nodeagent.EnrolledPod{}, false
	}
	return *e, true
}

func (f *fakeNode) Inspect(uid types.UID) (nodeagent.Inspection, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	e := f.enrolled[uid]
	if e == nil {
		return nodeagent.Inspection{}, false
	}
	return nodeagent.Inspection{EnrolledPod: *e, Drift: slices.Clone(f.drift[uid])}, true
}

func (f *fakeNode) InPod(uid types.UID, fn func(*os.File) error) error {
	f.mu.Lock()
	_, ok := f.enrolled[uid]
	f.mu.Unlock()
	if !ok {
		return nodeagent.ErrNotHeld
	}
	// The fake Listening ignores the file and reads f.listening[current].
	f.mu.Lock()
	f.current = uid
	f.mu.Unlock()
	return fn(nil)
}

func (f *fakeNode) Recapture(_ context.Context, pod *corev1.Pod, reset bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.recaptures = append(f.recaptures, fmt.Sprintf("%s reset=%v", pod.Name, reset))
	if f.failRepair != nil {
		return f.failRepair
	}
	e := f.enrolled[pod.UID]
	delete(f.drift, pod.UID)
	if !f.deaf[pod.UID] {
		f.listening[pod.UID] = allPorts()
	}
	for _, ip := range e.IPs {
		f.probe[ip] = true
	}
	e.State = nodeagent.StateEnabled
	e.Since = f.clock()
	if f.annotationLag >= 0 {
		f.written[pod.UID] = f.clock().Add(f.annotationLag)
	}
	return nil
}

func (f *fakeNode) Capture(_ context.Context, pod *corev1.Pod, ns *netns.Handle, _ *nodeagent.Sandbox) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.captures = append(f.captures, pod.Name)
	delete(f.moved, pod.UID)
	return nil
}

func (f *fakeNode) Find(pods map[types.UID][]netip.Addr) (map[types.UID]*netns.Handle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[types.UID]*netns.Handle{}
	for uid := range pods {
		if f.found[uid] {
			out[uid] = nil // the fake Capture never looks at it
		}
	}
	return out, nil
}

func (f *fakeNode) EnrolledUID(namespace, name string) (types.UID, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range f.enrolled {
		if e.Namespace == namespace && e.Name == name {
			return e.UID, true
		}
	}
	return "", false
}

// released is a sandbox the runtime removed: when, and its IPs.
type released struct {
	at  time.Time
	ips []netip.Addr
}

func (f *fakeNode) ReleasedSandbox(uid types.UID) (time.Time, []netip.Addr, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.released[uid]
	return r.at, r.ips, ok
}

type fakeCache struct{ *fakeNode }

func (c fakeCache) Pods() ([]*corev1.Pod, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*corev1.Pod
	for _, p := range c.pods {
		out = append(out, p)
	}
	return out, nil
}

func (c fakeCache) Pod(namespace, name string) (*corev1.Pod, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.pods {
		if at, ok := c.written[p.UID]; ok && !c.clock().Before(at) {
			// A repair's annotation write reached the cache.
			if p.Annotations == nil {
				p.Annotations = map[string]string{}
			}
			p.Annotations[ambient.RedirectionAnnotation] = ambient.RedirectionEnabled
			delete(c.written, p.UID)
		}
		if p.Namespace == namespace && p.Name == name {
			return p, nil
		}
	}
	return nil, errors.New("not found")
}

// meshPolicy enables the pods labelled mesh=yes: the verifier's tests
// decide with the real policy, so its exclusions (hostNetwork, finished
// pods) hold here as on a node.
var meshPolicy = func() enablement.Policy {
	s, err := enablement.ParseSelectors([]byte(`[{podSelector: {matchLabels: {mesh: "yes"}}}]`))
	if err != nil {
		panic(err)
	}
	return enablement.Policy{Selectors: s}
}()

func (c fakeCache) DecideCached(p *corev1.Pod) enablement.Decision {
	return meshPolicy.Decide(p, nil)
}

func (f *fakeNode) Lacks(ips []netip.Addr) ([]netip.Addr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []netip.Addr
	for _, ip := range ips {
		if !f.probe[ip] {
			out = append(out, ip)
		}
	}
	return out, nil
}

type recorder struct {
	mu     sync.Mutex
	events []string
}

func (r *recorder) Eventf(o runtime.Object, typ, reason, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := o.(*corev1.Pod)
	r.events = append(r.events, p.Name+" "+typ+" "+reason+" "+fmt.Sprintf(format, args...))
}

// harness is a verifier over a fake node, with a clock the test moves:
// sleeps advance it and are recorded.
type harness struct {
	*fakeNode
	v        *Verifier
	ev       *recorder
	now      time.Time
	sleeps   []time.Duration
	drifts   map[Kind]int
	unproven int
	// reported is every value OnUnproven was told, in order.
	reported []int
}

func newHarness(t *testing.T, period time.Duration) *harness {
	t.Helper()
	h := &harness{fakeNode: newFakeNode(), ev: &recorder{}, now: time.Unix(1000, 0), drifts: map[Kind]int{}}
	h.clock = func() time.Time { return h.now }
	h.v = New(Config{
		Agent: h.fakeNode, Pods: fakeCache{h.fakeNode}, Probe: h.fakeNode,
		Ztunnels: func() int { h.mu.Lock(); defer h.mu.Unlock(); return h.ztunnels },
		Look: func(_ *os.File, ports []uint16) ([]netip.Addr, map[uint16]bool, error) {
			h.mu.Lock()
			defer h.mu.Unlock()
			listening := map[uint16]bool{}
			for _, p := range ports {
				listening[p] = h.listening[h.current][p]
			}
			if h.moved[h.current] {
				return nil, listening, nil
			}
			return h.enrolled[h.current].IPs, listening, nil
		},
		Finder:     h.fakeNode,
		Requeue:    func(k types.NamespacedName) { h.requeued = append(h.requeued, k) },
		Events:     h.ev,
		Period:     period,
		OnDrift:    func(k Kind) { h.drifts[k]++ },
		OnUnproven: func(n int) { h.unproven = n; h.reported = append(h.reported, n) },
		now:        func() time.Time { return h.now },
		sleep: func(ctx context.Context, d time.Duration) bool {
			h.sleeps = append(h.sleeps, d)
			h.now = h.now.Add(d)
			return ctx.Err() == nil
		},
	})
	return h
}

func TestGap(t *testing.T) {
	for _, c := range []struct {
		n      int
		period time.Duration
		want   time.Duration
	}{
		{0, time.Minute, time.Minute},
		{1, time.Minute, time.Minute},
		{110, time.Minute, time.Minute / 110},
		{60, time.Minute, time.Second},
		{100000, time.Minute, MinGap}, // bounded: the round outlasts the period
	} {
		if got := Gap(c.n, c.period); got != c.want {
			t.Errorf("Gap(%d, %v) = %v, want %v", c.n, c.period, got, c.want)
		}
	}
}

// A round proves every captured pod once, one per gap, the gaps filling
// the period; a healthy node costs no repair, no Event, no drift.
func TestRoundSpreadsProofsEvenly(t *testing.T) {
	h := newHarness(t, time.Minute)
	for i := 1; i <= 4; i++ {
		h.pod(i, true)
	}
	h.v.round(context.Background())
	if want := []time.Duration{15 * time.Second, 15 * time.Second, 15 * time.Second, 15 * time.Second}; !slices.Equal(h.sleeps, want) {
		t.Fatalf("sleeps %v, want %v", h.sleeps, want)
	}
	for i := 1; i <= 4; i++ {
		uid := types.UID(fmt.Sprintf("uid-%03d", i))
		p, ok := h.v.Last(uid)
		if !ok || !p.OK || len(p.Found) > 0 {
			t.Errorf("%s: proof %+v (ok %v), want proven", uid, p, ok)
		}
		if want := time.Unix(1000, 0).Add(time.Duration(i) * 15 * time.Second); !p.At.Equal(want) {
			t.Errorf("%s proven at %v, want %v (its slot)", uid, p.At, want)
		}
	}
	if len(h.recaptures) > 0 || len(h.ev.events) > 0 || len(h.drifts) > 0 || h.unproven != 0 {
		t.Fatalf("healthy node: recaptures %v, events %v, drifts %v, unproven %d", h.recaptures, h.ev.events, h.drifts, h.unproven)
	}
}

// An empty node waits a period between looks.
func TestRoundWithoutPodsWaitsAPeriod(t *testing.T) {
	h := newHarness(t, time.Minute)
	h.v.round(context.Background())
	if !slices.Equal(h.sleeps, []time.Duration{time.Minute}) {
		t.Fatalf("sleeps %v", h.sleeps)
	}
}

// Each kind of drift is found, counted, told in an Event, repaired
// through one Recapture (ztunnel reset only for ztunnel's drift) and the
// pod proven again.
func TestDriftIsFoundRepairedAndReported(t *testing.T) {
	for _, c := range []struct {
		kind   Kind
		tamper func(h *harness, p *corev1.Pod)
		reset  bool
	}{
		{KindRules, func(h *harness, p *corev1.Pod) { h.drift[p.UID] = []string{"missing rule x"} }, false},
		{KindZtunnel, func(h *harness, p *corev1.Pod) { h.listening[p.UID] = map[uint16]bool{15008: true} }, true},
		{KindProbeSet, func(h *harness, p *corev1.Pod) { delete(h.probe, netip.MustParseAddr("10.0.0.1")) }, false},
		{KindAnnotation, func(h *harness, p *corev1.Pod) { p.Annotations[ambient.RedirectionAnnotation] = "disabled" }, false},
	} {
		t.Run(string(c.kind), func(t *testing.T) {
			h := newHarness(t, time.Minute)
			p := h.pod(1, true)
			h.pod(2, true)
			c.tamper(h, p)
			h.v.round(context.Background())
			if h.drifts[c.kind] != 1 || len(h.drifts) != 1 {
				t.Errorf("drifts %v, want one %s", h.drifts, c.kind)
			}
			if want := []string{fmt.Sprintf("pod-1 reset=%v", c.reset)}; !slices.Equal(h.recaptures, want) {
				t.Errorf("recaptures %v, want %v", h.recaptures, want)
			}
			if len(h.ev.events) != 1 || !strings.Contains(h.ev.events[0], "pod-1 Warning "+ReasonDrift+" verifier found "+string(c.kind)+":") {
				t.Errorf("events %q", h.ev.events)
			}
			proof, _ := h.v.Last(p.UID)
			if !proof.OK || !proof.Repaired || len(proof.Found) != 1 || proof.Found[0].Kind != c.kind {
				t.Errorf("proof %+v", proof)
			}
			if h.unproven != 0 {
				t.Errorf("unproven %d after repair", h.unproven)
			}
		})
	}
}

// A repair that fails leaves the pod unproven (the gauge says so) until
// a later round repairs it.
func TestFailedRepairStaysUnproven(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.drift[p.UID] = []string{"flushed"}
	h.failRepair = errors.New("xtables lock")
	h.v.round(context.Background())
	if proof, _ := h.v.Last(p.UID); proof.OK || !strings.Contains(proof.Problem, "xtables lock") || h.unproven != 1 || h.v.Unproven() != 1 {
		t.Fatalf("proof %+v, unproven %d", proof, h.unproven)
	}
	h.failRepair = nil
	h.v.round(context.Background())
	if proof, _ := h.v.Last(p.UID); !proof.OK || h.unproven != 0 {
		t.Fatalf("second round: proof %+v, unproven %d", proof, h.unproven)
	}
}

// A repair that does not hold (ztunnel acks the pod again and never
// listens in it: rules redirect into ports nobody listens on) keeps the
// pod unproven, proof after proof, without a moment at 0 for the critical
// alert's "for" to restart on; the fresh capture the repair made earns no
// grace, whatever Settle is. Once a repair holds, the pod is proven again.
func TestRepairThatDoesNotHoldStaysUnproven(t *testing.T) {
	for _, c := range []struct {
		name   string
		settle time.Duration
	}{
		{"default settle", 0},
		{"settle longer than the period", 2 * time.Minute},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, time.Minute)
			if c.settle > 0 {
				h.v.cfg.Settle = c.settle
			}
			p := h.pod(1, true)
			h.pod(2, true)
			h.deaf[p.UID] = true
			h.listening[p.UID] = nil
			for round := 1; round <= 3; round++ {
				h.v.round(context.Background())
				proof, _ := h.v.Last(p.UID)
				if proof.OK || proof.Repaired || !strings.Contains(proof.Problem, "ztunnel: ztunnel is not listening on 15001, 15006, 15008, 15053") {
					t.Fatalf("round %d: proof %+v, want unproven: ztunnel not listening", round, proof)
				}
				if h.drifts[KindZtunnel] != round || h.unproven != 1 || h.v.Unproven() != 1 {
					t.Fatalf("round %d: drifts %v, unproven %d (%d), want %d ztunnel drifts, 1 unproven", round, h.drifts, h.unproven, h.v.Unproven(), round)
				}
			}
			// From the first failed repair on, the gauge never said 0.
			first := slices.Index(h.reported, 1)
			if first < 0 || slices.Contains(h.reported[first:], 0) {
				t.Fatalf("unproven gauge went %v: back at 0 while the pod was unproven", h.reported)
			}
			if want := slices.Repeat([]string{"pod-1 reset=true"}, 3); !slices.Equal(h.recaptures, want) {
				t.Fatalf("recaptures %v, want %v", h.recaptures, want)
			}
			// ztunnel listens again after the next repair.
			delete(h.deaf, p.UID)
			h.v.round(context.Background())
			if proof, _ := h.v.Last(p.UID); !proof.OK || !proof.Repaired || h.unproven != 0 {
				t.Fatalf("repair that holds: proof %+v, unproven %d", proof, h.unproven)
			}
		})
	}
}

// The annotation a repair writes reaches the pod cache a moment later:
// the proof after the repair waits for it (within Settle) rather than
// pass it on a fresh capture's grace; an annotation that never comes
// (its write failing) keeps the pod unproven.
func TestRepairWaitsForItsAnnotation(t *testing.T) {
	for _, c := range []struct {
		name  string
		lag   time.Duration
		holds bool
	}{
		{"written a moment later", 300 * time.Millisecond, true},
		{"never written", -1, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, time.Minute)
			p := h.pod(1, true)
			p.Annotations[ambient.RedirectionAnnotation] = "disabled"
			h.annotationLag = c.lag
			h.v.round(context.Background())
			proof, _ := h.v.Last(p.UID)
			if h.drifts[KindAnnotation] != 1 || len(h.drifts) != 1 {
				t.Fatalf("drifts %v, want one annotation", h.drifts)
			}
			if c.holds {
				if !proof.OK || !proof.Repaired || h.unproven != 0 {
					t.Fatalf("proof %+v, unproven %d: want repaired once the write showed", proof, h.unproven)
				}
				return
			}
			if proof.OK || proof.Repaired || !strings.Contains(proof.Problem, "annotation: ") || h.unproven != 1 {
				t.Fatalf("proof %+v, unproven %d: want unproven, the annotation still wrong", proof, h.unproven)
			}
		})
	}
}

// With DNS captured, ztunnel's DNS listener (15053) is proven with the
// others: without it the pod's DNS goes nowhere, and ztunnel is handed
// the pod again. A pod whose DNS is not captured needs none.
func TestDNSListenerIsProvenWhenDNSIsCaptured(t *testing.T) {
	h := newHarness(t, time.Minute)
	dns, plain := h.pod(1, true), h.pod(2, true)
	h.enrolled[plain.UID].Rules.DNSCapture = false
	for _, p := range []*corev1.Pod{dns, plain} {
		delete(h.listening[p.UID], ambient.ZtunnelDNSPort)
	}
	h.v.round(context.Background())
	if h.drifts[KindZtunnel] != 1 || len(h.drifts) != 1 || !slices.Equal(h.recaptures, []string{"pod-1 reset=true"}) {
		t.Fatalf("drifts %v, recaptures %v: want ztunnel drift on pod-1 only", h.drifts, h.recaptures)
	}
	if len(h.ev.events) != 1 || !strings.Contains(h.ev.events[0], "ztunnel: ztunnel is not listening on 15053 in the pod") {
		t.Fatalf("events %q", h.ev.events)
	}
	for _, p := range []*corev1.Pod{dns, plain} {
		if proof, _ := h.v.Last(p.UID); !proof.OK {
			t.Errorf("%s: proof %+v", p.Name, proof)
		}
	}
}

// Fresh captures get Settle: an annotation write still queued and
// listeners still binding are not drift; a pod ztunnel never acked is.
func TestFreshCaptureSettles(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.enrolled[p.UID].Since = h.now.Add(time.Minute) // captured just before its proof
	p.Annotations = nil
	h.listening[p.UID] = nil
	h.v.round(context.Background())
	if len(h.drifts) > 0 || h.unproven != 0 {
		t.Fatalf("fresh capture: drifts %v, unproven %d", h.drifts, h.unproven)
	}
	h.enrolled[p.UID].State = nodeagent.StatePending
	h.v.round(context.Background())
	if h.drifts[KindZtunnel] != 1 || !slices.Equal(h.recaptures, []string{"pod-1 reset=true"}) {
		t.Fatalf("pending pod without listeners: drifts %v, recaptures %v", h.drifts, h.recaptures)
	}
}

// With no ztunnel connected no pod is proven, and nothing is repaired:
// there is no one to hand pods to.
func TestNoZtunnelIsUnprovenNotDrift(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.ztunnels = 0
	h.v.round(context.Background())
	proof, _ := h.v.Last(p.UID)
	if proof.OK || !strings.Contains(proof.Problem, "no ztunnel") || len(h.recaptures) > 0 || len(h.drifts) > 0 || h.unproven != 1 {
		t.Fatalf("proof %+v, recaptures %v, drifts %v, unproven %d", proof, h.recaptures, h.drifts, h.unproven)
	}
}

// A pod that should be captured and is not is handed to the controller
// once it stayed so for Settle (an ADD may be in flight), reported and
// counted as unproven until the agent holds it.
func TestUncapturedPodIsHandedToTheController(t *testing.T) {
	h := newHarness(t, 30*time.Second)
	h.pod(1, true)
	p := h.pod(2, false)
	off := h.pod(3, false)
	off.Labels = nil // not to be captured
	h.pod(4, false).Status.PodIPs = nil
	h.v.round(context.Background()) // first seen
	if len(h.requeued) > 0 {
		t.Fatalf("requeued %v before Settle", h.requeued)
	}
	h.v.round(context.Background())
	if want := []types.NamespacedName{{Namespace: "ns", Name: p.Name}}; !slices.Equal(h.requeued, want) {
		t.Fatalf("requeued %v, want %v", h.requeued, want)
	}
	if h.drifts[KindUncaptured] != 1 || len(h.ev.events) != 1 || h.unproven != 1 {
		t.Fatalf("drifts %v, events %v, unproven %d", h.drifts, h.ev.events, h.unproven)
	}
	// Still uncaptured a round later: handed over again, told once.
	h.v.round(context.Background())
	if len(h.requeued) != 2 || h.drifts[KindUncaptured] != 1 || len(h.ev.events) != 1 || h.unproven != 1 {
		t.Fatalf("second round: requeued %v, drifts %v, events %v, unproven %d", h.requeued, h.drifts, h.ev.events, h.unproven)
	}
	// The controller captured it.
	h.mu.Lock()
	h.enrolled[p.UID] = &nodeagent.EnrolledPod{UID: p.UID, Namespace: "ns", Name: p.Name, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.2")},
		State: nodeagent.StateEnabled, Since: time.Unix(0, 0)}
	h.listening[p.UID] = allPorts()
	h.probe[netip.MustParseAddr("10.0.0.2")] = true
	p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
	h.mu.Unlock()
	h.v.round(context.Background())
	if h.unproven != 0 || len(h.requeued) != 2 {
		t.Fatalf("after capture: unproven %d, requeued %v", h.unproven, h.requeued)
	}
	// Its first proof shows the drift that got it captured (explain).
	proof, ok := h.v.Last(p.UID)
	if !ok || !proof.OK || len(proof.LastDrift) != 1 || proof.LastDrift[0].Kind != KindUncaptured || proof.LastDriftAt.IsZero() {
		t.Fatalf("first proof after capture %+v (%v): want proven, last drift uncaptured", proof, ok)
	}
}

// Pods going away, no longer to be captured, or gone are not proven, and
// their old proofs are dropped.
func TestPodsLeavingAreNotProven(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.v.round(context.Background())
	if _, ok := h.v.Last(p.UID); !ok {
		t.Fatal("no proof")
	}
	now := metav1.Now()
	p.DeletionTimestamp = &now
	h.drift[p.UID] = []string{"gone"}
	h.v.round(context.Background())
	if len(h.recaptures) > 0 || len(h.drifts) > 0 {
		t.Fatalf("terminating pod repaired: %v %v", h.recaptures, h.drifts)
	}
	delete(h.enrolled, p.UID)
	h.v.round(context.Background())
	if _, ok := h.v.Last(p.UID); ok {
		t.Fatal("proof of an unenrolled pod kept")
	}
}

// Run stops when its context ends.
func TestRunStops(t *testing.T) {
	v := New(Config{Agent: newFakeNode(), Pods: fakeCache{newFakeNode()}, Period: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- v.Run(ctx) }()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
}

// The time a proof takes comes out of the wait before the next one, so a
// round lasts the period however slow the proofs; never below MinGap.
func TestSlowProofsKeepTheRoundToThePeriod(t *testing.T) {
	h := newHarness(t, time.Minute)
	for i := 1; i <= 4; i++ {
		h.pod(i, true)
	}
	look := h.v.cfg.Look
	h.v.cfg.Look = func(f *os.File, ports []uint16) ([]netip.Addr, map[uint16]bool, error) {
		h.now = h.now.Add(5 * time.Second)
		return look(f, ports)
	}
	h.v.round(context.Background())
	if want := []time.Duration{15 * time.Second, 10 * time.Second, 10 * time.Second, 10 * time.Second}; !slices.Equal(h.sleeps, want) {
		t.Fatalf("sleeps %v, want %v", h.sleeps, want)
	}
	h.sleeps = nil
	h.v.cfg.Look = func(f *os.File, ports []uint16) ([]netip.Addr, map[uint16]bool, error) {
		h.now = h.now.Add(time.Minute)
		return look(f, ports)
	}
	h.v.round(context.Background())
	if want := []time.Duration{15 * time.Second, MinGap, MinGap, MinGap}; !slices.Equal(h.sleeps, want) {
		t.Fatalf("proofs slower than their slots: sleeps %v, want %v", h.sleeps, want)
	}
}

// A pod whose sandbox was recreated without the agent (the namespace the
// agent holds has none of its IPs) is captured in the namespace the
// finder finds, and nothing else is judged in the old one; not found, it
// stays unproven.
func TestRecreatedSandboxIsCapturedInItsNewNamespace(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.moved[p.UID] = true
	h.drift[p.UID] = []string{"irrelevant in the old namespace"}
	h.v.round(context.Background())
	proof, _ := h.v.Last(p.UID)
	if proof.OK || h.drifts[KindSandbox] != 1 || len(h.drifts) != 1 || len(h.captures) > 0 || h.unproven != 1 {
		t.Fatalf("not found: proof %+v, drifts %v, captures %v, unproven %d", proof, h.drifts, h.captures, h.unproven)
	}
	h.found[p.UID] = true
	delete(h.drift, p.UID)
	h.v.round(context.Background())
	proof, _ = h.v.Last(p.UID)
	if !proof.OK || !proof.Repaired || !slices.Equal(h.captures, []string{"pod-1"}) || len(h.recaptures) > 0 || h.unproven != 0 {
		t.Fatalf("found: proof %+v, captures %v, recaptures %v, unproven %d", proof, h.captures, h.recaptures, h.unproven)
	}
}

// A pod restored without its namespace cannot be proven: it counts as
// unproven, and nothing is repaired (the controller looks for it).
func TestUnresolvedPodIsUnproven(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.enrolled[p.UID].Unresolved = true
	h.v.round(context.Background())
	proof, ok := h.v.Last(p.UID)
	if !ok || proof.OK || !strings.Contains(proof.Problem, "network namespace") || h.unproven != 1 || len(h.recaptures) > 0 {
		t.Fatalf("proof %+v (%v), unproven %d, recaptures %v", proof, ok, h.unproven, h.recaptures)
	}
}

// A pod whose captured sandbox the runtime removed (CNI DEL) waits for its
// next sandbox's ADD while it shows the old sandbox's IPs, for at most a
// period, and is not counted unproven meanwhile; one showing other IPs
// runs a sandbox no ADD brought to the agent (started while the plugin was
// not chained) and is handed over as any uncaptured pod.
func TestReleasedPodWithNewSandboxIsHandedOver(t *testing.T) {
	h := newHarness(t, 30*time.Second)
	h.pod(1, true)
	moved, same, unknown := h.pod(2, false), h.pod(3, false), h.pod(4, false)
	h.v.round(context.Background()) // first seen
	// The DELs came just now (a round lasts a period).
	h.released[moved.UID] = released{h.now, []netip.Addr{netip.MustParseAddr("10.0.0.99")}}
	h.released[same.UID] = released{h.now, []netip.Addr{netip.MustParseAddr("10.0.0.3")}}
	h.released[unknown.UID] = released{at: h.now}
	h.v.round(context.Background())
	if want := []types.NamespacedName{{Namespace: "ns", Name: moved.Name}}; !slices.Equal(h.requeued, want) || h.unproven != 1 {
		t.Fatalf("requeued %v, unproven %d; want only the pod with a new sandbox %v, 1", h.requeued, h.unproven, want)
	}
	// A period after the DELs no ADD came: whatever runs under the old
	// IPs is captured as any other pod.
	h.v.round(context.Background())
	h.v.round(context.Background())
	got := map[string]bool{}
	for _, n := range h.requeued {
		got[n.Name] = true
	}
	if !got[same.Name] || !got[unknown.Name] || h.unproven != 3 {
		t.Fatalf("a period after the DELs: requeued %v, unproven %d; want %s and %s among them, 3", h.requeued, h.unproven, same.Name, unknown.Name)
	}
}

// An ordinary sandbox recreation: the new sandbox's ADD moved the agent to
// its namespace (the IPs the ADD gave are there, in the probe set and in
// ztunnel), while the pod's status still shows the old sandbox's IPs,
// until kubelet's status update reaches the cache, or for as long as an
// API-server outage keeps it from coming. The status lags the namespace
// the agent holds: that is not drift, and nothing is repaired or told.
func TestStatusLaggingARecreatedSandboxIsNotDrift(t *testing.T) {
	h := newHarness(t, time.Minute)
	p := h.pod(1, true)
	h.pod(2, true)
	newIP := netip.MustParseAddr("10.0.1.1")
	h.mu.Lock()
	delete(h.probe, netip.MustParseAddr("10.0.0.1"))
	h.probe[newIP] = true
	h.enrolled[p.UID].IPs = []netip.Addr{newIP}
	h.mu.Unlock()
	for range 3 {
		h.v.round(context.Background())
		proof, _ := h.v.Last(p.UID)
		if !proof.OK || len(proof.Found) > 0 || len(h.drifts) > 0 || len(h.ev.events) > 0 || len(h.captures) > 0 || len(h.recaptures) > 0 || h.unproven != 0 {
			t.Fatalf("status lagging the recreated sandbox: proof %+v, drifts %v, events %q, captures %v, recaptures %v, unproven %d",
				proof, h.drifts, h.ev.events, h.captures, h.recaptures, h.unproven)
		}
	}
	// The status update arrives: still nothing to find.
	h.mu.Lock()
	p.Status.PodIPs = []corev1.PodIP{{IP: newIP.String()}}
	h.mu.Unlock()
	h.v.round(context.Background())
	if proof, _ := h.v.Last(p.UID); !proof.OK || len(h.drifts) > 0 || len(h.ev.events) > 0 {
		t.Fatalf("after the status update: proof %+v, drifts %v, events %q", proof, h.drifts, h.ev.events)
	}
}
