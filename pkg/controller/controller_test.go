package controller_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
)

// fakeAgent records what the controller asks of the agent. It never
// enters the netns handles it gets (the fake finder hands out none).
type fakeAgent struct {
	mu         sync.Mutex
	enrolled   map[types.NamespacedName]types.UID
	pending    map[types.UID]bool
	unresolved map[types.UID]bool
	records    []nodeagent.Record
	releaseErr error
	released   map[types.UID]bool
	calls      []string
	captureErr error
	// gate, when set, holds every Capture until it is closed; inFlight
	// and maxInFlight count the captures held at once.
	gate                  chan struct{}
	inFlight, maxInFlight int
	holds                 int // annotation holds in force
}

func newFakeAgent() *fakeAgent {
	return &fakeAgent{
		enrolled: map[types.NamespacedName]types.UID{}, pending: map[types.UID]bool{},
		unresolved: map[types.UID]bool{}, released: map[types.UID]bool{},
	}
}

func (a *fakeAgent) Capture(_ context.Context, pod *corev1.Pod, _ *netns.Handle, sb *nodeagent.Sandbox) error {
	a.mu.Lock()
	if gate := a.gate; gate != nil {
		a.inFlight++
		a.maxInFlight = max(a.maxInFlight, a.inFlight)
		a.mu.Unlock()
		<-gate
		a.mu.Lock()
		a.inFlight--
	}
	defer a.mu.Unlock()
	a.calls = append(a.calls, "capture "+pod.Namespace+"/"+pod.Name)
	if sb != nil {
		return errors.New("the controller passed a sandbox")
	}
	if a.captureErr != nil {
		return a.captureErr
	}
	a.enrolled[types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}] = pod.UID
	delete(a.pending, pod.UID)
	delete(a.unresolved, pod.UID)
	return nil
}

func (a *fakeAgent) Restore(_ context.Context, pod *corev1.Pod, _ *netns.Handle) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, "restore "+pod.Namespace+"/"+pod.Name)
	a.enrolled[types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}] = pod.UID
	delete(a.unresolved, pod.UID)
	return nil
}

func (a *fakeAgent) RestoreUnresolved(pod *corev1.Pod) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, "keep "+pod.Namespace+"/"+pod.Name)
	a.enrolled[types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}] = pod.UID
	a.unresolved[pod.UID] = true
}

func (a *fakeAgent) Unresolved(uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.unresolved[uid]
}

func (a *fakeAgent) Release(_ context.Context, pod *corev1.Pod, _ *netns.Handle) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, "release "+pod.Namespace+"/"+pod.Name)
	return a.releaseErr
}

func (a *fakeAgent) ClearStale(pod *corev1.Pod) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, "clear "+pod.Namespace+"/"+pod.Name)
}

func (a *fakeAgent) Records() []nodeagent.Record {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.records)
}

func (a *fakeAgent) Unenroll(_ context.Context, uid types.UID) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, "unenroll "+string(uid))
	for k, u := range a.enrolled {
		if u == uid {
			delete(a.enrolled, k)
		}
	}
	delete(a.unresolved, uid)
	return nil
}

func (a *fakeAgent) HoldAnnotations() func() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.holds++
	var once sync.Once
	return func() {
		once.Do(func() {
			a.mu.Lock()
			defer a.mu.Unlock()
			a.holds--
		})
	}
}

// held is how many annotation holds are in force.
func (a *fakeAgent) held() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holds
}

func (a *fakeAgent) EnrolledUID(namespace, name string) (types.UID, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	uid, ok := a.enrolled[types.NamespacedName{Namespace: namespace, Name: name}]
	return uid, ok
}

func (a *fakeAgent) Pending(uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.pending[uid]
}

func (a *fakeAgent) SandboxReleased(uid types.UID) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.released[uid]
}

// releaseSandbox is a CNI DEL of the pod's sandbox.
func (a *fakeAgent) releaseSandbox(ns, name string, uid types.UID) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.enrolled, types.NamespacedName{Namespace: ns, Name: name})
	a.released[uid] = true
}

func (a *fakeAgent) enroll(ns, name string, uid types.UID, pending bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.enrolled[types.NamespacedName{Namespace: ns, Name: name}] = uid
	a.pending[uid] = pending
}

func (a *fakeAgent) setCaptureErr(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.captureErr = err
}

func (a *fakeAgent) log() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.calls)
}

func (a *fakeAgent) count(call string) int {
	n := 0
	for _, c := range a.log() {
		if c == call {
			n++
		}
	}
	return n
}

// fakeFinder "finds" the pods whose UIDs are running, one scan per call.
type fakeFinder struct {
	mu      sync.Mutex
	running map[types.UID]bool
	scans   [][]types.UID
}

func (f *fakeFinder) Find(pods map[types.UID][]netip.Addr) (map[types.UID]*netns.Handle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[types.UID]*netns.Handle{}
	var asked []types.UID
	for uid := range pods {
		asked = append(asked, uid)
		if f.running[uid] {
			out[uid] = nil
		}
	}
	slices.Sort(asked)
	f.scans = append(f.scans, asked)
	return out, nil
}

func (f *fakeFinder) setRunning(uids ...types.UID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, u := range uids {
		f.running[u] = true
	}
}

func (f *fakeFinder) scanLog() [][]types.UID {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.scans)
}

type env struct {
	kube   *fakecluster.Cluster
	agent  *fakeAgent
	finder *fakeFinder
	events *record.FakeRecorder
	ctrl   *controller.Controller
}

var self = types.NamespacedName{Namespace: "istio-system", Name: "ambient-cni-x1"}

// selfPolicy is Istio's default policy with self as the agent's own pod.
func selfPolicy() enablement.Policy {
	p := enablement.DefaultPolicy()
	p.Self = self
	return p
}

// newEnv starts the pod cache (seeded with objs, as if they existed before
// the agent) and the controller, and waits for its startup restore.
func newEnv(t *testing.T, running []types.UID, objs ...*corev1.Pod) *env {
	t.Helper()
	return newEnvWithRecords(t, running, nil, objs...)
}

// newEnvWithRecords is newEnv with capture records a previous agent left.
func newEnvWithRecords(t *testing.T, running []types.UID, records []nodeagent.Record, objs ...*corev1.Pod) *env {
	t.Helper()
	return newEnvWithAgent(t, running, records, nil, objs...)
}

// newEnvWithAgent is newEnvWithRecords with setup run on the fake agent
// before the controller starts.
func newEnvWithAgent(t *testing.T, running []types.UID, records []nodeagent.Record, setup func(*fakeAgent), objs ...*corev1.Pod) *env {
	t.Helper()
	e := &env{
		kube:   fakecluster.New(t, podcache.Config{Policy: selfPolicy()}),
		agent:  newFakeAgent(),
		finder: &fakeFinder{running: map[types.UID]bool{}},
		events: record.NewFakeRecorder(100),
	}
	e.finder.setRunning(running...)
	e.agent.records = records
	if setup != nil {
		setup(e.agent)
	}
	e.kube.Seed(namespace("shop", false), namespace("blog", true), namespace(self.Namespace, true))
	for _, p := range objs {
		e.kube.Seed(p)
	}
	e.ctrl = controller.New(controller.Config{
		Pods: e.kube.Cache, Agent: e.agent, Finder: e.finder, Events: e.events,
	})
	e.kube.Start()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.ctrl.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case <-e.ctrl.Restored():
	case err := <-done:
		t.Fatalf("Run returned before restoring: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("startup restore not done")
	}
	return e
}

func namespace(name string, ambientOn bool) *corev1.Namespace {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if ambientOn {
		ns.Labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	}
	return ns
}

// running is a running pod with an IP, as the controller finds them.
func running(ns, name, uid, ip string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid)},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}},
	}
}

// TestNamespaceFlipCapturesRunningPods: labelling a namespace captures its
// running pods with one /proc scan for the burst, not one per pod.
func TestNamespaceFlipCapturesRunningPods(t *testing.T) {
	e := newEnv(t, []types.UID{"u-a", "u-b", "u-c"},
		running("shop", "a", "u-a", "10.1.0.1"), running("shop", "b", "u-b", "10.1.0.2"), running("shop", "c", "u-c", "10.1.0.3"))
	time.Sleep(100 * time.Millisecond) // let the startup reconcile settle
	if calls := e.agent.log(); len(calls) != 0 {
		t.Fatalf("pods of an unlabelled namespace touched: %v", calls)
	}
	scans := len(e.finder.scanLog())
	e.kube.SetNamespace(namespace("shop", true))
	for _, n := range []string{"a", "b", "c"} {
		poll.Until(t, "capture of shop/"+n, func() bool { return e.agent.count("capture shop/"+n) == 1 })
	}
	if got := len(e.finder.scanLog()) - scans; got < 1 || got >= 3 {
		t.Errorf("%d scans for one namespace flip of 3 pods, want them batched: %v", got, e.finder.scanLog())
	}
}

// TestEnrollmentParallelAndBounded: the running pods of a
// namespace that gets labelled are captured in parallel, at most Parallel
// (default 8) at a time, after one /proc scan for the whole burst, with
// the annotation writes held until the batch's captures are done.
func TestEnrollmentParallelAndBounded(t *testing.T) {
	var pods []*corev1.Pod
	var uids []types.UID
	for i := range 30 {
		uid := types.UID(fmt.Sprintf("u-%02d", i))
		pods = append(pods, running("shop", fmt.Sprintf("p%02d", i), string(uid), fmt.Sprintf("10.1.0.%d", i+1)))
		uids = append(uids, uid)
	}
	e := newEnv(t, uids, pods...)
	gate := make(chan struct{})
	e.agent.mu.Lock()
	e.agent.gate = gate
	e.agent.mu.Unlock()
	inFlight := func() (now, most int) {
		e.agent.mu.Lock()
		defer e.agent.mu.Unlock()
		return e.agent.inFlight, e.agent.maxInFlight
	}
	scans := len(e.finder.scanLog())
	e.kube.SetNamespace(namespace("shop", true))
	poll.Until(t, "8 captures in flight", func() bool { now, _ := inFlight(); return now == 8 })
	if n := e.agent.held(); n != 1 {
		t.Errorf("%d annotation holds while the batch captures, want 1", n)
	}
	close(gate)
	poll.Until(t, "every pod captured", func() bool {
		for i := range 30 {
			if e.agent.count(fmt.Sprintf("capture shop/p%02d", i)) != 1 {
				return false
			}
		}
		return true
	})
	if _, most := inFlight(); most != 8 {
		t.Errorf("at most %d captures at once, want 8 (the default bound)", most)
	}
	poll.Until(t, "the annotation hold released", func() bool { return e.agent.held() == 0 })
	if got := len(e.finder.scanLog()) - scans; got < 1 || got > 3 {
		t.Errorf("%d scans for one namespace flip of 30 pods, want them batched: %v", got, e.finder.scanLog())
	}
}

func TestUnenrollsPodsNoLongerWanted(t *testing.T) {
	e := newEnv(t, []types.UID{"u-a", "u-b"}, running("blog", "a", "u-a", "10.1.0.1"), running("blog", "b", "u-b", "10.1.0.2"))
	poll.Until(t, "captures", func() bool { return e.agent.count("capture blog/a") == 1 && e.agent.count("capture blog/b") == 1 })
	// The pod opts out with its own label.
	a := running("blog", "a", "u-a", "10.1.0.1")
	a.Labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone}
	e.kube.SetPod(a)
	poll.Until(t, "unenroll of the opted-out pod", func() bool { return e.agent.count("unenroll u-a") == 1 })
	// The pod is deleted while enrolled.
	e.kube.DeletePod("blog", "b")
	poll.Until(t, "unenroll of the deleted pod", func() bool { return e.agent.count("unenroll u-b") == 1 })
	// The namespace is unlabelled: nothing left to unenroll.
	if _, ok := e.agent.EnrolledUID("blog", "a"); ok {
		t.Errorf("blog/a still enrolled")
	}
}

// TestRestoreAdoptsMarkedPods: at startup the pods a previous agent marked
// are restored before Restored is closed; one that should no longer be
// captured is released instead, a marked pod whose netns is not found is
// adopted unresolved (ztunnel keeps it) rather than dropped or cleared,
// whether it should still be captured (captured once found) or not (see
// TestUnresolvedPodReleasedOnlyWithItsNetns), and a finished pod gets its
// annotation cleared (through the agent's writer).
func TestRestoreAdoptsMarkedPods(t *testing.T) {
	mark := func(p *corev1.Pod) *corev1.Pod {
		p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
		return p
	}
	done := running("blog", "done", "u-done", "10.1.0.9")
	done.Status.Phase = corev1.PodSucceeded
	e := newEnv(t, []types.UID{"u-keep", "u-stale"},
		mark(running("blog", "keep", "u-keep", "10.1.0.1")),
		mark(running("shop", "stale", "u-stale", "10.1.0.2")),
		mark(running("blog", "lost", "u-lost", "10.1.0.3")),
		mark(running("shop", "gone", "u-gone", "10.1.0.4")),
		mark(done))
	restored := e.agent.log()
	slices.Sort(restored)
	if want := []string{"keep blog/lost", "keep shop/gone", "release shop/stale", "restore blog/keep"}; !slices.Equal(restored, want) {
		t.Errorf("restored before Restored(): %v, want %v", restored, want)
	}
	poll.Until(t, "finished pod's annotation cleared", func() bool { return e.agent.count("clear blog/done") == 1 })
	// The unresolved pods are looked for again, not dropped, not cleared,
	// and not released while they may still run with their rules.
	for _, uid := range []types.UID{"u-lost", "u-gone"} {
		poll.Until(t, "a scan for the unresolved pod "+string(uid), func() bool {
			return slices.ContainsFunc(e.finder.scanLog()[1:], func(s []types.UID) bool { return slices.Contains(s, uid) })
		})
	}
	time.Sleep(100 * time.Millisecond)
	for _, c := range e.agent.log() {
		if strings.Contains(c, "keep") && c != "restore blog/keep" && c != "keep blog/lost" && c != "keep shop/gone" ||
			strings.Contains(c, "lost") && c != "keep blog/lost" || strings.Contains(c, "gone") && c != "keep shop/gone" ||
			strings.Contains(c, "done") && c != "clear blog/done" {
			t.Errorf("unexpected %q", c)
		}
	}
	// Found again: captured.
	e.finder.setRunning("u-lost")
	poll.Until(t, "the unresolved pod captured once found", func() bool { return e.agent.count("capture blog/lost") == 1 })
}

// TestUnresolvedPodReleasedOnlyWithItsNetns: a pod restored without its
// netns that should no longer be captured (its namespace was unlabelled
// while the agent was down) is unenrolled only after its netns is found
// and restored, so its rules go before ztunnel lets go of it; one deleted
// while unresolved is unenrolled at once (its sandbox is gone).
func TestUnresolvedPodReleasedOnlyWithItsNetns(t *testing.T) {
	mark := func(p *corev1.Pod) *corev1.Pod {
		p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
		return p
	}
	e := newEnv(t, nil,
		mark(running("shop", "unlabelled", "u-unl", "10.1.0.1")),
		mark(running("blog", "deleted", "u-del", "10.1.0.2")))
	if !e.agent.Unresolved("u-unl") || !e.agent.Unresolved("u-del") {
		t.Fatalf("not adopted unresolved: %v", e.agent.log())
	}
	poll.Until(t, "a scan for the unlabelled pod", func() bool {
		return slices.ContainsFunc(e.finder.scanLog()[1:], func(s []types.UID) bool { return slices.Contains(s, "u-unl") })
	})
	time.Sleep(100 * time.Millisecond)
	if n := e.agent.count("unenroll u-unl"); n != 0 {
		t.Fatalf("unenrolled %d times without its netns", n)
	}
	e.finder.setRunning("u-unl")
	poll.Until(t, "restored, then unenrolled", func() bool {
		calls := e.agent.log()
		i, j := slices.Index(calls, "restore shop/unlabelled"), slices.Index(calls, "unenroll u-unl")
		return i >= 0 && j > i
	})
	e.kube.DeletePod("blog", "deleted")
	poll.Until(t, "the deleted unresolved pod unenrolled", func() bool { return e.agent.count("unenroll u-del") == 1 })
}

// TestFailedReleaseAtRestoreKeepsPod: a pod found captured at startup that
// should not be any more, whose release fails (its rules could not be
// removed), is adopted unresolved so ztunnel keeps serving its redirected
// traffic, and the reconcile releases it in order (restore, then unenroll)
// once it can.
func TestFailedReleaseAtRestoreKeepsPod(t *testing.T) {
	p := running("shop", "stale", "u-stale", "10.1.0.2")
	p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
	e := newEnvWithAgent(t, []types.UID{"u-stale"}, nil, func(a *fakeAgent) { a.releaseErr = errors.New("xtables lock busy") }, p)
	if got := e.agent.log(); !slices.Equal(got, []string{"release shop/stale", "keep shop/stale"}) {
		t.Fatalf("before Restored(): %v", got)
	}
	poll.Until(t, "restored, then unenrolled", func() bool {
		calls := e.agent.log()
		i, j := slices.Index(calls, "restore shop/stale"), slices.Index(calls, "unenroll u-stale")
		return i >= 0 && j > i
	})
}

// TestRestoreAdoptsRecordedPods: the pods in the agent's capture records
// are restored even without an annotation (the previous agent crashed
// before writing it), and a recorded pod whose object is gone is cleaned
// by its uid before Restored is closed.
func TestRestoreAdoptsRecordedPods(t *testing.T) {
	records := []nodeagent.Record{
		{UID: "u-quiet", Namespace: "blog", Name: "quiet", IPs: []netip.Addr{netip.MustParseAddr("10.1.0.1")}},
		{UID: "u-deleted", Namespace: "blog", Name: "deleted"},
	}
	e := newEnvWithRecords(t, []types.UID{"u-quiet"}, records, running("blog", "quiet", "u-quiet", "10.1.0.1"))
	restored := e.agent.log()
	slices.Sort(restored)
	if want := []string{"restore blog/quiet", "unenroll u-deleted"}; !slices.Equal(restored, want) {
		t.Errorf("before Restored(): %v, want %v", restored, want)
	}
}

func TestCaptureFailureIsEventedAndRetried(t *testing.T) {
	e := newEnv(t, []types.UID{"u-a"})
	e.agent.setCaptureErr(errors.New("xtables lock busy"))
	e.kube.SetPod(running("blog", "a", "u-a", "10.1.0.1"))
	select {
	case ev := <-e.events.Events:
		if want := "Warning AmbientEnrollFailed could not enroll pod in the ambient mesh: xtables lock busy"; ev != want {
			t.Errorf("event %q, want %q", ev, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no event for the failed capture")
	}
	e.agent.setCaptureErr(nil)
	poll.Until(t, "the retry captures the pod", func() bool {
		_, ok := e.agent.EnrolledUID("blog", "a")
		return ok
	})
}

// TestPendingAndRecreatedPods: a pod whose ztunnel handoff failed is
// captured again; a pod recreated under the same name replaces the old
// enrollment.
func TestPendingAndRecreatedPods(t *testing.T) {
	e := newEnv(t, []types.UID{"u-p", "u-new"})
	e.agent.enroll("blog", "p", "u-p", true)
	e.agent.enroll("blog", "r", "u-old", false)
	e.kube.SetPod(running("blog", "p", "u-p", "10.1.0.1"))
	e.kube.SetPod(running("blog", "r", "u-new", "10.1.0.2"))
	poll.Until(t, "pending pod captured again", func() bool { return e.agent.count("capture blog/p") == 1 })
	poll.Until(t, "recreated pod replaced", func() bool {
		calls := e.agent.log()
		i, j := slices.Index(calls, "unenroll u-old"), slices.Index(calls, "capture blog/r")
		return i >= 0 && j > i
	})
}

// TestLeavesAloneWhatIsNotItsJob: the agent's own pod, a pod still being
// set up (no IP yet: its CNI ADD captures it) and a pod whose netns cannot
// be found (retried, never captured blind).
func TestLeavesAloneWhatIsNotItsJob(t *testing.T) {
	e := newEnv(t, nil)
	e.kube.SetPod(running(self.Namespace, self.Name, "u-self", "10.1.0.5"))
	starting := running("blog", "starting", "u-s", "")
	starting.Status = corev1.PodStatus{Phase: corev1.PodPending}
	e.kube.SetPod(starting)
	e.kube.SetPod(running("blog", "lost", "u-lost", "10.1.0.6"))
	poll.Until(t, "a scan for the lost pod", func() bool {
		for _, s := range e.finder.scanLog() {
			if slices.Contains(s, "u-lost") {
				return true
			}
		}
		return false
	})
	time.Sleep(100 * time.Millisecond)
	if calls := e.agent.log(); len(calls) != 0 {
		t.Errorf("agent calls %v, want none", calls)
	}
	for _, s := range e.finder.scanLog() {
		if slices.Contains(s, "u-self") || slices.Contains(s, "u-s") {
			t.Errorf("scanned for %v", s)
		}
	}
	// Once its netns shows up, the retry captures it.
	e.finder.setRunning("u-lost")
	poll.Until(t, "capture once found", func() bool { return e.agent.count("capture blog/lost") == 1 })
}

// TestTerminatingAndStartingPods: a pod with a deletionTimestamp stays
// captured (it is released when its object goes, not when its grace
// period starts), and a pod that has IPs but is not Running yet (init
// containers) is captured, as Istio does both.
func TestTerminatingAndStartingPods(t *testing.T) {
	e := newEnv(t, []types.UID{"u-t", "u-i"}, running("blog", "t", "u-t", "10.1.0.1"))
	poll.Until(t, "capture of the running pod", func() bool { return e.agent.count("capture blog/t") == 1 })
	terminating := running("blog", "t", "u-t", "10.1.0.1")
	now := metav1.Now()
	terminating.DeletionTimestamp = &now
	e.kube.SetPod(terminating)
	starting := running("blog", "i", "u-i", "10.1.0.2")
	starting.Status.Phase = corev1.PodPending
	e.kube.SetPod(starting)
	// The starting pod's capture comes after the terminating pod's update
	// was handled (one worker, in order).
	poll.Until(t, "capture of the pod whose init containers run", func() bool { return e.agent.count("capture blog/i") == 1 })
	if e.agent.count("unenroll u-t") != 0 {
		t.Fatalf("terminating pod unenrolled at the start of its grace period: %v", e.agent.log())
	}
	// kubelet tears the sandbox down (CNI DEL releases the pod) and
	// updates the status before it removes the object: the controller
	// does not go looking for the pod's network again.
	e.agent.releaseSandbox("blog", "t", "u-t")
	scans := len(e.finder.scanLog())
	terminating = terminating.DeepCopy()
	terminating.Status.Phase = corev1.PodRunning
	terminating.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
	e.kube.SetPod(terminating)
	e.kube.SetPod(running("blog", "later", "u-later", "10.1.0.3"))
	poll.Until(t, "a later pod's scan", func() bool {
		return slices.ContainsFunc(e.finder.scanLog()[scans:], func(s []types.UID) bool { return slices.Contains(s, "u-later") })
	})
	for _, s := range e.finder.scanLog()[scans:] {
		if slices.Contains(s, "u-t") {
			t.Fatalf("looked for the released terminating pod's netns: %v", e.finder.scanLog()[scans:])
		}
	}
	if n := e.agent.count("capture blog/t"); n != 1 {
		t.Fatalf("released terminating pod captured again (%d captures)", n)
	}
	e.kube.DeletePod("blog", "t")
	poll.Until(t, "the object is gone", func() bool { _, err := e.kube.Cache.Pod("blog", "t"); return err != nil })
}

// TestSidecarPodExpectingIstioCNIIsToldOnce: a sidecar pod injected for
// istio-cni (its istio-validation init container) gets one Warning Event
// however often it changes, is not captured, and a new pod under its name
// is told again; sidecar pods injected with istio-init are not told.
func TestSidecarPodExpectingIstioCNIIsToldOnce(t *testing.T) {
	e := newEnv(t, []types.UID{"u-m"})
	sidecar := func(uid, init string) *corev1.Pod {
		p := running("blog", "sc", uid, "10.1.0.9")
		p.Annotations = map[string]string{ambient.SidecarStatusAnnotation: `{"initContainers":["` + init + `"]}`}
		p.Spec.InitContainers = []corev1.Container{{Name: init, Image: "proxyv2"}}
		return p
	}
	p := sidecar("u-sc", ambient.IstioValidationInitContainer)
	e.kube.SetPod(p)
	var got string
	select {
	case got = <-e.events.Events:
	case <-time.After(10 * time.Second):
		t.Fatal("no event for a sidecar pod that expects istio-cni")
	}
	if !strings.HasPrefix(got, "Warning "+controller.ReasonIstioCNIExpected+" ") || !strings.Contains(got, ambient.IstioValidationInitContainer) {
		t.Errorf("event %q", got)
	}
	// Status updates of the same pod: no second event.
	for i := range 3 {
		q := p.DeepCopy()
		q.Labels = map[string]string{"rev": fmt.Sprint(i)}
		e.kube.SetPod(q)
	}
	// A new pod under the name is told again; a pod injected with
	// istio-init (it sets up its own redirection) never is.
	e.kube.SetPod(sidecar("u-sc2", ambient.IstioValidationInitContainer))
	other := sidecar("u-init", "istio-init")
	other.Name = "with-init"
	e.kube.SetPod(other)
	select {
	case got = <-e.events.Events:
		if !strings.Contains(got, controller.ReasonIstioCNIExpected) {
			t.Errorf("event %q", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no event for the new pod under the same name")
	}
	// The marker goes through the queue after everything above.
	e.kube.SetPod(running("blog", "marker", "u-m", "10.1.0.10"))
	poll.Until(t, "the marker pod reconciled", func() bool { return e.agent.count("capture blog/marker") == 1 })
	select {
	case ev := <-e.events.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
	if n := e.agent.count("capture blog/sc") + e.agent.count("capture blog/with-init"); n != 0 {
		t.Errorf("sidecar pods captured %d times", n)
	}
}
