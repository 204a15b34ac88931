// Package fakecluster runs the agent's real pod cache (pkg/podcache) over
// client-go's fake clientset, for unit tests of the code that decides with
// it: the plugin event server, the agent's snapshot, the pod controller.
// Writes go through the fake API and return once the cache has seen them,
// so tests read as a sequence of steps.
package fakecluster

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"

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
	out, err := pods.Update(ctx, p, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		out, err = pods.Create(ctx, p, metav1.CreateOptions{})
	}
	if err != nil {
		c.t.Fatalf("set pod %s/%s: %v", p.Namespace, p.Name, err)
	}
	c.await("pod "+p.Namespace+"/"+p.Name, func() bool {
		got, err := c.Cache.Pod(p.Namespace, p.Name)
		return err == nil && got.ResourceVersion == out.ResourceVersion
	})
	return out
}

// DeletePod deletes a pod and returns once the cache has dropped it.
func (c *Cluster) DeletePod(namespace, name string) {
	c.t.Helper()
	if err := c.Client.CoreV1().Pods(namespace).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		c.t.Fatalf("delete pod %s/%s: %v", namespace, name, err)
	}
	c.await("pod "+namespace+"/"+name+" gone", func() bool {
		_, err := c.Cache.Pod(namespace, name)
		return apierrors.IsNotFound(err)
	})
}

// SetNamespace creates or replaces a namespace and returns once the cache
// holds this version.
func (c *Cluster) SetNamespace(ns *corev1.Namespace) {
	c.t.Helper()
	ctx := context.Background()
	nss := c.Client.CoreV1().Namespaces()
	out, err := nss.Update(ctx, ns, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		out, err = nss.Create(ctx, ns, metav1.CreateOptions{})
	}
	if err != nil {
		c.t.Fatalf("set namespace %s: %v", ns.Name, err)
	}
	c.await("namespace "+ns.Name, func() bool {
		got, err := c.Cache.Namespace(ns.Name)
		return err == nil && got.ResourceVersion == out.ResourceVersion
	})
}

func (c *Cluster) await(what string, cond func() bool) {
	c.t.Helper()
	if poll.Wait(context.Background(), wait, cond) != nil {
		c.t.Fatalf("the pod cache did not see %s within %v", what, wait)
	}
}
