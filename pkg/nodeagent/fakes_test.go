package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// recordedRules is a map-backed rule applier: per network namespace, the
// configuration last applied and the drift injected since (the backends
// against real netfilter are exercised in the root tests of pkg/iptables,
// pkg/nftables, pkg/rulesbackend and test/cni). It records which
// operations the agent asked for, can inject a failure, and checks every
// path it gets is an open network namespace, as a real backend would need.
type recordedRules struct {
	mu        sync.Mutex
	calls     []string
	applyErr  error
	removeErr error
	// onApply, when set, runs as Apply begins.
	onApply func()
	// installed holds each namespace's rules, by namespace identity.
	installed map[string]*fakeRules
}

// fakeRules is one namespace's rules.
type fakeRules struct {
	cfg   ruleset.PodConfig
	drift []ruleset.DriftItem // injected by dropRule
}

func newRecordedRules() *recordedRules {
	return &recordedRules{installed: map[string]*fakeRules{}}
}

// nsKey names the namespace path opens, whatever path reaches it (a held
// handle's /proc/<pid>/fd/<n>, say).
func nsKey(path string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return "", fmt.Errorf("netns %s: %w", path, err)
	}
	return fmt.Sprintf("netns:%d:%d", st.Dev, st.Ino), nil
}

// record notes op and checks path; a non-nil error ends the operation.
func (r *recordedRules) record(op, path string, injected error) (string, error) {
	r.mu.Lock()
	r.calls = append(r.calls, op)
	r.mu.Unlock()
	if injected != nil {
		return "", injected
	}
	n, err := netns.Open(path)
	if err != nil {
		return "", err
	}
	if err := n.Close(); err != nil {
		return "", err
	}
	return nsKey(path)
}

func (r *recordedRules) Apply(path string, cfg ruleset.PodConfig) error {
	r.mu.Lock()
	onApply := r.onApply
	r.mu.Unlock()
	if onApply != nil {
		onApply()
	}
	k, err := r.record("apply", path, r.injected(&r.applyErr))
	if err != nil {
		return err
	}
	return r.put(k, cfg)
}

// seed installs rules as a previous agent left them, unrecorded.
func (r *recordedRules) seed(path string, cfg ruleset.PodConfig) error {
	k, err := nsKey(path)
	if err != nil {
		return err
	}
	return r.put(k, cfg)
}

func (r *recordedRules) put(k string, cfg ruleset.PodConfig) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.installed[k] = &fakeRules{cfg: cfg.WithDefaults()}
	return nil
}

func (r *recordedRules) Verify(path string, cfg ruleset.PodConfig) (ruleset.Drift, error) {
	k, err := r.record("verify", path, nil)
	if err != nil {
		return ruleset.Drift{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	in, ok := r.installed[k]
	switch {
	case !ok:
		return ruleset.Drift{Items: []ruleset.DriftItem{{Kind: ruleset.DriftMissing, Object: "chain", Table: "nat", Chain: "ISTIO_OUTPUT"}}}, nil
	case !reflect.DeepEqual(in.cfg, cfg.WithDefaults()):
		return ruleset.Drift{Items: []ruleset.DriftItem{{Kind: ruleset.DriftChanged, Object: "rule", Table: "nat", Chain: "ISTIO_OUTPUT"}}}, nil
	}
	return ruleset.Drift{Items: slices.Clone(in.drift)}, nil
}

func (r *recordedRules) Remove(path string) error {
	k, err := r.record("remove", path, r.injected(&r.removeErr))
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.installed, k)
	return nil
}

func (r *recordedRules) injected(e *error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return *e
}

func (r *recordedRules) setApplyErr(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applyErr = err
}

func (r *recordedRules) ops() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.calls, ",")
}

// count is how many namespaces hold rules.
func (r *recordedRules) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.installed)
}

// populated reports whether the namespace at path holds rules.
func (r *recordedRules) populated(path string) bool {
	k, err := nsKey(path)
	if err != nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.installed[k]
	return ok
}

// dropRule makes the rules of the namespace at path lack a rule of a nat
// chain, as another program deleting it would: drift, until the next
// Apply.
func (r *recordedRules) dropRule(t *testing.T, path, chain string) {
	t.Helper()
	k, err := nsKey(path)
	if err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	in, ok := r.installed[k]
	if !ok {
		t.Fatalf("no rules in %s", path)
	}
	in.drift = append(in.drift, ruleset.DriftItem{Kind: ruleset.DriftMissing, Object: "rule", Table: "nat", Chain: chain})
}

// fakeZtunnel records ZDS calls; onDel, when set, runs at every Del
// (before it is recorded).
type fakeZtunnel struct {
	mu     sync.Mutex
	adds   []zds.Workload
	dels   []string
	addErr error
	onDel  func(uid string)
}

func (z *fakeZtunnel) Add(_ context.Context, w zds.Workload) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	if w.Netns == nil {
		return errors.New("no netns")
	}
	if _, err := w.Netns.Stat(); err != nil {
		return err
	}
	if z.addErr != nil {
		return z.addErr
	}
	z.adds = append(z.adds, w)
	return nil
}

func (z *fakeZtunnel) Del(_ context.Context, uid string) error {
	return z.DelNoWait(uid)
}

func (z *fakeZtunnel) DelNoWait(uid string) error {
	z.mu.Lock()
	onDel := z.onDel
	z.mu.Unlock()
	if onDel != nil {
		onDel(uid)
	}
	z.mu.Lock()
	defer z.mu.Unlock()
	z.dels = append(z.dels, uid)
	return nil
}

func (z *fakeZtunnel) delLog() string {
	z.mu.Lock()
	defer z.mu.Unlock()
	return strings.Join(z.dels, ",")
}

func (z *fakeZtunnel) setAddErr(err error) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.addErr = err
}

// fakeAnnotator records annotation writes; with err set it fails them,
// and hold makes every write wait until release.
type fakeAnnotator struct {
	mu     sync.Mutex
	values map[types.UID][]string
	tries  map[types.UID]int
	err    error
	gate   chan struct{}
	// onWrite, when set, is told about every successful write.
	onWrite func(namespace, name string, uid types.UID, value string)
}

func (a *fakeAnnotator) SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error {
	a.mu.Lock()
	if a.tries == nil {
		a.tries = map[types.UID]int{}
	}
	a.tries[uid]++
	gate := a.gate
	a.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	a.mu.Lock()
	if a.err != nil {
		err := a.err
		a.mu.Unlock()
		return err
	}
	if a.values == nil {
		a.values = map[types.UID][]string{}
	}
	a.values[uid] = append(a.values[uid], value)
	onWrite := a.onWrite
	a.mu.Unlock()
	if onWrite != nil {
		onWrite(namespace, name, uid, value)
	}
	return nil
}

// TestAnnotatorWriteLeavesDeletedPodGone: the harness carries the
// annotator's writes to the pod object as the agent's uid-preconditioned
// patch would, so a write that races the pod's delete fails rather than
// creating the pod again (which left a test waiting for a delete the
// cache then never showed).
func TestAnnotatorWriteLeavesDeletedPodGone(t *testing.T) {
	h := newHarness(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	pods := corev1.SchemeGroupVersion.WithResource("pods")
	// The delete lands after the write has read the pod, before it writes.
	var once sync.Once
	h.kube.Client.PrependReactor("*", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetVerb() != "update" && a.GetVerb() != "patch" {
			return false, nil, nil
		}
		once.Do(func() {
			if err := h.kube.Client.Tracker().Delete(pods, "shop", "web"); err != nil {
				t.Errorf("delete the pod: %v", err)
			}
		})
		return false, nil, nil
	})
	_ = h.ann.SetRedirection(context.Background(), "shop", "web", "u1", ambient.RedirectionEnabled)
	if _, err := h.kube.Client.Tracker().Get(pods, "shop", "web"); !apierrors.IsNotFound(err) {
		t.Fatalf("after a write that raced its delete the pod is in the API server again (get: %v)", err)
	}
}

func (a *fakeAnnotator) history(uid types.UID) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return strings.Join(a.values[uid], ",")
}

// attempts counts the writes tried for uid, failed ones included.
func (a *fakeAnnotator) attempts(uid types.UID) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.tries[uid]
}

func (a *fakeAnnotator) setErr(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.err = err
}

func (a *fakeAnnotator) hold() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.gate = make(chan struct{})
}

func (a *fakeAnnotator) release() {
	a.mu.Lock()
	defer a.mu.Unlock()
	close(a.gate)
	a.gate = nil
}

func pod(ns, name, uid string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), Labels: labels},
		Spec:       corev1.PodSpec{ServiceAccountName: "sa-" + name},
	}
}

func namespace(name string, ambientOn bool) *corev1.Namespace {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if ambientOn {
		ns.Labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	}
	return ns
}

// addCount is how many Adds ztunnel got for uid.
func (z *fakeZtunnel) addCount(uid string) int {
	z.mu.Lock()
	defer z.mu.Unlock()
	n := 0
	for _, w := range z.adds {
		if w.UID == uid {
			n++
		}
	}
	return n
}
