// Package podcache is the node agent's view of the cluster, used by the
// plugin event server to decide CNI ADDs, by the pod controller to decide
// on running pods and requeue them, and by the agent to build the plugin's
// enablement snapshot: informers and listers for the pods bound to this
// node and for every namespace, the enablement policy applied to them, and
// change notifications. Build it first; it needs nothing else of the agent.
package podcache

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
)

// Client is what the cache reads from the API server.
type Client interface {
	kubeclient.PodReader
	kubeclient.NamespaceReader
}

// Config configures a Cache.
type Config struct {
	Client   Client
	NodeName string
	// Policy decides every pod (its Self is the agent's own pod).
	Policy enablement.Policy
	// OnEvent, when set, is called for every informer event of a pod of
	// this node or of a namespace, with "add", "update" or "delete": what
	// istio-cni counts as nodeagent_reconcile_events_total. It runs on the
	// informer's goroutine: it must be quick.
	OnEvent func(event string)
	Logger  *slog.Logger
}

// Cache holds the informers. Create it with New, register handlers, then
// Run it.
type Cache struct {
	cfg    Config
	log    *slog.Logger
	pods   listerscorev1.PodLister
	nss    listerscorev1.NamespaceLister
	synced []cache.InformerSynced
	start  func(stop <-chan struct{})
	stop   func()

	// listFailed is when the informers last failed to list or watch
	// (unix nanoseconds; 0: never).
	listFailed atomic.Int64

	mu           sync.Mutex
	onChange     []func(types.NamespacedName)
	onEnablement []func()
	onDeleted    []func(types.UID)
}

// New builds the informers; nothing runs until Run.
func New(cfg Config) *Cache {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c := &Cache{cfg: cfg, log: cfg.Logger.With("component", "pod-cache")}
	// The watches are defined in kubeclient, once; install-cni's
	// NewAPIWatches, which the fleet simulator calls too, builds this
	// cache.
	podW, nsW := kubeclient.PodsOfNodeWatch(cfg.Client, cfg.NodeName), kubeclient.NamespacesWatch(cfg.Client)
	podInf := cache.NewSharedIndexInformerWithOptions(podW.ListerWatcher, podW.ExpectedType,
		cache.SharedIndexInformerOptions{Indexers: cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}})
	// Namespaces are only ever looked up by name or listed whole, so
	// their informer has no index: a namespace index would hold every
	// namespace of the cluster once more, under one key.
	nsInf := cache.NewSharedIndexInformerWithOptions(nsW.ListerWatcher, nsW.ExpectedType, cache.SharedIndexInformerOptions{})
	// The cache keeps what the agent reads of each object and nothing
	// else (trim.go): its memory is bounded by the number of pods and
	// namespaces, not by what users write into them.
	_ = podInf.SetTransform(TrimPod)
	_ = nsInf.SetTransform(NamespaceTransform(NamespaceLabelKeys(cfg.Policy)))
	// A failed list or watch is noted (and logged, as client-go does by
	// default): a sync that waits on an API server refusing or failing
	// the agent's lists is waiting, not hung (LastListError).
	noteFailure := func(ctx context.Context, r *cache.Reflector, err error) {
		c.listFailed.Store(time.Now().UnixNano())
		cache.DefaultWatchErrorHandler(ctx, r, err)
	}
	_ = podInf.SetWatchErrorHandlerWithContext(noteFailure)
	_ = nsInf.SetWatchErrorHandlerWithContext(noteFailure)
	c.pods, c.nss = listerscorev1.NewPodLister(podInf.GetIndexer()), listerscorev1.NewNamespaceLister(nsInf.GetIndexer())
	c.synced = []cache.InformerSynced{podInf.HasSynced, nsInf.HasSynced}

	event := func(string) {}
	if cfg.OnEvent != nil {
		event = cfg.OnEvent
	}
	_, _ = podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { event("add"); c.podChanged(o) },
		UpdateFunc: func(_, o any) { event("update"); c.podChanged(o) },
		DeleteFunc: func(o any) {
			event("delete")
			c.podChanged(o)
			c.podDeleted(o)
		},
	})
	_, _ = nsInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(o any) { event("add"); c.namespaceChanged(o) },
		UpdateFunc: func(old, o any) {
			event("update")
			if cfg.Policy.Selectors.NamespaceChangeMatters(nsLabels(old), nsLabels(o)) {
				c.namespaceChanged(o)
			}
		},
		DeleteFunc: func(o any) { event("delete"); c.namespaceChanged(o) },
	})
	var running sync.WaitGroup
	c.start = func(stop <-chan struct{}) {
		running.Go(func() { podInf.Run(stop) })
		running.Go(func() { nsInf.Run(stop) })
	}
	c.stop = running.Wait
	return c
}

// OnChange registers f to be told about every pod whose enablement
// decision may have changed: the pod was added, updated or deleted, or its
// namespace's labels changed in a key the enablement selectors read. It runs on an informer goroutine, so
// it must be quick (e.g. a workqueue Add). Register before Run.
func (c *Cache) OnChange(f func(pod types.NamespacedName)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onChange = append(c.onChange, f)
}

// OnEnablementChange registers f to be told whenever EnablementState may
// have changed. It runs on an informer goroutine. Register before Run.
func (c *Cache) OnEnablementChange(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onEnablement = append(c.onEnablement, f)
}

// OnPodDeleted registers f to be told the UID of every pod whose object
// is gone from the API server: what the agent remembers per pod can go
// then. It runs on an informer goroutine. Register before Run.
func (c *Cache) OnPodDeleted(f func(uid types.UID)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onDeleted = append(c.onDeleted, f)
}

func (c *Cache) podDeleted(o any) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	c.mu.Lock()
	fs := c.onDeleted
	c.mu.Unlock()
	for _, f := range fs {
		f(p.UID)
	}
}

func (c *Cache) handlers() ([]func(types.NamespacedName), []func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.onChange, c.onEnablement
}

func nsLabels(o any) map[string]string {
	if n, ok := o.(*corev1.Namespace); ok {
		return n.Labels
	}
	return nil
}

func (c *Cache) podChanged(o any) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	onChange, onEnablement := c.handlers()
	for _, f := range onChange {
		f(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	}
	if c.cfg.Policy.Selectors.PodLevel(p.Labels) {
		for _, f := range onEnablement {
			f()
		}
	}
}

func (c *Cache) namespaceChanged(o any) {
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
	onChange, onEnablement := c.handlers()
	for _, p := range pods {
		for _, f := range onChange {
			f(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	}
	for _, f := range onEnablement {
		f()
	}
}

// Run starts the informers and keeps them running until ctx ends; it
// returns once they have stopped.
func (c *Cache) Run(ctx context.Context) error {
	c.start(ctx.Done())
	<-ctx.Done()
	c.stop()
	return nil
}

// WaitForSync blocks until both informers have listed once, or ctx ends.
func (c *Cache) WaitForSync(ctx context.Context) error {
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		return fmt.Errorf("pod cache did not sync: %w", ctx.Err())
	}
	return nil
}

// HasSynced reports whether both informers have listed once.
func (c *Cache) HasSynced() bool {
	for _, s := range c.synced {
		if !s() {
			return false
		}
	}
	return true
}

// LastListError is when an informer last failed to list or watch (zero:
// never).
func (c *Cache) LastListError() time.Time {
	if n := c.listFailed.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Pod returns a pod of this node from the cache.
func (c *Cache) Pod(namespace, name string) (*corev1.Pod, error) {
	return c.pods.Pods(namespace).Get(name)
}

// Namespace returns a namespace from the cache.
func (c *Cache) Namespace(name string) (*corev1.Namespace, error) {
	return c.nss.Get(name)
}

// Pods lists every pod of this node in the cache.
func (c *Cache) Pods() ([]*corev1.Pod, error) {
	return c.pods.List(labels.Everything())
}

// Decide answers the CNI path: the enablement decision for a pod the
// runtime is starting, with the pod. It reads the cache and, on a miss (or
// a stale entry with another UID), the API server once; uid, when set,
// must match. When that read gets no answer (anything but a not-found),
// the error wraps enablement.ErrUnanswered.
func (c *Cache) Decide(ctx context.Context, namespace, name, uid string) (enablement.Decision, *corev1.Pod, error) {
	p, err := c.pods.Pods(namespace).Get(name)
	if err != nil || (uid != "" && string(p.UID) != uid) {
		p, err = c.cfg.Client.GetPod(ctx, namespace, name)
		if err != nil && !apierrors.IsNotFound(err) {
			return enablement.Decision{}, nil, fmt.Errorf("get pod %s/%s: %w: %w", namespace, name, enablement.ErrUnanswered, err)
		}
		if err != nil {
			return enablement.Decision{}, nil, fmt.Errorf("get pod %s/%s: %w", namespace, name, err)
		}
		if uid != "" && string(p.UID) != uid {
			return enablement.Decision{}, nil, fmt.Errorf("pod %s/%s has uid %s, runtime asked for %s", namespace, name, p.UID, uid)
		}
	}
	ns, err := c.nss.Get(namespace)
	if apierrors.IsNotFound(err) {
		if ns, err = c.cfg.Client.GetNamespace(ctx, namespace); err != nil {
			return enablement.Decision{}, nil, fmt.Errorf("get namespace %s: %w", namespace, err)
		}
	}
	return c.cfg.Policy.Decide(p, ns), p, nil
}

// NamespaceEnabled reports whether the cached namespace name may enable a
// pod whatever the pod's own labels (the snapshot's enabled namespaces);
// a namespace not in the cache does not.
func (c *Cache) NamespaceEnabled(name string) bool {
	ns, err := c.nss.Get(name)
	return err == nil && c.cfg.Policy.MayEnableNamespace(ns)
}

// DecideCached is the pod controller's decision for a cached pod, with its
// namespace from the cache (a namespace not in the cache counts as not
// labelled).
func (c *Cache) DecideCached(p *corev1.Pod) enablement.Decision {
	ns, _ := c.nss.Get(p.Namespace)
	return c.cfg.Policy.Decide(p, ns)
}

// NodeState is the rest of what the plugin's snapshot needs: every
// namespace known, and this node's pods by UID with the decision for each
// (true: captured), so the plugin can fail closed for what it never saw.
func (c *Cache) NodeState() (namespaces []string, pods map[string]bool) {
	nss, _ := c.nss.List(labels.Everything())
	for _, n := range nss {
		namespaces = append(namespaces, n.Name)
	}
	slices.Sort(namespaces)
	ps, _ := c.pods.List(labels.Everything())
	pods = make(map[string]bool, len(ps))
	for _, p := range ps {
		pods[string(p.UID)] = c.DecideCached(p).Enroll
	}
	return namespaces, pods
}

// EnablementState is what the plugin's fallback snapshot needs: the
// namespaces where a pod may be enabled whatever its own labels (the
// enablement selectors select the namespace), and whether any pod on this
// node is enabled by its own labels alone outside them.
func (c *Cache) EnablementState() (enabled []string, podLevel bool) {
	nss, _ := c.nss.List(labels.Everything())
	for _, n := range nss {
		if c.cfg.Policy.MayEnableNamespace(n) {
			enabled = append(enabled, n.Name)
		}
	}
	slices.Sort(enabled)
	pods, _ := c.pods.List(labels.Everything())
	for _, p := range pods {
		if c.cfg.Policy.Selectors.PodLevel(p.Labels) && !slices.Contains(enabled, p.Namespace) {
			podLevel = true
			break
		}
	}
	return enabled, podLevel
}
