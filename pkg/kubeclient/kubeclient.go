// Package kubeclient is the agent's Kubernetes client: exactly the verbs
// the agent and the uninstall hook use (pods, namespaces, nodes,
// DaemonSets, the release's signal Service, events), on REST clients
// whose scheme registers only core/v1 and apps/v1. client-go's full
// clientset and informer factory link every API group's types and scheme
// into the binary, and their pages are most of the agent's file-backed
// memory; this client links two groups. The ListWatch helpers build
// informers over it with the same list-and-watch semantics as the
// factory's; PodsOfNodeWatch, NamespacesWatch and ReleaseSignalWatch are
// the agent's watches, each defined once.
package kubeclient

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/flowcontrol"
)

// PodReader reads the pods the agent caches and decides on.
type PodReader interface {
	GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error)
	ListPods(ctx context.Context, namespace string, opts metav1.ListOptions) (*corev1.PodList, error)
	WatchPods(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error)
}

// PodStatusPatcher patches the pods/status subresource (the only write the
// agent's RBAC grants on pods).
type PodStatusPatcher interface {
	PatchPodStatus(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) (*corev1.Pod, error)
}

// NamespaceReader reads namespaces.
type NamespaceReader interface {
	GetNamespace(ctx context.Context, name string) (*corev1.Namespace, error)
	ListNamespaces(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error)
	WatchNamespaces(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// Nodes reads and patches the agent's own node.
type Nodes interface {
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
	PatchNode(ctx context.Context, name string, pt types.PatchType, data []byte) (*corev1.Node, error)
}

// DaemonSetReader reads DaemonSets: the agent's own by name, and the
// chart's by label, once, at shutdown. Nothing of the agent watches a
// DaemonSet: each status write the DaemonSet controller makes would reach
// every agent (ReleaseSignalWatch says what tells an uninstall instead).
type DaemonSetReader interface {
	GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error)
	ListDaemonSets(ctx context.Context, namespace string, opts metav1.ListOptions) (*appsv1.DaemonSetList, error)
}

// ServiceMetadataReader lists and watches the metadata of Services: the
// release's signal Service, by name (ReleaseSignalWatch).
type ServiceMetadataReader interface {
	ListServicesMetadata(ctx context.Context, namespace string, opts metav1.ListOptions) (*metav1.PartialObjectMetadataList, error)
	WatchServicesMetadata(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error)
}

// ServiceDeleter deletes Services (the uninstall hook: the release's
// signal Service, first).
type ServiceDeleter interface {
	DeleteService(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error
}

// DaemonSetDeleter deletes DaemonSets (the uninstall hook).
type DaemonSetDeleter interface {
	DeleteDaemonSet(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error
}

// Events writes core/v1 Events in the event's own namespace.
type Events interface {
	CreateEvent(ctx context.Context, e *corev1.Event) (*corev1.Event, error)
	UpdateEvent(ctx context.Context, e *corev1.Event) (*corev1.Event, error)
	PatchEvent(ctx context.Context, e *corev1.Event, data []byte) (*corev1.Event, error)
}

// ServiceAccountTokens issues bound tokens of a ServiceAccount (the
// TokenRequest API): the agent's credential for the plugin.
type ServiceAccountTokens interface {
	CreateToken(ctx context.Context, namespace, name string, tr *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error)
}

// Readiness asks whether the API server serves.
type Readiness interface {
	// Readyz returns nil when the API server answers GET /readyz with 200
	// (a path every identity may read, through the default
	// system:public-info-viewer role).
	Readyz(ctx context.Context) error
}

// Interface is every verb of the client. Users declare the part they need.
type Interface interface {
	Readiness
	PodReader
	PodStatusPatcher
	NamespaceReader
	Nodes
	DaemonSetReader
	DaemonSetDeleter
	ServiceMetadataReader
	ServiceDeleter
	Events
	ServiceAccountTokens
}

// NewScheme returns a scheme holding core/v1, apps/v1 and the unversioned
// meta types (list, get, delete and patch options), all the client
// encodes and decodes. The event recorder resolves its objects' kinds in
// it too.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	// AddToScheme fails only on a programming error in the API packages.
	if err := corev1.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := appsv1.AddToScheme(s); err != nil {
		panic(err)
	}
	metav1.AddToGroupVersion(s, schema.GroupVersion{Version: "v1"})
	return s
}

// Client is the REST implementation of Interface.
type Client struct {
	core, apps *rest.RESTClient
	meta       metadata.Interface
	params     runtime.ParameterCodec
}

var _ Interface = (*Client)(nil)

// NewForConfig returns a client for cfg. Like client-go's clientset, its
// groups share one HTTP client and one rate limiter (cfg's, or a token
// bucket of cfg.QPS and cfg.Burst).
func NewForConfig(cfg *rest.Config) (*Client, error) {
	c := *cfg
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	if c.RateLimiter == nil && c.QPS > 0 {
		if c.Burst <= 0 {
			return nil, fmt.Errorf("kubernetes client: burst must be positive when QPS (%v) is", c.QPS)
		}
		c.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(c.QPS, c.Burst)
	}
	httpClient, err := rest.HTTPClientFor(&c)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	s := NewScheme()
	codecs := serializer.NewCodecFactory(s)
	restFor := func(apiPath string, gv schema.GroupVersion) (*rest.RESTClient, error) {
		gc := c
		gc.APIPath = apiPath
		gc.GroupVersion = &gv
		gc.NegotiatedSerializer = rest.CodecFactoryForGeneratedClient(s, codecs).WithoutConversion()
		rc, err := rest.RESTClientForConfigAndClient(&gc, httpClient)
		if err != nil {
			return nil, fmt.Errorf("kubernetes client for %s: %w", gv, err)
		}
		return rc, nil
	}
	core, err := restFor("/api", corev1.SchemeGroupVersion)
	if err != nil {
		return nil, err
	}
	apps, err := restFor("/apis", appsv1.SchemeGroupVersion)
	if err != nil {
		return nil, err
	}
	meta, err := metadata.NewForConfigAndClient(&c, httpClient)
	if err != nil {
		return nil, fmt.Errorf("kubernetes metadata client: %w", err)
	}
	return &Client{core: core, apps: apps, meta: meta, params: runtime.NewParameterCodec(s)}, nil
}

func timeout(opts metav1.ListOptions) time.Duration {
	if opts.TimeoutSeconds != nil {
		return time.Duration(*opts.TimeoutSeconds) * time.Second
	}
	return 0
}

func (c *Client) get(ctx context.Context, rc *rest.RESTClient, namespace, resource, name string, into runtime.Object) error {
	return rc.Get().NamespaceIfScoped(namespace, namespace != "").Resource(resource).Name(name).
		VersionedParams(&metav1.GetOptions{}, c.params).Do(ctx).Into(into)
}

func (c *Client) list(ctx context.Context, rc *rest.RESTClient, namespace, resource string, opts metav1.ListOptions, into runtime.Object) error {
	return rc.Get().NamespaceIfScoped(namespace, namespace != "").Resource(resource).
		VersionedParams(&opts, c.params).Timeout(timeout(opts)).Do(ctx).Into(into)
}

func (c *Client) watch(ctx context.Context, rc *rest.RESTClient, namespace, resource string, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return rc.Get().NamespaceIfScoped(namespace, namespace != "").Resource(resource).
		VersionedParams(&opts, c.params).Timeout(timeout(opts)).Watch(ctx)
}

func (c *Client) patch(ctx context.Context, rc *rest.RESTClient, namespace, resource, name, sub string, pt types.PatchType, data []byte, into runtime.Object) error {
	r := rc.Patch(pt).NamespaceIfScoped(namespace, namespace != "").Resource(resource).Name(name)
	if sub != "" {
		r = r.SubResource(sub)
	}
	return r.VersionedParams(&metav1.PatchOptions{}, c.params).Body(data).Do(ctx).Into(into)
}

// GetPod implements PodReader.
func (c *Client) GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	p := &corev1.Pod{}
	return p, c.get(ctx, c.core, namespace, "pods", name, p)
}

// ListPods implements PodReader.
func (c *Client) ListPods(ctx context.Context, namespace string, opts metav1.ListOptions) (*corev1.PodList, error) {
	l := &corev1.PodList{}
	return l, c.list(ctx, c.core, namespace, "pods", opts, l)
}

// WatchPods implements PodReader.
func (c *Client) WatchPods(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error) {
	return c.watch(ctx, c.core, namespace, "pods", opts)
}

// PatchPodStatus implements PodStatusPatcher.
func (c *Client) PatchPodStatus(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) (*corev1.Pod, error) {
	p := &corev1.Pod{}
	return p, c.patch(ctx, c.core, namespace, "pods", name, "status", pt, data, p)
}

// GetNamespace implements NamespaceReader.
func (c *Client) GetNamespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	n := &corev1.Namespace{}
	return n, c.get(ctx, c.core, "", "namespaces", name, n)
}

// ListNamespaces implements NamespaceReader.
func (c *Client) ListNamespaces(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error) {
	l := &corev1.NamespaceList{}
	return l, c.list(ctx, c.core, "", "namespaces", opts, l)
}

// WatchNamespaces implements NamespaceReader.
func (c *Client) WatchNamespaces(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	return c.watch(ctx, c.core, "", "namespaces", opts)
}

// GetNode implements Nodes.
func (c *Client) GetNode(ctx context.Context, name string) (*corev1.Node, error) {
	n := &corev1.Node{}
	return n, c.get(ctx, c.core, "", "nodes", name, n)
}

// PatchNode implements Nodes.
func (c *Client) PatchNode(ctx context.Context, name string, pt types.PatchType, data []byte) (*corev1.Node, error) {
	n := &corev1.Node{}
	return n, c.patch(ctx, c.core, "", "nodes", name, "", pt, data, n)
}

// GetDaemonSet implements DaemonSetReader.
func (c *Client) GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error) {
	d := &appsv1.DaemonSet{}
	return d, c.get(ctx, c.apps, namespace, "daemonsets", name, d)
}

// ListDaemonSets implements DaemonSetReader.
func (c *Client) ListDaemonSets(ctx context.Context, namespace string, opts metav1.ListOptions) (*appsv1.DaemonSetList, error) {
	l := &appsv1.DaemonSetList{}
	return l, c.list(ctx, c.apps, namespace, "daemonsets", opts, l)
}

// ListServicesMetadata implements ServiceMetadataReader.
func (c *Client) ListServicesMetadata(ctx context.Context, namespace string, opts metav1.ListOptions) (*metav1.PartialObjectMetadataList, error) {
	return c.meta.Resource(corev1.SchemeGroupVersion.WithResource("services")).Namespace(namespace).List(ctx, opts)
}

// WatchServicesMetadata implements ServiceMetadataReader.
func (c *Client) WatchServicesMetadata(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error) {
	return c.meta.Resource(corev1.SchemeGroupVersion.WithResource("services")).Namespace(namespace).Watch(ctx, opts)
}

// DeleteService implements ServiceDeleter.
func (c *Client) DeleteService(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error {
	return c.core.Delete().Namespace(namespace).Resource("services").Name(name).Body(&opts).Do(ctx).Error()
}

// DeleteDaemonSet implements DaemonSetDeleter.
func (c *Client) DeleteDaemonSet(ctx context.Context, namespace, name string, opts metav1.DeleteOptions) error {
	return c.apps.Delete().Namespace(namespace).Resource("daemonsets").Name(name).Body(&opts).Do(ctx).Error()
}

// CreateEvent implements Events.
func (c *Client) CreateEvent(ctx context.Context, e *corev1.Event) (*corev1.Event, error) {
	out := &corev1.Event{}
	err := c.core.Post().Namespace(e.Namespace).Resource("events").
		VersionedParams(&metav1.CreateOptions{}, c.params).Body(e).Do(ctx).Into(out)
	return out, err
}

// UpdateEvent implements Events.
func (c *Client) UpdateEvent(ctx context.Context, e *corev1.Event) (*corev1.Event, error) {
	out := &corev1.Event{}
	err := c.core.Put().Namespace(e.Namespace).Resource("events").Name(e.Name).
		VersionedParams(&metav1.UpdateOptions{}, c.params).Body(e).Do(ctx).Into(out)
	return out, err
}

// PatchEvent implements Events: a strategic merge patch, as the event
// recorder's correlator writes them.
func (c *Client) PatchEvent(ctx context.Context, e *corev1.Event, data []byte) (*corev1.Event, error) {
	out := &corev1.Event{}
	return out, c.patch(ctx, c.core, e.Namespace, "events", e.Name, "", types.StrategicMergePatchType, data, out)
}

// Readyz implements Readiness.
func (c *Client) Readyz(ctx context.Context) error {
	if err := c.core.Get().AbsPath("/readyz").Do(ctx).Error(); err != nil {
		return fmt.Errorf("API server /readyz: %w", err)
	}
	return nil
}

// EventSink sends the event recorder's events (record.EventSink) through
// Events.
type EventSink struct {
	Client Events
}

// Create implements record.EventSink.
func (s EventSink) Create(e *corev1.Event) (*corev1.Event, error) {
	return s.Client.CreateEvent(context.TODO(), e)
}

// Update implements record.EventSink.
func (s EventSink) Update(e *corev1.Event) (*corev1.Event, error) {
	return s.Client.UpdateEvent(context.TODO(), e)
}

// Patch implements record.EventSink.
func (s EventSink) Patch(e *corev1.Event, data []byte) (*corev1.Event, error) {
	return s.Client.PatchEvent(context.TODO(), e, data)
}

// listWatch wraps list and watch functions, with tweak applied to every
// request's options, as an informer's ListerWatcher. client decides the
// watch-list semantics as for client-go's informers: a client that says it
// cannot stream the initial list (a fake) gets a plain list then watch.
func listWatch(client any, tweak func(*metav1.ListOptions),
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error)) cache.ListerWatcher {
	apply := func(o *metav1.ListOptions) {
		if tweak != nil {
			tweak(o)
		}
	}
	return cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			apply(&o)
			return list(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			apply(&o)
			return watchFn(ctx, o)
		},
	}, client)
}

// PodListWatch lists and watches the pods of namespace ("" for all),
// with tweak (may be nil) applied to every request's options.
func PodListWatch(c PodReader, namespace string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	return listWatch(c, tweak,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return c.ListPods(ctx, namespace, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return c.WatchPods(ctx, namespace, o)
		})
}

// NamespaceListWatch lists and watches namespaces, with tweak (may be nil)
// applied to every request's options.
func NamespaceListWatch(c NamespaceReader, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	return listWatch(c, tweak,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return c.ListNamespaces(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return c.WatchNamespaces(ctx, o)
		})
}

// ServiceMetadataListWatch lists and watches the metadata of the
// Services of namespace (*metav1.PartialObjectMetadata), with tweak (may
// be nil) applied to every request's options.
func ServiceMetadataListWatch(c ServiceMetadataReader, namespace string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	return listWatch(c, tweak,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return c.ListServicesMetadata(ctx, namespace, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return c.WatchServicesMetadata(ctx, namespace, o)
		})
}

// RateLimiter is the limiter every request of the client waits on.
func (c *Client) RateLimiter() flowcontrol.RateLimiter { return c.core.GetRateLimiter() }

// CreateToken asks for a token of ServiceAccount namespace/name. The
// TokenRequest is not a core/v1 type the client's scheme holds, so it
// travels as plain JSON both ways (the client otherwise asks for
// protobuf, which json cannot decode).
func (c *Client) CreateToken(ctx context.Context, namespace, name string, tr *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	in := *tr
	in.APIVersion, in.Kind = authenticationv1.SchemeGroupVersion.String(), "TokenRequest"
	body, err := json.Marshal(&in)
	if err != nil {
		return nil, err
	}
	raw, err := c.core.Post().Namespace(namespace).Resource("serviceaccounts").Name(name).SubResource("token").
		SetHeader("Content-Type", "application/json").SetHeader("Accept", "application/json").Body(body).Do(ctx).Raw()
	if err != nil {
		return nil, err
	}
	out := &authenticationv1.TokenRequest{}
	if err := json.Unmarshal(raw, out); err != nil {
		return nil, fmt.Errorf("decode TokenRequest: %w", err)
	}
	return out, nil
}
