// Package controller follows the cluster for the node agent: it watches the
// pods bound to this node and all namespaces, applies the enablement policy,
// and enrolls or unenrolls running pods through the same Enroller the CNI
// path uses. Netns discovery for running pods is batched: one /proc scan
// serves every pod that a burst of changes (a namespace label flip) queued.
package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// Enroller is the node agent's one way in: the CNI path and this controller
// call the same functions.
type Enroller interface {
	// Enroll captures pod, whose network namespace is at netnsPath: rules,
	// ztunnel handoff (waits for the ack), status annotation. Idempotent.
	Enroll(ctx context.Context, pod *corev1.Pod, netnsPath string) error
	// Restore adopts a pod that was enrolled before the agent restarted:
	// verify (and repair only on drift) its rules and add it to the state the
	// ZDS snapshot is built from, without a separate ztunnel Add.
	Restore(ctx context.Context, pod *corev1.Pod, netnsPath string) error
	// Unenroll removes capture for uid; the netns may already be gone.
	Unenroll(ctx context.Context, uid types.UID) error
	// EnrolledUID reports the UID enrolled under namespace/name, if any.
	EnrolledUID(namespace, name string) (types.UID, bool)
	// Pending reports whether uid is in the state with its rules in place
	// but ztunnel has not acknowledged it yet (a failed handoff): the pod
	// stays captured (fail closed) and the controller retries the enroll.
	Pending(uid types.UID) bool
}

// Finder locates running pods' network namespaces.
type Finder interface {
	// Find returns a held netns per pod UID it could locate and confirm
	// (one of the pod's IPs is on an interface there). One call is one
	// scan. The caller closes every returned namespace.
	Find(pods map[types.UID][]netip.Addr) (map[types.UID]podnetns.Found, error)
}

// Config configures a Controller.
type Config struct {
	Client   kubernetes.Interface
	NodeName string
	Policy   enablement.Policy
	// Self is the agent's own pod, never enrolled.
	Self     types.NamespacedName
	Enroller Enroller
	Finder   Finder
	// Annotator clears a stale redirection annotation from a pod that is
	// not enrolled and should not be (e.g. its namespace was unlabelled
	// while the agent was down); nil leaves such annotations alone.
	Annotator interface {
		SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error
	}
	Logger *slog.Logger
	// Parallel bounds concurrent Enroll/Unenroll calls within a batch.
	Parallel int
	// BatchWindow is how long the worker lets a burst of changes gather
	// before it scans /proc once for all of them.
	BatchWindow time.Duration
	// OnEnablementChange is called (from the informer goroutine) whenever
	// the set of enabled namespaces or pod-level enablement may have changed.
	OnEnablementChange func()
	// OnScan, when set, is told about every /proc scan: how many pods it
	// looked for, how many it found, and how long it took.
	OnScan func(pods, found int, took time.Duration)
	// AssumePodLevelEnablement makes EnablementState report pod-level
	// enablement even when no pod on this node uses it yet.
	AssumePodLevelEnablement bool
}

// Controller is the pod controller. Create it with New, then Run it.
type Controller struct {
	cfg    Config
	log    *slog.Logger
	queue  workqueue.TypedRateLimitingInterface[types.NamespacedName]
	pods   listerscorev1.PodLister
	nss    listerscorev1.NamespaceLister
	synced []cache.InformerSynced
	start  func(stop <-chan struct{})

	restored chan struct{} // closed once startup restore is done
}

// New builds the informers and queue; nothing runs until Run.
func New(cfg Config) *Controller {
	if cfg.Parallel <= 0 {
		cfg.Parallel = 8
	}
	if cfg.BatchWindow <= 0 {
		cfg.BatchWindow = 20 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c := &Controller{
		cfg: cfg,
		log: cfg.Logger.With("component", "pod-controller"),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](200*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[types.NamespacedName]{Name: "pods"}),
		restored: make(chan struct{}),
	}
	podFactory := informers.NewSharedInformerFactoryWithOptions(cfg.Client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName).String()
		}))
	nsFactory := informers.NewSharedInformerFactory(cfg.Client, 0)
	podInf := podFactory.Core().V1().Pods()
	nsInf := nsFactory.Core().V1().Namespaces()
	c.pods, c.nss = podInf.Lister(), nsInf.Lister()
	c.synced = []cache.InformerSynced{podInf.Informer().HasSynced, nsInf.Informer().HasSynced}

	_, _ = podInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { c.enqueuePod(o) },
		UpdateFunc: func(_, o any) { c.enqueuePod(o) },
		DeleteFunc: func(o any) { c.enqueuePod(o) },
	})
	_, _ = nsInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(o any) { c.enqueueNamespace(o) },
		UpdateFunc: func(old, o any) {
			if nsLabel(old) != nsLabel(o) {
				c.enqueueNamespace(o)
			}
		},
		DeleteFunc: func(o any) { c.enqueueNamespace(o) },
	})
	c.start = func(stop <-chan struct{}) {
		podFactory.Start(stop)
		nsFactory.Start(stop)
	}
	return c
}

func nsLabel(o any) string {
	if n, ok := o.(*corev1.Namespace); ok {
		return n.Labels[ambient.DataplaneModeLabel]
	}
	return ""
}

func (c *Controller) enqueuePod(o any) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	if c.cfg.OnEnablementChange != nil && p.Labels[ambient.DataplaneModeLabel] == ambient.DataplaneModeAmbient {
		c.cfg.OnEnablementChange()
	}
}

func (c *Controller) enqueueNamespace(o any) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	n, ok := o.(*corev1.Namespace)
	if !ok {
		return
	}
	pods, err := c.pods.Pods(n.Name).List(labels.Everything())
	if err != nil {
		c.log.Warn("list pods of namespace", "namespace", n.Name, "err", err)
	}
	for _, p := range pods {
		c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	}
	if c.cfg.OnEnablementChange != nil {
		c.cfg.OnEnablementChange()
	}
}

// Run starts the informers, restores pods enrolled before a restart, then
// reconciles until ctx ends. It returns after its goroutines stop.
func (c *Controller) Run(ctx context.Context) error {
	defer c.queue.ShutDown()
	c.start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		return fmt.Errorf("pod controller: informer caches did not sync: %w", ctx.Err())
	}
	c.restore(ctx)
	close(c.restored)
	if c.cfg.OnEnablementChange != nil {
		c.cfg.OnEnablementChange()
	}

	var wg sync.WaitGroup
	wg.Go(func() {
		<-ctx.Done()
		c.queue.ShutDown()
	})
	for c.processBatch(ctx) {
	}
	wg.Wait()
	return nil
}

// Restored is closed once the pods enrolled before a restart are back in
// the agent's state; the ZDS snapshot and readiness wait for it.
func (c *Controller) Restored() <-chan struct{} { return c.restored }

// HasSynced reports whether the informer caches are filled.
func (c *Controller) HasSynced() bool {
	for _, s := range c.synced {
		if !s() {
			return false
		}
	}
	return true
}

// restore adopts pods this node's agent had enrolled (annotated pending or
// enabled) and that should still be, before any ztunnel gets a snapshot.
func (c *Controller) restore(ctx context.Context) {
	all, err := c.pods.List(labels.Everything())
	if err != nil {
		c.log.Error("list pods for restore", "err", err)
		return
	}
	want := map[types.UID][]netip.Addr{}
	byUID := map[types.UID]*corev1.Pod{}
	for _, p := range all {
		// Adopt every pod a previous agent marked, even one that should no
		// longer be captured (unlabelled while the agent was down): once in
		// the state, the normal reconcile unenrolls it properly.
		if redirectionState(p) == "" || enablement.IsTerminal(p) {
			continue
		}
		want[p.UID] = enablement.PodIPs(p)
		byUID[p.UID] = p
	}
	if len(want) == 0 {
		return
	}
	found, err := c.find(want)
	if err != nil {
		c.log.Error("find netns of enrolled pods", "err", err)
	}
	defer podnetns.CloseAll(found) // those not handed over (closing twice is harmless)
	start := time.Now()
	parallel(ctx, c.cfg.Parallel, keys(byUID), func(uid types.UID) {
		p := byUID[uid]
		ns, ok := found[uid]
		if !ok {
			// Requeue: the normal path enrolls it (or clears its annotation).
			c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
			return
		}
		err := c.cfg.Enroller.Restore(ctx, p, heldPath(ns))
		_ = ns.Close() // the Enroller holds its own handle now
		if err != nil {
			c.log.Error("restore enrolled pod", "pod", p.Namespace+"/"+p.Name, "err", err)
			c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	})
	c.log.Info("restored enrolled pods", "pods", len(found), "of", len(want), "took", time.Since(start))
}

func keys[K comparable, V any](m map[K]V) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// parallel runs f over items with at most n at a time.
func parallel[T any](ctx context.Context, n int, items []T, f func(T)) {
	sem := make(chan struct{}, n)
	var wg sync.WaitGroup
	for _, it := range items {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			f(it)
		})
	}
	wg.Wait()
}

// decide applies the policy with the pod's namespace from the cache.
func (c *Controller) decide(p *corev1.Pod) enablement.Decision {
	if p.Namespace == c.cfg.Self.Namespace && p.Name == c.cfg.Self.Name {
		return enablement.Decision{Enroll: false, Reason: enablement.ReasonDataPlanePod}
	}
	ns, _ := c.nss.Get(p.Namespace)
	return c.cfg.Policy.Decide(p, ns)
}

type work struct {
	key   types.NamespacedName
	pod   *corev1.Pod // nil when deleted
	uid   types.UID   // enrolled UID to remove, if any
	need  bool        // needs enrolling (netns lookup)
	clear bool        // not enrolled, not wanted, but still annotated
}

// processBatch takes one queued key, lets a burst gather for BatchWindow,
// drains the queue, scans /proc once for every pod that needs enrolling and
// then enrolls and unenrolls in parallel. It returns false on shutdown.
func (c *Controller) processBatch(ctx context.Context) bool {
	first, quit := c.queue.Get()
	if quit {
		return false
	}
	batch := []types.NamespacedName{first}
	select {
	case <-time.After(c.cfg.BatchWindow):
	case <-ctx.Done():
	}
	for c.queue.Len() > 0 {
		k, quit := c.queue.Get()
		if quit {
			break
		}
		batch = append(batch, k)
	}
	defer func() {
		for _, k := range batch {
			c.queue.Done(k)
		}
	}()

	works := make([]work, 0, len(batch))
	want := map[types.UID][]netip.Addr{}
	for _, k := range batch {
		w := c.plan(k)
		if w.need {
			want[w.pod.UID] = enablement.PodIPs(w.pod)
		}
		works = append(works, w)
	}
	var found map[types.UID]podnetns.Found
	if len(want) > 0 {
		var err error
		if found, err = c.find(want); err != nil {
			c.log.Error("scan for pod netns", "pods", len(want), "err", err)
		}
		defer podnetns.CloseAll(found) // those not handed over (closing twice is harmless)
	}
	parallel(ctx, c.cfg.Parallel, works, func(w work) {
		if err := c.apply(ctx, w, found); err != nil {
			c.log.Warn("reconcile pod", "pod", w.key.String(), "err", err)
			c.queue.AddRateLimited(w.key)
			return
		}
		c.queue.Forget(w.key)
	})
	return true
}

// find runs one netns scan for every pod in want.
func (c *Controller) find(want map[types.UID][]netip.Addr) (map[types.UID]podnetns.Found, error) {
	start := time.Now()
	found, err := c.cfg.Finder.Find(want)
	took := time.Since(start)
	c.log.Debug("scanned for pod netns", "pods", len(want), "found", len(found), "took", took)
	if c.cfg.OnScan != nil {
		c.cfg.OnScan(len(want), len(found), took)
	}
	return found, err
}

// plan decides what one key needs without side effects.
func (c *Controller) plan(k types.NamespacedName) work {
	w := work{key: k}
	enrolled, isEnrolled := c.cfg.Enroller.EnrolledUID(k.Namespace, k.Name)
	p, err := c.pods.Pods(k.Namespace).Get(k.Name)
	if err != nil {
		if isEnrolled {
			w.uid = enrolled // deleted while enrolled
		}
		return w
	}
	w.pod = p
	if isEnrolled && enrolled != p.UID {
		w.uid = enrolled // recreated under the same name: drop the old one
	}
	d := c.decide(p)
	switch {
	case d.Enroll && (!isEnrolled || enrolled != p.UID || c.cfg.Enroller.Pending(p.UID)):
		// A pod the CNI path is still setting up has no IP yet; its ADD
		// enrolls it, and its status update brings it back here.
		w.need = len(enablement.PodIPs(p)) > 0 && p.Status.Phase == corev1.PodRunning
	case !d.Enroll && isEnrolled && enrolled == p.UID:
		w.uid = enrolled
	case !d.Enroll && redirectionState(p) != "":
		w.clear = true
	}
	return w
}

// errNotFound marks a pod whose netns could not be located; it is retried.
var errNotFound = errors.New("netns not found")

func (c *Controller) apply(ctx context.Context, w work, found map[types.UID]podnetns.Found) error {
	if w.uid != "" {
		if err := c.cfg.Enroller.Unenroll(ctx, w.uid); err != nil {
			return fmt.Errorf("unenroll %s: %w", w.uid, err)
		}
		c.log.Info("unenrolled pod", "pod", w.key.String(), "uid", w.uid)
	}
	if w.clear && c.cfg.Annotator != nil {
		if err := c.cfg.Annotator.SetRedirection(ctx, w.pod.Namespace, w.pod.Name, w.pod.UID, ""); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("clear stale annotation: %w", err)
		}
		c.log.Info("cleared stale redirection annotation", "pod", w.key.String())
	}
	if !w.need {
		return nil
	}
	ns, ok := found[w.pod.UID]
	if !ok {
		return fmt.Errorf("pod %s (uid %s): %w", w.key, w.pod.UID, errNotFound)
	}
	err := c.cfg.Enroller.Enroll(ctx, w.pod, heldPath(ns))
	_ = ns.Close() // the Enroller holds its own handle now
	if err != nil {
		return fmt.Errorf("enroll: %w", err)
	}
	c.log.Info("enrolled running pod", "pod", w.key.String(), "uid", w.pod.UID)
	return nil
}

// Decide answers the CNI path: the enablement decision for a pod the
// runtime is starting. It reads the informer cache and, on a miss (or a
// stale entry with another UID), the API server once.
func (c *Controller) Decide(ctx context.Context, namespace, name, uid string) (enablement.Decision, *corev1.Pod, error) {
	p, err := c.pods.Pods(namespace).Get(name)
	if err != nil || (uid != "" && string(p.UID) != uid) {
		p, err = c.cfg.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return enablement.Decision{}, nil, fmt.Errorf("get pod %s/%s: %w", namespace, name, err)
		}
		if uid != "" && string(p.UID) != uid {
			return enablement.Decision{}, nil, fmt.Errorf("pod %s/%s has uid %s, runtime asked for %s", namespace, name, p.UID, uid)
		}
	}
	ns, err := c.nss.Get(namespace)
	if apierrors.IsNotFound(err) {
		if ns, err = c.cfg.Client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{}); err != nil {
			return enablement.Decision{}, nil, fmt.Errorf("get namespace %s: %w", namespace, err)
		}
	}
	if p.Namespace == c.cfg.Self.Namespace && p.Name == c.cfg.Self.Name {
		return enablement.Decision{Enroll: false, Reason: enablement.ReasonDataPlanePod}, p, nil
	}
	return c.cfg.Policy.Decide(p, ns), p, nil
}

// EnablementState is what the plugin's fallback snapshot needs: enabled
// namespaces, and whether any pod on this node is enabled by its own label
// outside them (or the operator said to assume so).
func (c *Controller) EnablementState() (enabled []string, podLevel bool) {
	nss, _ := c.nss.List(labels.Everything())
	for _, n := range nss {
		if enablement.NamespaceEnabled(n) && !c.cfg.Policy.IsExcludedNamespace(n.Name) {
			enabled = append(enabled, n.Name)
		}
	}
	slices.Sort(enabled)
	podLevel = c.cfg.AssumePodLevelEnablement
	if !podLevel {
		pods, _ := c.pods.List(labels.Everything())
		for _, p := range pods {
			if p.Labels[ambient.DataplaneModeLabel] == ambient.DataplaneModeAmbient && !slices.Contains(enabled, p.Namespace) {
				podLevel = true
				break
			}
		}
	}
	return enabled, podLevel
}
