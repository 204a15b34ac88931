// Package fakecluster runs the agent's real pod cache (pkg/podcache) over
// client-go's fake clientset, for unit tests of the code that decides with
// it: the plugin event server, the agent's snapshot, the pod controller.
// Writes go through the fake API and return once the cache has seen them,
// so tests read as a sequence of steps.
package fakecluster

import (
	"context"
	"encoding/json"
	"fmt"
	"path"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient/kubeclienttest"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// NodeName is the node the cache follows unless the config names one.
const NodeName = "node-a"

// wait bounds how long a write may take to reach the cache; it is
// generous because the machine may be busy, and only a bug exhausts it.
const wait = 30 * time.Second

// Cluster is a fake API server and the pod cache following it.
type Cluster struct {
	t      testing.TB
	Client *fake.Clientset
	Cache  *podcache.Cache
	node   string
	// writes makes each write's read-check-write one step against the
	// other writes made through the Cluster (the fake has no preconditions).
	writes sync.Mutex
}

// New builds a pod cache over a fresh fake clientset (cfg.Client is
// replaced). Register the cache's handlers, then Start it.
func New(t testing.TB, cfg podcache.Config) *Cluster {
	t.Helper()
	if cfg.NodeName == "" {
		cfg.NodeName = NodeName
	}
	c := &Cluster{t: t, Client: fake.NewClientset(), node: cfg.NodeName}
	cfg.Client = kubeclienttest.FromClientset(c.Client)
	c.Cache = podcache.New(cfg)
	return c
}

// Seed puts objects in the fake API server before Start, as if they
// existed before the agent: the cache lists them when it starts.
func (c *Cluster) Seed(objs ...runtime.Object) {
	c.t.Helper()
	for _, o := range objs {
		if p, ok := o.(*corev1.Pod); ok && p.Spec.NodeName == "" {
			p = p.DeepCopy()
			p.Spec.NodeName = c.node
			o = p
		}
		if err := c.Client.Tracker().Add(o); err != nil {
			c.t.Fatalf("seed %T: %v", o, err)
		}
	}
}

// Start runs the cache until the test ends and waits for it to sync.
func (c *Cluster) Start() {
	c.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = c.Cache.Run(ctx)
	}()
	c.t.Cleanup(func() { cancel(); <-done })
	sctx, scancel := context.WithTimeout(ctx, wait)
	defer scancel()
	if err := c.Cache.WaitForSync(sctx); err != nil {
		c.t.Fatal(err)
	}
}

// SetPod creates or replaces a pod, on this node unless it names another,
// and returns once the cache holds this version.
func (c *Cluster) SetPod(p *corev1.Pod) *corev1.Pod {
	c.t.Helper()
	p = p.DeepCopy()
	if p.Spec.NodeName == "" {
		p.Spec.NodeName = c.node
	}
	ctx := context.Background()
	pods := c.Client.CoreV1().Pods(p.Namespace)
	c.writes.Lock()
	out, err := pods.Update(ctx, p, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		out, err = pods.Create(ctx, p, metav1.CreateOptions{})
	}
	c.writes.Unlock()
	if err != nil {
		c.t.Fatalf("set pod %s/%s: %v", p.Namespace, p.Name, err)
	}
	c.await("pods", p.Namespace, p.Name, "", func() bool {
		got, err := c.Cache.Pod(p.Namespace, p.Name)
		return err == nil && got.ResourceVersion == out.ResourceVersion
	})
	return out
}

// DeletePod deletes a pod and returns once the cache has dropped it.
func (c *Cluster) DeletePod(namespace, name string) {
	c.t.Helper()
	c.writes.Lock()
	err := c.Client.CoreV1().Pods(namespace).Delete(context.Background(), name, metav1.DeleteOptions{})
	c.writes.Unlock()
	if err != nil {
		c.t.Fatalf("delete pod %s/%s: %v", namespace, name, err)
	}
	c.await("pods", namespace, name, " gone", func() bool {
		_, err := c.Cache.Pod(namespace, name)
		return apierrors.IsNotFound(err)
	})
}

// AnnotatePod sets the annotation key of the pod with this uid to value
// ("" removes it) with a merge patch, as the agent's uid-preconditioned
// patch does: a pod that is gone, or another pod under its name, is left
// alone and the answer is a NotFound error. A patch never creates, so a
// write racing the pod's delete cannot bring the pod back. Like the
// agent's patch, it does not wait for the cache; it reads the pod from
// the tracker, past any reactor a test set to fail the agent's reads. It
// may run on a goroutine other than the test's: it fails with an error,
// never through t.Fatal.
func (c *Cluster) AnnotatePod(namespace, name string, uid types.UID, key, value string) error {
	var v any
	if value != "" {
		v = value
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{key: v}}})
	if err != nil {
		return err
	}
	c.writes.Lock()
	defer c.writes.Unlock()
	o, err := c.Client.Tracker().Get(corev1.SchemeGroupVersion.WithResource("pods"), namespace, name)
	if err == nil && o.(*corev1.Pod).UID != uid {
		err = apierrors.NewNotFound(corev1.Resource("pods"), name)
	}
	if err == nil {
		_, err = c.Client.CoreV1().Pods(namespace).Patch(context.Background(), name, types.MergePatchType, patch, metav1.PatchOptions{})
	}
	if err != nil {
		return fmt.Errorf("annotate pod %s/%s: %w", namespace, name, err)
	}
	return nil
}

// SetNamespace creates or replaces a namespace and returns once the cache
// holds this version.
func (c *Cluster) SetNamespace(ns *corev1.Namespace) {
	c.t.Helper()
	ctx := context.Background()
	nss := c.Client.CoreV1().Namespaces()
	c.writes.Lock()
	out, err := nss.Update(ctx, ns, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		out, err = nss.Create(ctx, ns, metav1.CreateOptions{})
	}
	c.writes.Unlock()
	if err != nil {
		c.t.Fatalf("set namespace %s: %v", ns.Name, err)
	}
	c.await("namespaces", "", ns.Name, "", func() bool {
		got, err := c.Cache.Namespace(ns.Name)
		return err == nil && got.ResourceVersion == out.ResourceVersion
	})
}

// await waits for cond; when it never holds, the failure says what the
// fake API server holds of the object and which writes it took, so a
// write that undid the awaited one tells from an event the cache lost.
func (c *Cluster) await(resource, namespace, name, what string, cond func() bool) {
	c.t.Helper()
	if poll.Wait(context.Background(), wait, cond) == nil {
		return
	}
	gvr := corev1.SchemeGroupVersion.WithResource(resource)
	_, err := c.Client.Tracker().Get(gvr, namespace, name)
	held := "holds it"
	if err != nil {
		held = fmt.Sprintf("answers %v", err)
	}
	var writes []string
	for _, a := range c.Client.Actions() {
		if a.GetResource().Resource != resource || a.GetNamespace() != namespace {
			continue
		}
		switch a.GetVerb() {
		case "create", "update", "patch", "delete":
		default:
			continue
		}
		n := ""
		switch a := a.(type) {
		case k8stesting.CreateAction: // an update too: both carry the object
			if m, err := meta.Accessor(a.GetObject()); err == nil {
				n = m.GetName()
			}
		case interface{ GetName() string }: // a patch or a delete
			n = a.GetName()
		}
		if n == name {
			writes = append(writes, a.GetVerb())
		}
	}
	obj := strings.TrimSuffix(resource, "s") + " " + path.Join(namespace, name)
	c.t.Fatalf("the pod cache did not see %s%s within %v (the fake API server %s; writes to it: %s)",
		obj, what, wait, held, strings.Join(writes, ","))
}
