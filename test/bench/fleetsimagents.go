package bench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// A simulated agent is what one node's agent opens against the API
// server, and nothing else: its own client (its own connection from its
// own source address, so the audit log tells the nodes apart as it does
// real agents), its watches and its requests at start. Ours is built by
// install-cni's own NewAPIWatches from the chart's settings; istio-cni's
// watch set is written out below from its sources.

// simAgent is one simulated node's agent.
type simAgent interface {
	// run opens the agent's watches and requests and holds them until ctx
	// ends.
	run(ctx context.Context) error
	// synced is whether its informers have their initial state.
	synced() bool
}

// simCounts are the events one simulated agent's watches delivered, by
// resource, bookmarks apart: what the API server sent it.
type simCounts struct {
	pods, namespaces, services atomic.Int64
}

// countingWatch counts the events of w into n as its consumer reads them.
type countingWatch struct {
	watch.Interface
	out  chan watch.Event
	stop func()
}

func countWatch(w watch.Interface, err error, n *atomic.Int64) (watch.Interface, error) {
	if err != nil {
		return w, err
	}
	cw := &countingWatch{Interface: w, out: make(chan watch.Event)}
	done := make(chan struct{})
	var once sync.Once
	cw.stop = func() { once.Do(func() { close(done); w.Stop() }) }
	// Owner: the watch; it ends when w's channel closes or Stop is called.
	go func() {
		defer close(cw.out)
		for ev := range w.ResultChan() {
			if ev.Type != watch.Bookmark {
				n.Add(1)
			}
			select {
			case cw.out <- ev:
			case <-done:
				return
			}
		}
	}()
	return cw, nil
}

func (w *countingWatch) ResultChan() <-chan watch.Event { return w.out }
func (w *countingWatch) Stop()                          { w.stop() }

// countingClient is the agent's client with its watches counted: it
// overrides every watch method the agent's watches call (pods, namespaces,
// the release's signal Service).
type countingClient struct {
	kubeclient.Interface
	n *simCounts
}

func (c countingClient) WatchPods(ctx context.Context, namespace string, o metav1.ListOptions) (watch.Interface, error) {
	w, err := c.Interface.WatchPods(ctx, namespace, o)
	return countWatch(w, err, &c.n.pods)
}

func (c countingClient) WatchNamespaces(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
	w, err := c.Interface.WatchNamespaces(ctx, o)
	return countWatch(w, err, &c.n.namespaces)
}

func (c countingClient) WatchServicesMetadata(ctx context.Context, namespace string, o metav1.ListOptions) (watch.Interface, error) {
	w, err := c.Interface.WatchServicesMetadata(ctx, namespace, o)
	return countWatch(w, err, &c.n.services)
}

// simDialer dials from one source address and closes every connection it
// made on closeAll: the agent's process ending.
type simDialer struct {
	src   net.IP
	mu    sync.Mutex
	conns []net.Conn
}

func (d *simDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	nd := net.Dialer{LocalAddr: &net.TCPAddr{IP: d.src}}
	c, err := nd.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.conns = append(d.conns, c)
	d.mu.Unlock()
	return c, nil
}

func (d *simDialer) closeAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		_ = c.Close()
	}
	d.conns = nil
}

// simClientConfig is base with its own dialer: a transport of its own
// (client-go shares one between configs without a dialer), so each
// simulated agent holds its own connection, as each agent process does.
func simClientConfig(base *rest.Config, d *simDialer) *rest.Config {
	rc := rest.CopyConfig(base)
	rc.Dial = d.DialContext
	return rc
}

// ourSimAgent is our agent's watches on one node, built by install-cni's
// NewAPIWatches from the chart's settings for that node, through a client
// built as install-cni builds it (KubeClientConfig: its User-Agent, rate
// limit and content types).
type ourSimAgent struct {
	cfg    *installcni.Config
	base   *rest.Config
	dialer *simDialer
	n      *simCounts

	mu      sync.Mutex
	watches *installcni.APIWatches
}

// newOurSimAgent configures the agent of node as the chart does: only the
// node's and the pod's names differ from the chart's settings (the paths
// it would use on the node are never touched: no agent runs).
func newOurSimAgent(chart *simnode.Shipped, node string, sa *rest.Config, src net.IP, n *simCounts) (*ourSimAgent, error) {
	env := map[string]string{}
	for k, v := range chart.Env {
		env[k] = v
	}
	env["AMBIENT_NODE_NAME"], env["AMBIENT_POD_NAME"] = node, "ambient-cni-"+node
	cfg, err := installcni.Parse(chart.Args, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		return nil, fmt.Errorf("install-cni refuses the chart's settings for node %s: %w", node, err)
	}
	return &ourSimAgent{cfg: cfg, base: sa, dialer: &simDialer{src: src}, n: n}, nil
}

func (a *ourSimAgent) run(ctx context.Context) error {
	client, err := kubeclient.NewForConfig(simClientConfig(a.cfg.KubeClientConfig(a.base), a.dialer))
	if err != nil {
		return err
	}
	defer a.dialer.closeAll()
	w := installcni.NewAPIWatches(a.cfg, countingClient{Interface: client, n: a.n}, nil, slog.New(slog.DiscardHandler))
	a.mu.Lock()
	a.watches = &w
	a.mu.Unlock()
	return w.Run(ctx, a.cfg)
}

func (a *ourSimAgent) synced() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.watches != nil && a.watches.Pods.HasSynced()
}

// istioSimAgent is istio-cni's watches on one node, as its sources build
// them (istio.io/istio, cni/pkg): the node agent's informers
// (nodeagent/informers.go: the pods with spec.nodeName=<node>, every
// namespace) and the repair controller's (repair/repaircontroller.go: the
// pods with spec.nodeName=<node> again, with the chart's label selector,
// empty by default), whole objects, protobuf accepted (pkg/kube's client
// defaults); no request at start besides the watches (the audit log of
// `make bench-agents` shows the same set for the real agent).
type istioSimAgent struct {
	node   string
	base   *rest.Config
	dialer *simDialer
	n      *simCounts

	mu   sync.Mutex
	infs []cache.SharedIndexInformer
}

func newIstioSimAgent(node string, sa *rest.Config, src net.IP, n *simCounts) *istioSimAgent {
	return &istioSimAgent{node: node, base: sa, dialer: &simDialer{src: src}, n: n}
}

func (a *istioSimAgent) run(ctx context.Context) error {
	rc := rest.CopyConfig(a.base)
	rc.UserAgent = "istio-cni/" + a.node
	rc.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	rc.ContentType = "application/json"
	rc.QPS, rc.Burst = 100, 200
	client, err := kubeclient.NewForConfig(simClientConfig(rc, a.dialer))
	if err != nil {
		return err
	}
	defer a.dialer.closeAll()
	c := countingClient{Interface: client, n: a.n}
	onNode := func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", a.node).String()
	}
	infs := []cache.SharedIndexInformer{
		cache.NewSharedIndexInformer(kubeclient.PodListWatch(c, metav1.NamespaceAll, onNode), &corev1.Pod{}, 0, cache.Indexers{}),
		cache.NewSharedIndexInformer(kubeclient.NamespaceListWatch(c, nil), &corev1.Namespace{}, 0, cache.Indexers{}),
		cache.NewSharedIndexInformer(kubeclient.PodListWatch(c, metav1.NamespaceAll, onNode), &corev1.Pod{}, 0, cache.Indexers{}),
	}
	a.mu.Lock()
	a.infs = infs
	a.mu.Unlock()
	var wg sync.WaitGroup
	for _, inf := range infs {
		wg.Go(func() { inf.RunWithContext(ctx) })
	}
	wg.Wait()
	return nil
}

func (a *istioSimAgent) synced() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.infs) == 0 {
		return false
	}
	for _, inf := range a.infs {
		if !inf.HasSynced() {
			return false
		}
	}
	return true
}
