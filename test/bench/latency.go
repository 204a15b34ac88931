package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// sandbox is one pod sandbox the latency phase runs CNI on: a network
// namespace (bind-mounted where runtimes mount them) and CNI arguments.
type sandbox struct {
	ns        ns.NetNS
	id        string
	namespace string
	name      string
	uid       types.UID
}

func newSandbox(namespace, name string, uid types.UID) (*sandbox, error) {
	netns, err := testutils.NewNS()
	if err != nil {
		return nil, fmt.Errorf("create netns: %w", err)
	}
	// Runtimes bring the sandbox's loopback up before the network's chain.
	if err := netns.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	}); err != nil {
		s := &sandbox{ns: netns}
		_ = s.close()
		return nil, fmt.Errorf("bring up lo: %w", err)
	}
	return &sandbox{ns: netns, id: testnet.RandName("", 64), namespace: namespace, name: name, uid: uid}, nil
}

func (s *sandbox) rt() *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: s.id,
		NetNS:       s.ns.Path(),
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", s.namespace},
			{"K8S_POD_NAME", s.name},
			{"K8S_POD_INFRA_CONTAINER_ID", s.id},
			{"K8S_POD_UID", string(s.uid)},
		},
	}
}

// close releases the namespace and removes its mount. A descriptor still
// held through the mount (a forking child, for a moment) makes umount
// EBUSY: retried for a second, then detached so nothing is left.
func (s *sandbox) close() error {
	path := s.ns.Path()
	_ = s.ns.Close()
	var err error
	for range 50 {
		if err = unix.Unmount(path, 0); !errors.Is(err, unix.EBUSY) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(path, unix.MNT_DETACH)
	}
	if rerr := os.Remove(path); rerr != nil && !os.IsNotExist(rerr) {
		return errors.Join(err, rerr)
	}
	if err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	return nil
}

// latencyRun measures CNI ADD and DEL through the chained conflist (with
// our plugin) against the primary conflist alone (bridge + host-local) in
// the same run: waves of `concurrency` simultaneous calls, the two chains
// alternating wave by wave so that load changing over time hits both.
type latencyRun struct {
	client      kubernetes.Interface
	cni         *libcni.CNIConfig
	chained     *libcni.NetworkConfigList
	primary     *libcni.NetworkConfigList
	node        string
	namespace   string
	pods        int
	concurrency int
	// annotated: the agent captures these pods, so the ADD window stays
	// open until each carries the redirection annotation `enabled`: the
	// agent writes it off the ADD's critical path, and its PATCH counts
	// for the ADD however late it lands.
	annotated bool
	// between runs while the agent may still react (an annotation written
	// after the ADD returned; the pod deletions before DEL).
	settle func(context.Context) error
	// window brackets each op's measurement window (CPU, API requests).
	window func(op string) func() error
}

// samples are the measured durations of one op, per chain.
type samples struct {
	chained, primary []time.Duration
	errors           int
}

func (l *latencyRun) run(ctx context.Context) (add, del samples, err error) {
	n := l.pods
	chained := make([]*sandbox, n)
	primary := make([]*sandbox, n)
	defer func() {
		for _, s := range append(chained, primary...) {
			if s != nil {
				err = errors.Join(err, s.close())
			}
		}
	}()
	pods := l.client.CoreV1().Pods(l.namespace)

	// ADD: the window opens before the Pod objects exist, so what the
	// agent does when its informer sees a new pod counts for the pod.
	end := l.window("ADD")
	for i := range n {
		name := fmt.Sprintf("lat-%d-c%d-%03d", time.Now().UnixNano()%1e6, l.concurrency, i)
		obj, err := pods.Create(ctx, podObject(l.namespace, name, l.node), metav1.CreateOptions{})
		if err != nil {
			return add, del, fmt.Errorf("create pod: %w", err)
		}
		if chained[i], err = newSandbox(l.namespace, name, obj.UID); err != nil {
			return add, del, err
		}
		// The primary chain alone: our plugin never sees this sandbox.
		if primary[i], err = newSandbox(l.namespace, name+"-base", types.UID(testnet.RandName("", 8))); err != nil {
			return add, del, err
		}
	}
	for w := 0; w*l.concurrency < n; w++ {
		lo, hi := w*l.concurrency, min(n, (w+1)*l.concurrency)
		first, second := l.primary, l.chained
		if w%2 == 1 {
			first, second = second, first
		}
		for _, list := range []*libcni.NetworkConfigList{first, second} {
			boxes, out := chained[lo:hi], &add.chained
			if list == l.primary {
				boxes, out = primary[lo:hi], &add.primary
			}
			d, errs := wave(boxes, func(s *sandbox) error {
				_, err := l.cni.AddNetworkList(ctx, list, s.rt())
				return err
			})
			*out = append(*out, d...)
			add.errors += errs
		}
	}
	if l.annotated {
		if err := l.waitAnnotated(ctx, chained); err != nil {
			return add, del, err
		}
	}
	if err := l.settle(ctx); err != nil {
		return add, del, err
	}
	if err := end(); err != nil {
		return add, del, err
	}

	// DEL: as kubelet does it, the pod object is deleted (gracefully)
	// first, and the sandbox is torn down once its containers stopped;
	// then the object goes for good.
	end = l.window("DEL")
	grace := int64(30)
	for _, s := range chained {
		if err := pods.Delete(ctx, s.name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
			return add, del, fmt.Errorf("delete pod: %w", err)
		}
	}
	if err := l.settle(ctx); err != nil {
		return add, del, err
	}
	for w := 0; w*l.concurrency < n; w++ {
		lo, hi := w*l.concurrency, min(n, (w+1)*l.concurrency)
		first, second := l.primary, l.chained
		if w%2 == 1 {
			first, second = second, first
		}
		for _, list := range []*libcni.NetworkConfigList{first, second} {
			boxes, out := chained[lo:hi], &del.chained
			if list == l.primary {
				boxes, out = primary[lo:hi], &del.primary
			}
			d, errs := wave(boxes, func(s *sandbox) error {
				return l.cni.DelNetworkList(ctx, list, s.rt())
			})
			*out = append(*out, d...)
			del.errors += errs
		}
	}
	zero := int64(0)
	for _, s := range chained {
		if err := pods.Delete(ctx, s.name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			return add, del, fmt.Errorf("remove pod: %w", err)
		}
	}
	if err := l.settle(ctx); err != nil {
		return add, del, err
	}
	return add, del, end()
}

// waitAnnotated waits until every pod of boxes carries the redirection
// annotation `enabled` (the bench's own reads are not the agent's: the
// audit log counts only the agent's requests).
func (l *latencyRun) waitAnnotated(ctx context.Context, boxes []*sandbox) error {
	deadline := time.Now().Add(2 * time.Minute)
	pods := l.client.CoreV1().Pods(l.namespace)
	for _, s := range boxes {
		for {
			p, err := pods.Get(ctx, s.name, metav1.GetOptions{})
			if err != nil {
				return fmt.Errorf("read pod %s: %w", s.name, err)
			}
			if p.Annotations[ambient.RedirectionAnnotation] == ambient.RedirectionEnabled {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("pod %s not annotated %s=%s 2 minutes after its ADD (has %q)",
					s.name, ambient.RedirectionAnnotation, ambient.RedirectionEnabled, p.Annotations[ambient.RedirectionAnnotation])
			}
			if err := sleep(ctx, 20*time.Millisecond); err != nil {
				return err
			}
		}
	}
	return nil
}

// wave runs f on every sandbox at once and returns each call's duration;
// failed calls are counted, not timed.
func wave(boxes []*sandbox, f func(*sandbox) error) ([]time.Duration, int) {
	var (
		mu    sync.Mutex
		out   []time.Duration
		fails int
		wg    sync.WaitGroup
	)
	start := make(chan struct{})
	for _, s := range boxes {
		wg.Go(func() {
			<-start
			t0 := time.Now()
			err := f(s)
			d := time.Since(t0)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				fails++
				return
			}
			out = append(out, d)
		})
	}
	close(start)
	wg.Wait()
	return out, fails
}

// podObject is a Pod bound to node, as the scheduler leaves it.
func podObject(namespace, name, node string) *corev1.Pod {
	f := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: corev1.PodSpec{
			NodeName:                     node,
			AutomountServiceAccountToken: &f,
			Containers:                   []corev1.Container{{Name: "app", Image: "docker.io/local/app:1", ImagePullPolicy: corev1.PullNever}},
		},
	}
}

// quantile returns the q-quantile (nearest rank) of ds.
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s)) + 0.999999)
	return s[min(max(i-1, 0), len(s)-1)]
}
