// Package controller enrolls and unenrolls the pods that are already
// running on this node, for the node agent: it follows the pod cache's
// change notifications through a workqueue and, per batch of changed pods,
// decides with the pod cache, finds the network namespaces of the pods to
// capture with one /proc scan, and captures them through the same agent
// entry point the CNI path uses (or unenrolls them). At startup it restores
// the pods a previous agent enrolled before any ztunnel gets a snapshot.
package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
)

// Pods is the pod cache as the controller uses it (pkg/podcache.Cache).
type Pods interface {
	// OnChange registers f for every pod whose decision may have changed.
	OnChange(f func(pod types.NamespacedName))
	// WaitForSync blocks until the cache has listed once, or ctx ends.
	WaitForSync(ctx context.Context) error
	Pod(namespace, name string) (*corev1.Pod, error)
	Pods() ([]*corev1.Pod, error)
	// DecideCached applies the enablement policy to a cached pod.
	DecideCached(p *corev1.Pod) enablement.Decision
}

// Agent is the node agent as the controller uses it (*nodeagent.Agent).
// Capture, Restore and Release take ownership of the netns handle.
type Agent interface {
	Capture(ctx context.Context, pod *corev1.Pod, ns *netns.Handle, sb *nodeagent.Sandbox) error
	Restore(ctx context.Context, pod *corev1.Pod, ns *netns.Handle) error
	// RestoreUnresolved adopts a captured pod whose netns was not found;
	// Unresolved reports such a pod until it is captured or restored.
	RestoreUnresolved(pod *corev1.Pod)
	Unresolved(uid types.UID) bool
	// Release takes capture off a pod found captured at startup that
	// should not be.
	Release(ctx context.Context, pod *corev1.Pod, ns *netns.Handle) error
	// Unenroll removes capture from an enrolled (or only recorded) pod.
	Unenroll(ctx context.Context, uid types.UID) error
	// ClearStale removes the annotation of a pod the agent has nothing of.
	ClearStale(pod *corev1.Pod)
	// Records lists the pods the agent (or a previous one) recorded as
	// possibly captured.
	Records() []nodeagent.Record
	// EnrolledUID reports the UID enrolled (or recorded) under
	// namespace/name, if any.
	EnrolledUID(namespace, name string) (types.UID, bool)
	// Pending reports whether uid is captured but ztunnel has not
	// acknowledged it yet (a failed handoff), or only recorded: the
	// controller retries.
	Pending(uid types.UID) bool
	// SandboxReleased reports whether the runtime tore down uid's captured
	// sandbox (CNI DEL) and nothing captured it since.
	SandboxReleased(uid types.UID) bool
	// HoldAnnotations defers the annotation writes (bounded) until
	// release is called: a batch's captures go first.
	HoldAnnotations() (release func())
}

// Finder locates running pods' network namespaces (netns.Scanner).
type Finder interface {
	// Find returns an open netns handle per pod UID it could locate and
	// confirm (one of the pod's IPs is on an interface there); the caller
	// owns the handles. One call is one scan.
	Find(pods map[types.UID][]netip.Addr) (map[types.UID]*netns.Handle, error)
}

// Config configures a Controller. Pods, Agent and Finder are required.
type Config struct {
	Pods   Pods
	Agent  Agent
	Finder Finder
	// Events, when set, gets a Warning on the pod whenever capturing it
	// fails, so operators see why a pod is not captured, and once on a
	// sidecar pod that expects istio-cni (ReasonIstioCNIExpected).
	Events record.EventRecorder
	Logger *slog.Logger
	// Parallel bounds concurrent captures and unenrolls within a batch
	// (default 8).
	Parallel int
	// BatchWindow is how long the worker lets a burst of changes gather
	// before it scans /proc once for all of them (default 20ms).
	BatchWindow time.Duration
	// OnScan, when set, is told about every /proc scan: how many pods it
	// looked for, how many it found, and how long it took.
	OnScan func(pods, found int, took time.Duration)
}

// Controller is the pod controller. Create it with New, then Run it.
type Controller struct {
	cfg   Config
	log   *slog.Logger
	queue workqueue.TypedRateLimitingInterface[types.NamespacedName]

	synced   chan struct{} // closed once the pod cache synced (restore begins)
	restored chan struct{} // closed once startup restore is done

	// toldIstioCNI holds the pods already told that they expect istio-cni,
	// by name, so each is told once (a new pod under the name is told
	// again). Only the worker (processBatch) uses it.
	toldIstioCNI map[types.NamespacedName]types.UID
}

// ReasonIstioCNIExpected is the reason of the Warning Event on a sidecar
// pod injected for istio-cni's sidecar mode (enablement.ExpectsIstioCNI).
const ReasonIstioCNIExpected = "IstioCNIExpected"

// New builds the queue and subscribes it to the pod cache; nothing runs
// until Run.
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
		synced:       make(chan struct{}),
		restored:     make(chan struct{}),
		toldIstioCNI: map[types.NamespacedName]types.UID{},
	}
	cfg.Pods.OnChange(c.queue.Add)
	return c
}

// Run waits for the pod cache, restores pods enrolled before a restart,
// then reconciles until ctx ends. It returns after its goroutines stop.
func (c *Controller) Run(ctx context.Context) error {
	defer c.queue.ShutDown()
	if err := c.cfg.Pods.WaitForSync(ctx); err != nil {
		return fmt.Errorf("pod controller: %w", err)
	}
	close(c.synced)
	c.restore(ctx)
	close(c.restored)

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

// Requeue has the controller reconcile pod again, as a change of it
// would: the verifier hands it the pods it found uncaptured, so the
// controller's decision is the one that captures them.
func (c *Controller) Requeue(pod types.NamespacedName) { c.queue.Add(pod) }

// Synced is closed once the pod cache synced and the startup restore
// begins: start-up liveness times the two steps apart.
func (c *Controller) Synced() <-chan struct{} { return c.synced }

// Restored is closed once the pods enrolled before a restart are back in
// the agent's state; the ZDS snapshot and readiness wait for it.
func (c *Controller) Restored() <-chan struct{} { return c.restored }

// restore adopts the pods a previous agent captured, before any ztunnel
// gets a snapshot: those in the agent's capture records and those
// annotated pending or enabled (an older agent kept no records). A
// recorded pod whose object is gone (deleted while no agent ran) is
// cleaned through its record. A found pod that should still be captured
// is restored; one that should not any more is released. A pod whose netns
// is not found (or whose rules cannot be verified or released) is adopted
// unresolved, so ztunnel keeps it and its probe-set entry stays, and is
// requeued.
func (c *Controller) restore(ctx context.Context) {
	all, err := c.cfg.Pods.Pods()
	if err != nil {
		c.log.Error("list pods for restore", "err", err)
		return
	}
	cached := make(map[types.UID]*corev1.Pod, len(all))
	for _, p := range all {
		cached[p.UID] = p
	}
	want := map[types.UID][]netip.Addr{}
	byUID := map[types.UID]*corev1.Pod{}
	for _, r := range c.cfg.Agent.Records() {
		p := cached[r.UID]
		if p == nil {
			if err := c.cfg.Agent.Unenroll(ctx, r.UID); err != nil {
				c.log.Warn("clean recorded pod that is gone", "pod", r.Namespace+"/"+r.Name, "uid", r.UID, "err", err)
			}
			continue
		}
		if enablement.IsTerminal(p) {
			continue // the queue's reconcile unenrolls it
		}
		want[p.UID] = enablement.PodIPs(p)
		if len(want[p.UID]) == 0 {
			want[p.UID] = r.IPs
		}
		byUID[p.UID] = p
	}
	for _, p := range all {
		if redirectionState(p) == "" || enablement.IsTerminal(p) || byUID[p.UID] != nil {
			continue
		}
		want[p.UID] = enablement.PodIPs(p)
		byUID[p.UID] = p
	}
	if len(want) == 0 {
		return
	}
	found := c.find(want)
	defer found.closeRest()
	start := time.Now()
	parallel(ctx, c.cfg.Parallel, keys(byUID), func(uid types.UID) {
		p := byUID[uid]
		ns, ok := found.take(uid)
		if !ok {
			// Its traffic still goes to ztunnel: keep the pod there until the
			// normal path captures it again (or releases it).
			c.cfg.Agent.RestoreUnresolved(p)
			c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
			return
		}
		if d := c.cfg.Pods.DecideCached(p); !d.Enroll {
			if err := c.cfg.Agent.Release(ctx, p, ns); err != nil {
				c.log.Error("release pod captured before the restart", "pod", p.Namespace+"/"+p.Name, "reason", d.Reason, "err", err)
				// Its rules may still redirect it: ztunnel keeps it until
				// the reconcile finds it again and releases it in order.
				c.cfg.Agent.RestoreUnresolved(p)
				c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
			}
			return
		}
		if err := c.cfg.Agent.Restore(ctx, p, ns); err != nil {
			c.log.Error("restore enrolled pod", "pod", p.Namespace+"/"+p.Name, "err", err)
			c.cfg.Agent.RestoreUnresolved(p)
			c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	})
	c.log.Info("restored enrolled pods", "pods", found.n, "of", len(want), "took", time.Since(start))
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

type work struct {
	key   types.NamespacedName
	pod   *corev1.Pod // nil when deleted
	uid   types.UID   // enrolled UID to remove, if any
	need  bool        // needs capturing (netns lookup)
	clear bool        // not enrolled, not wanted, but still annotated
	// release: an unresolved pod that should no longer be captured but
	// still runs: find its netns, restore it, then unenroll it (uid), so
	// its rules go before ztunnel lets go of it.
	release bool
}

// processBatch takes one queued key, lets a burst gather for BatchWindow,
// drains the queue, decides on every key, scans /proc once for every pod
// that needs capturing, then captures and unenrolls in parallel. It
// returns false on shutdown.
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
		c.tellIstioCNIExpected(k, w.pod)
		if w.need {
			want[w.pod.UID] = enablement.PodIPs(w.pod)
		}
		works = append(works, w)
	}
	var found *handles
	if len(want) > 0 {
		// Every pod of the batch handed to ztunnel before the API writes
		// that tell of it: on a small node the writes and the API
		// server's work for them would take the cores the captures need.
		release := c.cfg.Agent.HoldAnnotations()
		defer release()
		found = c.find(want)
		defer found.closeRest()
	}
	parallel(ctx, c.cfg.Parallel, works, func(w work) {
		if err := c.apply(ctx, w, found); errors.Is(err, nodeagent.ErrSandboxTornDown) {
			// The informer has not seen the pod go yet. Nothing to retry:
			// the pod's next sandbox, if it gets one, comes through its own
			// ADD.
			c.log.Info("reconcile pod: its sandbox is being torn down", "pod", w.key.String(), "err", err)
		} else if err != nil {
			c.log.Warn("reconcile pod", "pod", w.key.String(), "err", err)
			c.queue.AddRateLimited(w.key)
			return
		}
		c.queue.Forget(w.key)
	})
	return true
}

// tellIstioCNIExpected says, once per pod, in a Warning Event on it and in
// the log, that the pod was injected for istio-cni's sidecar mode, which
// this agent does not provide: otherwise its istio-validation init
// container fails with nothing that points here. p is nil for a pod gone.
func (c *Controller) tellIstioCNIExpected(k types.NamespacedName, p *corev1.Pod) {
	msg := enablement.IstioCNIExpected(p)
	if msg == "" {
		delete(c.toldIstioCNI, k)
		return
	}
	if c.toldIstioCNI[k] == p.UID {
		return
	}
	c.toldIstioCNI[k] = p.UID
	c.log.Warn("sidecar pod expects istio-cni", "pod", k.String(), "uid", p.UID, "problem", msg)
	if c.cfg.Events != nil {
		c.cfg.Events.Eventf(p, corev1.EventTypeWarning, ReasonIstioCNIExpected, "%s", msg)
	}
}

// find runs one netns scan for every pod in want.
func (c *Controller) find(want map[types.UID][]netip.Addr) *handles {
	start := time.Now()
	found, err := c.cfg.Finder.Find(want)
	took := time.Since(start)
	if err != nil {
		c.log.Error("scan for pod netns", "pods", len(want), "err", err)
	}
	c.log.Debug("scanned for pod netns", "pods", len(want), "found", len(found), "took", took)
	if c.cfg.OnScan != nil {
		c.cfg.OnScan(len(want), len(found), took)
	}
	return &handles{m: found, n: len(found)}
}

// handles are the netns handles one scan found. Each goes to the agent at
// most once; the batch closes whatever nobody took.
type handles struct {
	mu sync.Mutex
	m  map[types.UID]*netns.Handle
	n  int
}

// take hands out uid's handle, if the scan found one; the caller owns it.
func (h *handles) take(uid types.UID) (*netns.Handle, bool) {
	if h == nil {
		return nil, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	ns, ok := h.m[uid]
	delete(h.m, uid)
	return ns, ok
}

func (h *handles) closeRest() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for uid, ns := range h.m {
		_ = ns.Close()
		delete(h.m, uid)
	}
}

// plan decides what one key needs without side effects.
func (c *Controller) plan(k types.NamespacedName) work {
	w := work{key: k}
	enrolled, isEnrolled := c.cfg.Agent.EnrolledUID(k.Namespace, k.Name)
	p, err := c.cfg.Pods.Pod(k.Namespace, k.Name)
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
	d := c.cfg.Pods.DecideCached(p)
	unresolved := isEnrolled && enrolled == p.UID && c.cfg.Agent.Unresolved(p.UID)
	findable := len(enablement.PodIPs(p)) > 0
	switch {
	case d.Enroll && !isEnrolled && p.DeletionTimestamp != nil && c.cfg.Agent.SandboxReleased(p.UID):
		// A terminating pod stays captured until its object goes, but
		// once kubelet has torn its sandbox down (CNI DEL, which released
		// it) there is no network left to capture: its remaining status
		// updates must not send the controller looking for it.
	case d.Enroll && (!isEnrolled || enrolled != p.UID || c.cfg.Agent.Pending(p.UID) || unresolved):
		// A pod the CNI path is still setting up has no IP yet; its ADD
		// enrolls it, and its status update brings it back here. With IPs
		// its sandbox is up whatever the phase (init containers running,
		// containers starting): capture it now, as Istio does.
		w.need = findable
	case !d.Enroll && unresolved && !enablement.IsTerminal(p):
		// Its rules may still redirect its traffic: they must go before
		// ztunnel lets go of it, and that needs its netns. Without IPs it
		// waits for its status update.
		w.need, w.release = findable, findable
	case !d.Enroll && isEnrolled && enrolled == p.UID:
		w.uid = enrolled
	case !d.Enroll && redirectionState(p) != "" && p.DeletionTimestamp == nil:
		// A pod being deleted keeps it: not worth an API request.
		w.clear = true
	}
	return w
}

// errNotFound marks a pod whose netns could not be located; it is retried.
var errNotFound = errors.New("netns not found")

func (c *Controller) apply(ctx context.Context, w work, found *handles) error {
	if w.release {
		ns, ok := found.take(w.pod.UID)
		if !ok {
			return fmt.Errorf("pod %s (uid %s) to release: %w", w.key, w.pod.UID, errNotFound)
		}
		if err := c.cfg.Agent.Restore(ctx, w.pod, ns); err != nil {
			return fmt.Errorf("restore before release: %w", err)
		}
		w.uid, w.need = w.pod.UID, false
	}
	if w.uid != "" {
		if err := c.cfg.Agent.Unenroll(ctx, w.uid); err != nil {
			return fmt.Errorf("unenroll %s: %w", w.uid, err)
		}
		c.log.Info("unenrolled pod", "pod", w.key.String(), "uid", w.uid)
	}
	if w.clear {
		c.cfg.Agent.ClearStale(w.pod)
		c.log.Info("clearing stale redirection annotation", "pod", w.key.String())
	}
	if !w.need {
		return nil
	}
	ns, ok := found.take(w.pod.UID)
	if !ok {
		return fmt.Errorf("pod %s (uid %s): %w", w.key, w.pod.UID, errNotFound)
	}
	if err := c.cfg.Agent.Capture(ctx, w.pod, ns, nil); err != nil {
		if c.cfg.Events != nil {
			c.cfg.Events.Eventf(w.pod, corev1.EventTypeWarning, "AmbientEnrollFailed", "could not enroll pod in the ambient mesh: %v", err)
		}
		return fmt.Errorf("enroll: %w", err)
	}
	c.log.Info("enrolled running pod", "pod", w.key.String(), "uid", w.pod.UID)
	return nil
}

// redirectionState returns the pod's current annotation value.
func redirectionState(pod *corev1.Pod) string {
	return pod.Annotations[ambient.RedirectionAnnotation]
}
