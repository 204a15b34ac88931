package podcache_test

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"

	"github.com/google/go-cmp/cmp"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
)

func pod(ns, name, uid string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), Labels: labels}}
}

func namespace(name string, ambientOn bool) *corev1.Namespace {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if ambientOn {
		ns.Labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	}
	return ns
}

// recorder keeps the cache's notifications.
type recorder struct {
	mu         sync.Mutex
	changed    []string
	enablement int
}

func (r *recorder) onChange(k types.NamespacedName) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.changed = append(r.changed, k.String())
}

func (r *recorder) onEnablement() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.enablement++
}

func (r *recorder) state() ([]string, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.changed), r.enablement
}

func TestDecide(t *testing.T) {
	self := types.NamespacedName{Namespace: "istio-system", Name: "ambient-cni-x1"}
	policy := enablement.DefaultPolicy()
	policy.Self = self
	k := fakecluster.New(t, podcache.Config{Policy: policy})
	k.Start()
	ctx := context.Background()
	k.SetNamespace(namespace("shop", true))
	k.SetNamespace(namespace("kube-system", true))
	k.SetNamespace(namespace("istio-system", true))
	k.SetPod(pod("shop", "a", "u-a", nil))
	k.SetPod(pod("kube-system", "dns", "u-dns", nil))
	k.SetPod(pod(self.Namespace, self.Name, "u-self", nil))

	for _, tc := range []struct {
		ns, name, uid string // uid "" asks without one
		podUID        types.UID
		want          enablement.Decision
	}{
		{"shop", "a", "u-a", "u-a", enablement.Decision{Enroll: true, Reason: enablement.ReasonNamespaceLabel, Selector: 2}},
		{"kube-system", "dns", "", "u-dns", enablement.Decision{Enroll: false, Reason: enablement.ReasonExcludedNamespace}},
		{self.Namespace, self.Name, "", "u-self", enablement.Decision{Enroll: false, Reason: enablement.ReasonDataPlanePod}},
	} {
		dec, p, err := k.Cache.Decide(ctx, tc.ns, tc.name, tc.uid)
		if err != nil {
			t.Errorf("%s/%s: %v", tc.ns, tc.name, err)
			continue
		}
		if diff := cmp.Diff(tc.want, dec); diff != "" || p.UID != tc.podUID {
			t.Errorf("%s/%s: pod uid %s, decision (-want +got):\n%s", tc.ns, tc.name, p.UID, diff)
		}
	}
	if _, _, err := k.Cache.Decide(ctx, "shop", "a", "other"); err == nil {
		t.Errorf("uid mismatch accepted")
	}
	if _, _, err := k.Cache.Decide(ctx, "shop", "missing", ""); err == nil {
		t.Errorf("unknown pod accepted")
	}
	if en, pl := k.Cache.EnablementState(); strings.Join(en, ",") != "istio-system,shop" || pl {
		t.Errorf("enablement %v %v (excluded namespaces are never enabled)", en, pl)
	}
	// The cached decision of the controller path agrees.
	p, err := k.Cache.Pod("shop", "a")
	if err != nil {
		t.Fatal(err)
	}
	if dec := k.Cache.DecideCached(p); !dec.Enroll || dec.Reason != enablement.ReasonNamespaceLabel {
		t.Errorf("cached decision %+v", dec)
	}
}

// TestDecideMissesGoToTheAPI: a pod the runtime starts before the cache
// heard of it (or a stale entry under another UID) is read from the API.
func TestDecideMissesGoToTheAPI(t *testing.T) {
	k := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	k.Start()
	ctx := context.Background()
	// Straight to the API, not awaited: the cache may not have it yet.
	if _, err := k.Client.CoreV1().Namespaces().Create(ctx, namespace("fresh", true), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := pod("fresh", "new", "u-new", nil)
	p.Spec.NodeName = fakecluster.NodeName
	if _, err := k.Client.CoreV1().Pods("fresh").Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if dec, got, err := k.Cache.Decide(ctx, "fresh", "new", "u-new"); err != nil || !dec.Enroll || got.UID != "u-new" {
		t.Errorf("fresh/new: %+v %v", dec, err)
	}
	// Recreated under the same name: the runtime's UID wins over the cache.
	k.SetPod(pod("fresh", "re", "u-old", nil))
	if err := k.Client.CoreV1().Pods("fresh").Delete(ctx, "re", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	re := pod("fresh", "re", "u-new2", nil)
	re.Spec.NodeName = fakecluster.NodeName
	if _, err := k.Client.CoreV1().Pods("fresh").Create(ctx, re, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if dec, got, err := k.Cache.Decide(ctx, "fresh", "re", "u-new2"); err != nil || !dec.Enroll || got.UID != "u-new2" {
		t.Errorf("fresh/re: %+v %v", dec, err)
	}
}

func TestNotifications(t *testing.T) {
	k := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	var r recorder
	k.Cache.OnChange(r.onChange)
	k.Cache.OnEnablementChange(r.onEnablement)
	k.Start()
	k.SetNamespace(namespace("shop", false))
	poll.Until(t, "namespace add notified", func() bool { _, n := r.state(); return n == 1 })
	k.SetPod(pod("shop", "a", "u-a", nil))
	k.SetPod(pod("shop", "b", "u-b", nil))
	poll.Until(t, "pod adds notified", func() bool { c, _ := r.state(); return len(c) == 2 })
	// A label flip of the namespace touches every pod in it.
	k.SetNamespace(namespace("shop", true))
	poll.Until(t, "namespace label flip notified", func() bool {
		c, n := r.state()
		return n == 2 && len(c) == 4
	})
	// A namespace update that keeps the label is no change.
	ns := namespace("shop", true)
	ns.Annotations = map[string]string{"x": "y"}
	k.SetNamespace(ns)
	// A pod labelled ambient may change pod-level enablement.
	k.SetPod(pod("shop", "c", "u-c", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}))
	k.DeletePod("shop", "a")
	poll.Until(t, "pod change and delete notified", func() bool { c, _ := r.state(); return len(c) == 6 })
	changed, n := r.state()
	if n != 3 {
		t.Errorf("enablement notified %d times, want 3 (namespace add, label flip, labelled pod)", n)
	}
	slices.Sort(changed[2:4])
	if want := "shop/a,shop/b,shop/a,shop/b,shop/c,shop/a"; strings.Join(changed, ",") != want {
		t.Errorf("changes %v, want %s", changed, want)
	}
}

func TestPodLevelEnablement(t *testing.T) {
	k2 := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	k2.Start()
	if _, pl := k2.Cache.EnablementState(); pl {
		t.Error("pod-level enablement with no pod using it")
	}
	k2.SetPod(pod("plain", "solo", "u5", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}))
	if _, pl := k2.Cache.EnablementState(); !pl {
		t.Error("a pod labelled outside an enabled namespace is pod-level enablement")
	}
}

// TestCacheDropsManagedFields: the cache keeps pods and namespaces without
// their managedFields (memory: often the larger part of an object).
func TestCacheDropsManagedFields(t *testing.T) {
	kube := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	mf := []metav1.ManagedFieldsEntry{{Manager: "kubelet", Operation: metav1.ManagedFieldsOperationUpdate}}
	p := pod("shop", "web", "u1", nil)
	p.ManagedFields = mf
	ns := namespace("shop", true)
	ns.ManagedFields = mf
	kube.Seed(p, ns)
	kube.Start()
	got, err := kube.Cache.Pod("shop", "web")
	if err != nil {
		t.Fatal(err)
	}
	gotNS, err := kube.Cache.Namespace("shop")
	if err != nil {
		t.Fatal(err)
	}
	if got.ManagedFields != nil || gotNS.ManagedFields != nil {
		t.Errorf("managedFields kept: pod %v, namespace %v", got.ManagedFields, gotNS.ManagedFields)
	}
}

// TestSelectorsDriveTheSnapshotState: with a list of its own, the enabled
// namespaces are those its namespace selectors match, pod-level enablement
// is a pod matched by an entry for every namespace, and a namespace label
// the list reads (not the dataplane-mode one) notifies.
func TestSelectorsDriveTheSnapshotState(t *testing.T) {
	sel, err := enablement.ParseSelectors([]byte(`[{namespaceSelector: {matchLabels: {mesh: "yes"}}}, {podSelector: {matchLabels: {team: pay}}}]`))
	if err != nil {
		t.Fatal(err)
	}
	policy := enablement.DefaultPolicy()
	policy.Selectors = sel
	k := fakecluster.New(t, podcache.Config{Policy: policy})
	var r recorder
	k.Cache.OnEnablementChange(r.onEnablement)
	k.Start()
	mesh := namespace("shop", false)
	k.SetNamespace(mesh)
	k.SetNamespace(namespace("blog", true))
	poll.Until(t, "namespace adds notified", func() bool { _, n := r.state(); return n == 2 })
	mesh = mesh.DeepCopy()
	mesh.Labels = map[string]string{"mesh": "yes"}
	k.SetNamespace(mesh)
	poll.Until(t, "the selected label notified", func() bool { _, n := r.state(); return n == 3 })
	poll.Until(t, "shop enabled", func() bool {
		en, pl := k.Cache.EnablementState()
		return strings.Join(en, ",") == "shop" && !pl
	})
	k.SetPod(pod("blog", "p", "u-p", map[string]string{"team": "pay"}))
	poll.Until(t, "pod-level enablement", func() bool { _, pl := k.Cache.EnablementState(); return pl })
	if dec := k.Cache.DecideCached(pod("blog", "q", "u-q", nil)); dec.Enroll {
		t.Errorf("a namespace labelled the default way is enabled under a list of its own: %+v", dec)
	}
}

// TestCacheKeepsTheNamespaceLabelsDecisionsRead: through the informer, a
// namespace's cached copy holds the labels the configured selectors read
// and the dataplane-mode label, not its other labels or annotations, and
// it still decides its pods.
func TestCacheKeepsTheNamespaceLabelsDecisionsRead(t *testing.T) {
	sel, err := enablement.ParseSelectors([]byte(`[{namespaceSelector: {matchLabels: {mesh: "yes"}}}]`))
	if err != nil {
		t.Fatal(err)
	}
	policy := enablement.DefaultPolicy()
	policy.Selectors = sel
	k := fakecluster.New(t, podcache.Config{Policy: policy})
	ns := namespace("shop", true)
	ns.Labels["mesh"] = "yes"
	ns.Labels["team"] = "pay"
	ns.Annotations = map[string]string{"big": strings.Repeat("z", 256<<10)}
	k.Seed(ns)
	k.Start()
	got, err := k.Cache.Namespace("shop")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"mesh": "yes", ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	if !maps.Equal(got.Labels, want) || got.Annotations != nil {
		t.Errorf("cached namespace labels %v annotations %d, want labels %v and no annotations", got.Labels, len(got.Annotations), want)
	}
	if d := k.Cache.DecideCached(pod("shop", "web", "u1", nil)); !d.Enroll {
		t.Errorf("a pod of the selected namespace: %+v", d)
	}
}

// eventCounter counts OnEvent calls by type.
type eventCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *eventCounter) on(e string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[e]++
}

func (c *eventCounter) get() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.n)
}

// OnEvent sees every informer event of this node's pods and of namespaces,
// by type, as istio-cni's nodeagent_reconcile_events_total counts them:
// namespace updates that change nothing for enablement included.
func TestEventsCounted(t *testing.T) {
	c := &eventCounter{n: map[string]int{}}
	k := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy(), OnEvent: c.on})
	k.Start()
	k.SetNamespace(namespace("shop", false))
	k.SetPod(pod("shop", "a", "u-a", nil))
	ns := namespace("shop", false)
	ns.Annotations = map[string]string{"x": "y"}
	k.SetNamespace(ns)
	k.DeletePod("shop", "a")
	want := map[string]int{"add": 2, "update": 1, "delete": 1}
	poll.Until(t, "events counted", func() bool { return maps.Equal(c.get(), want) })
}

// TestLastListErrorNotesFailedLists: a list the API server fails is
// noted (what start-up liveness reads as "waiting on the API server"),
// and the cache still syncs once lists succeed; a cache whose lists
// never failed notes nothing.
func TestLastListErrorNotesFailedLists(t *testing.T) {
	k := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	var failures atomic.Int32
	k.Client.PrependReactor("list", "namespaces", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failures.Add(1) <= 1 {
			return true, nil, apierrors.NewTooManyRequests("overloaded", 1)
		}
		return false, nil, nil
	})
	k.Start()
	if k.Cache.LastListError().IsZero() {
		t.Error("a failed namespace list was not noted")
	}

	ok := fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	ok.Start()
	if at := ok.Cache.LastListError(); !at.IsZero() {
		t.Errorf("a cache whose lists succeeded noted a failure at %v", at)
	}
}
