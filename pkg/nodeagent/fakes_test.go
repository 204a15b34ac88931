package nodeagent

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// recordedRules is the real rule applier over iptables.Fake, the package's
// in-memory stand-in for a namespace's iptables and routing (the applier
// against real iptables is exercised in the root tests of test/cni and
// pkg/iptables). It records which operations the agent asked for, can
// inject a failure, and checks every path it gets is an open network
// namespace, as the real executor would need.
type recordedRules struct {
	real *iptables.Applier
	fake *iptables.Fake

	mu        sync.Mutex
	calls     []string
	applyErr  error
	removeErr error
}

func newRecordedRules() *recordedRules {
	fake := iptables.NewFake(iptables.BackendNFT)
	return &recordedRules{fake: fake, real: iptables.NewApplier(nil, iptables.BackendNFT, iptables.WithExecutor(fake), iptables.WithRouter(fake), iptables.WithTableOwner(fake))}
}

// record notes op and checks path; a non-nil error ends the operation.
func (r *recordedRules) record(op, path string, injected error) error {
	r.mu.Lock()
	r.calls = append(r.calls, op)
	r.mu.Unlock()
	if injected != nil {
		return injected
	}
	n, err := netns.Open(path)
	if err != nil {
		return err
	}
	return n.Close()
}

func (r *recordedRules) Apply(path string, cfg iptables.PodConfig) error {
	if err := r.record("apply", path, r.injected(&r.applyErr)); err != nil {
		return err
	}
	return r.real.Apply(path, cfg)
}

func (r *recordedRules) Verify(path string, cfg iptables.PodConfig) (iptables.Drift, error) {
	if err := r.record("verify", path, nil); err != nil {
		return iptables.Drift{}, err
	}
	return r.real.Verify(path, cfg)
}

func (r *recordedRules) Remove(path string) error {
	if err := r.record("remove", path, r.injected(&r.removeErr)); err != nil {
		return err
	}
	return r.real.Remove(path)
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
func (r *recordedRules) count() int { return r.fake.Populated() }

// populated reports whether the namespace at path holds rules.
func (r *recordedRules) populated(path string) bool {
	return len(r.fake.Rules(path, iptables.IPv4).Tables)+len(r.fake.Rules(path, iptables.IPv6).Tables) > 0
}

// dropRule deletes the rule at position (1-based) of a nat chain in the
// namespace at path, as another program would: drift.
func (r *recordedRules) dropRule(t *testing.T, path, chain string, position int) {
	t.Helper()
	r.fake.EditRules(path, iptables.IPv4, func(s *iptables.Save) {
		c := s.Table(iptables.TableNAT).Chain(chain)
		if c == nil || len(c.Rules) < position {
			t.Fatalf("no rule #%d in nat %s:\n%s", position, chain, s)
		}
		c.Rules = append(c.Rules[:position-1], c.Rules[position:]...)
	})
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
