package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// fakeRules records rule operations; the real applier is exercised in the
// root tests of test/cni and pkg/iptables. It checks every path it gets
// is an open network namespace, as the real one would need.
type fakeRules struct {
	mu        sync.Mutex
	applied   map[string]iptables.PodConfig // netns inode → config
	calls     []string
	applyErr  error
	removeErr error
	drift     iptables.Drift
}

func newFakeRules() *fakeRules { return &fakeRules{applied: map[string]iptables.PodConfig{}} }

func (f *fakeRules) key(path string) (string, error) {
	n, err := OpenNetns(path)
	if err != nil {
		return "", err
	}
	defer n.Close()
	return fmt.Sprint(n.ID()), nil
}

func (f *fakeRules) Apply(path string, cfg iptables.PodConfig) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "apply")
	if f.applyErr != nil {
		return f.applyErr
	}
	k, err := f.key(path)
	if err != nil {
		return err
	}
	f.applied[k] = cfg
	return nil
}

func (f *fakeRules) Verify(path string, cfg iptables.PodConfig) (iptables.Drift, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "verify")
	if _, err := f.key(path); err != nil {
		return iptables.Drift{}, err
	}
	return f.drift, nil
}

func (f *fakeRules) Remove(path string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "remove")
	if f.removeErr != nil {
		return f.removeErr
	}
	k, err := f.key(path)
	if err != nil {
		return err
	}
	delete(f.applied, k)
	return nil
}

func (f *fakeRules) ops() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.calls, ",")
}

func (f *fakeRules) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.applied)
}

// fakeZtunnel records ZDS calls.
type fakeZtunnel struct {
	mu     sync.Mutex
	adds   []zds.Workload
	dels   []string
	addErr error
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
	z.mu.Lock()
	defer z.mu.Unlock()
	z.dels = append(z.dels, uid)
	return nil
}

// fakeAnnotator records annotation writes; with err set it fails them.
type fakeAnnotator struct {
	mu     sync.Mutex
	values map[types.UID][]string
	err    error
}

func (a *fakeAnnotator) SetRedirection(_ context.Context, _, _ string, uid types.UID, value string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err != nil {
		return a.err
	}
	if a.values == nil {
		a.values = map[types.UID][]string{}
	}
	a.values[uid] = append(a.values[uid], value)
	return nil
}

func (a *fakeAnnotator) history(uid types.UID) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return strings.Join(a.values[uid], ",")
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

// openFDs counts the test process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	des, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(des)
}
