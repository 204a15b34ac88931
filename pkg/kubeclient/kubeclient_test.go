package kubeclient_test

import (
	"context"
	"os"
	"slices"
	"sync"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

var kube kubeenv.Shared

func TestMain(m *testing.M) { os.Exit(kube.Run(m)) }

// TestClientAgainstAPIServer runs every verb the agent uses against a real
// API server, in JSON and in protobuf (the agent's content type): an
// informer over the pod list-watch with the agent's field selector sees
// this node's pods only, and the namespace informer every namespace; the
// status patch sets an annotation; the event recorder's events arrive;
// /readyz answers.
func TestClientAgainstAPIServer(t *testing.T) {
	env := kube.Env(t)
	for name, accept := range map[string]string{
		"json":     "application/json",
		"protobuf": "application/vnd.kubernetes.protobuf,application/json",
	} {
		t.Run(name, func(t *testing.T) {
			cfg := rest.CopyConfig(env.Config)
			cfg.AcceptContentTypes = accept
			c, err := kubeclient.NewForConfig(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			var running sync.WaitGroup
			defer func() {
				cancel()
				running.Wait()
			}()
			if err := c.Readyz(ctx); err != nil {
				t.Errorf("Readyz of a serving API server: %v", err)
			}
			ns := env.CreateNamespace(t, "", map[string]string{"k": name}).Name
			node := testnet.RandName("node-", 8)
			mine := createPod(t, env, ns, "mine", node)
			createPod(t, env, ns, "other", node+"-other")

			pods := cache.NewSharedIndexInformerWithOptions(
				kubeclient.PodListWatch(c, ns, func(o *metav1.ListOptions) {
					o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
				}), &corev1.Pod{}, cache.SharedIndexInformerOptions{})
			nss := cache.NewSharedIndexInformerWithOptions(kubeclient.NamespaceListWatch(c, nil),
				&corev1.Namespace{}, cache.SharedIndexInformerOptions{})
			running.Go(func() { pods.RunWithContext(ctx) })
			running.Go(func() { nss.RunWithContext(ctx) })
			if !cache.WaitForCacheSync(ctx.Done(), pods.HasSynced, nss.HasSynced) {
				t.Fatal("informers did not sync")
			}
			if keys := pods.GetStore().ListKeys(); len(keys) != 1 || keys[0] != ns+"/mine" {
				t.Fatalf("pod informer holds %v, want only %s/mine", keys, ns)
			}
			if _, ok, _ := nss.GetStore().GetByKey(ns); !ok {
				t.Fatalf("namespace informer lacks %s", ns)
			}
			// A pod created after the sync arrives by the watch.
			createPod(t, env, ns, "later", node)
			poll.Until(t, "watched pod in the informer", func() bool {
				_, ok, _ := pods.GetStore().GetByKey(ns + "/later")
				return ok
			})

			got, err := c.GetPod(ctx, ns, "mine")
			if err != nil || got.UID != mine.UID {
				t.Fatalf("GetPod: %v, %v", got, err)
			}
			if _, err := c.GetPod(ctx, ns, "missing"); !apierrors.IsNotFound(err) {
				t.Fatalf("GetPod of a missing pod: %v, want NotFound", err)
			}
			if n, err := c.GetNamespace(ctx, ns); err != nil || n.Labels["k"] != name {
				t.Fatalf("GetNamespace: %v, %v", n, err)
			}
			patched, err := c.PatchPodStatus(ctx, ns, "mine", types.MergePatchType,
				[]byte(`{"metadata":{"annotations":{"example.com/a":"b"}}}`))
			if err != nil || patched.Annotations["example.com/a"] != "b" {
				t.Fatalf("PatchPodStatus: %v, %v", patched, err)
			}

			// The plugin credential's token, in whatever content type the
			// client asks for the rest.
			sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "plugin"}}
			if _, err := env.Client.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			exp := int64(600)
			tok, err := c.CreateToken(ctx, ns, "plugin", &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}})
			if err != nil || tok.Status.Token == "" {
				t.Fatalf("CreateToken: %v, %v", tok, err)
			}

			b := record.NewBroadcaster()
			defer b.Shutdown()
			b.StartRecordingToSink(kubeclient.EventSink{Client: c})
			rec := b.NewRecorder(kubeclient.NewScheme(), corev1.EventSource{Component: "kubeclient-test"})
			rec.Eventf(got, corev1.EventTypeWarning, "TestReason", "twice")
			rec.Eventf(got, corev1.EventTypeWarning, "TestReason", "twice")
			poll.Until(t, "the recorded event, counted twice (created, then patched)", func() bool {
				evs, err := env.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
				return err == nil && len(evs.Items) == 1 && evs.Items[0].Count == 2 &&
					evs.Items[0].InvolvedObject.UID == mine.UID
			})
		})
	}
}

// TestNewForConfigRejectsBurstlessQPS: a rate of requests without a burst
// would block every request forever.
func TestNewForConfigRejectsBurstlessQPS(t *testing.T) {
	if _, err := kubeclient.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1", QPS: 5}); err == nil {
		t.Fatal("want an error for QPS without Burst")
	}
	c, err := kubeclient.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1", QPS: 5, Burst: 10})
	if err != nil {
		t.Fatal(err)
	}
	if rl := c.RateLimiter(); rl == nil || rl.QPS() != 5 {
		t.Fatalf("rate limiter %v, want 5 requests/s", rl)
	}
}

func createPod(t *testing.T, env *kubeenv.Env, ns, name, node string) *corev1.Pod {
	t.Helper()
	p, err := env.Client.CoreV1().Pods(ns).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "example.com/c"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
	return p
}

// TestAgentWatches: the agent's watches, as the pod cache and the upgrade
// check open them: its node's pods (by field selector), every namespace
// (whole objects: nothing narrower exists for them), and the release's
// signal by name, metadata only; no DaemonSet.
func TestAgentWatches(t *testing.T) {
	c := &kubeclient.Client{}
	got := []kubeclient.Watch{
		kubeclient.PodsOfNodeWatch(c, "n1"),
		kubeclient.NamespacesWatch(c),
		kubeclient.ReleaseSignalWatch(c, "istio-system", "ambient-cni-installed"),
	}
	type shape struct {
		name, resource, namespace, fieldSelector string
		metadataOnly                             bool
	}
	var shapes []shape
	for _, w := range got {
		if w.ListerWatcher == nil || w.ExpectedType == nil || w.Version != "v1" || w.Group != "" || w.Options.LabelSelector != "" {
			t.Errorf("watch %+v: want a core/v1 list-watch without label selector", w)
		}
		shapes = append(shapes, shape{w.Name, w.Resource, w.Namespace, w.Options.FieldSelector, w.MetadataOnly})
	}
	want := []shape{
		{"pods", "pods", "", "spec.nodeName=n1", false},
		{"namespaces", "namespaces", "", "", false},
		{"release-signal", "services", "istio-system", "metadata.name=ambient-cni-installed", true},
	}
	if !slices.Equal(shapes, want) {
		t.Errorf("the agent's watches:\n got %+v\nwant %+v", shapes, want)
	}
}
