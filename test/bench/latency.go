package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
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
	// alias is a second mount of the netns the CNI calls name instead.
	alias string
}

// bindAlias mounts the sandbox's netns in dir too and names it there.
func (s *sandbox) bindAlias(dir string) error {
	if dir == "" {
		return nil
	}
	p := filepath.Join(dir, filepath.Base(s.ns.Path()))
	f, err := os.Create(p)
	if err != nil {
		return err
	}
	f.Close()
	if err := unix.Mount(s.ns.Path(), p, "", unix.MS_BIND, ""); err != nil {
		_ = os.Remove(p)
		return fmt.Errorf("bind %s at %s: %w", s.ns.Path(), p, err)
	}
	s.alias = p
	return nil
}

func newSandbox(namespace, name string, uid types.UID) (*sandbox, error) {
	netns, err := testutils.NewNS()
	if err != nil {
		return nil, fmt.Errorf("create netns: %w", err)
	}
	// Runtimes bring the sandbox's loopback up before the network's chain.
	if err := testnet.LoopbackUp(netns); err != nil {
		s := &sandbox{ns: netns}
		_ = s.close()
		return nil, fmt.Errorf("bring up lo: %w", err)
	}
	return &sandbox{ns: netns, id: testnet.RandName("", 64), namespace: namespace, name: name, uid: uid}, nil
}

func (s *sandbox) rt() *libcni.RuntimeConf {
	path := s.ns.Path()
	if s.alias != "" {
		path = s.alias
	}
	return &libcni.RuntimeConf{
		ContainerID: s.id,
		NetNS:       path,
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
	if s.alias != "" {
		if err := unix.Unmount(s.alias, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmount %s: %w", s.alias, err)
		}
		_ = os.Remove(s.alias)
	}
	return testnet.RemoveNS(s.ns)
}

// latencyRun measures CNI ADD and DEL through the chained conflist (with
// our plugin) against the primary conflist alone (bridge + host-local) in
// the same run, as blocks: a block runs one chain's ADDs (then its DELs) for
// `pods` sandboxes in waves of `concurrency` simultaneous calls, and blocks
// of the two chains alternate, one of each per rep, the order flipping
// every rep so that load drifting over the run hits both alike (the caller
// runs the reps, other systems' reps between them). Every block
// starts on a settled agent and, as far as its bounded wait allows, a quiet
// machine: the baseline never runs beside the agent's work for the
// measured pods (annotations written after the ADD returned, informer
// events), which a wave-by-wave pairing lets it absorb.
type latencyRun struct {
	client      kubernetes.Interface
	cni         *libcni.CNIConfig
	chained     *libcni.NetworkConfigList
	primary     *libcni.NetworkConfigList
	node        string
	namespace   string
	pods        int // per block
	reps        int // how many the caller runs, for the blocks' labels
	concurrency int
	// netnsDir, when set, is a shared mount where every sandbox's netns
	// (the baseline's too, so both chains get the same kind of path) is
	// bound and named: a peer agent in a mount namespace of its own sees
	// new mounts there, not those of /var/run/netns.
	netnsDir string
	// annotated: the agent captures these pods, so the ADD window stays
	// open until each carries the redirection annotation `enabled`: the
	// agent writes it off the ADD's critical path, and its PATCH counts
	// for the ADD however late it lands.
	annotated bool
	// between runs while the agent may still react (an annotation written
	// after the ADD returned; the pod deletions before DEL).
	settle func(context.Context) error
	// quiet waits (bounded) for a quiet machine before a block and
	// reports what it saw.
	quiet func(ctx context.Context, block string) (Block, error)
	// window brackets each measured block's op (CPU, API requests); rep
	// counts from 0.
	window func(op string, rep int) func() error
}

// samples are the measured durations of one op, per chain.
type samples struct {
	chained, primary []time.Duration
	errors           int
}

// rep runs one rep (counting from 0): a baseline and a measured block,
// in the order of the rep; the samples are added to add and del.
func (l *latencyRun) rep(ctx context.Context, rep int, add, del *samples) (blocks []Block, err error) {
	arms := []string{"baseline", "measured"}
	if rep%2 == 1 {
		arms[0], arms[1] = arms[1], arms[0]
	}
	for _, arm := range arms {
		if err := l.settle(ctx); err != nil {
			return blocks, err
		}
		b, err := l.quiet(ctx, fmt.Sprintf("%s block %d/%d", arm, rep+1, l.reps))
		if err != nil {
			return blocks, err
		}
		b.Arm, b.Rep = arm, rep
		blocks = append(blocks, b)
		if arm == "baseline" {
			a, d, errs, err := l.baselineBlock(ctx)
			add.primary, del.primary = append(add.primary, a...), append(del.primary, d...)
			add.errors += errs
			if err != nil {
				return blocks, err
			}
			continue
		}
		if err := l.measuredBlock(ctx, rep, add, del); err != nil {
			return blocks, err
		}
	}
	return blocks, nil
}

// baselineBlock runs the primary chain alone: ADDs, then DELs, of fresh
// sandboxes our plugin never sees (no Pod objects: the chain reads none).
func (l *latencyRun) baselineBlock(ctx context.Context) (add, del []time.Duration, errs int, err error) {
	boxes := make([]*sandbox, l.pods)
	defer func() {
		for _, s := range boxes {
			if s != nil {
				err = errors.Join(err, s.close())
			}
		}
	}()
	for i := range boxes {
		name := fmt.Sprintf("base-%d-c%d-%03d", time.Now().UnixNano()%1e6, l.concurrency, i)
		if boxes[i], err = newSandbox(l.namespace, name, types.UID(testnet.RandName("", 8))); err != nil {
			return nil, nil, 0, err
		}
		if err := boxes[i].bindAlias(l.netnsDir); err != nil {
			return nil, nil, 0, err
		}
	}
	add, errs = waves(boxes, l.concurrency, func(s *sandbox) error {
		_, err := l.cni.AddNetworkList(ctx, l.primary, s.rt())
		return err
	})
	d, derrs := waves(boxes, l.concurrency, func(s *sandbox) error {
		return l.cni.DelNetworkList(ctx, l.primary, s.rt())
	})
	return add, d, errs + derrs, nil
}

// measuredBlock runs the chained conflist over Pod objects bound to the
// node, as a kubelet would.
func (l *latencyRun) measuredBlock(ctx context.Context, rep int, add, del *samples) (err error) {
	n := l.pods
	boxes := make([]*sandbox, n)
	defer func() {
		for _, s := range boxes {
			if s != nil {
				err = errors.Join(err, s.close())
			}
		}
	}()
	pods := l.client.CoreV1().Pods(l.namespace)

	// ADD: the window opens before the Pod objects exist, so what the
	// agent does when its informer sees a new pod counts for the pod.
	end := l.window("ADD", rep)
	for i := range n {
		name := fmt.Sprintf("lat-%d-c%d-%03d", time.Now().UnixNano()%1e6, l.concurrency, i)
		obj, err := pods.Create(ctx, podObject(l.namespace, name, l.node), metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create pod: %w", err)
		}
		if boxes[i], err = newSandbox(l.namespace, name, obj.UID); err != nil {
			return err
		}
		if err := boxes[i].bindAlias(l.netnsDir); err != nil {
			return err
		}
	}
	d, errs := waves(boxes, l.concurrency, func(s *sandbox) error {
		_, err := l.cni.AddNetworkList(ctx, l.chained, s.rt())
		return err
	})
	add.chained, add.errors = append(add.chained, d...), add.errors+errs
	if l.annotated && errs == 0 {
		if err := l.waitAnnotated(ctx, boxes); err != nil {
			return err
		}
	}
	if err := l.settle(ctx); err != nil {
		return err
	}
	if err := end(); err != nil {
		return err
	}

	// DEL: as kubelet does it, the pod object is deleted (gracefully)
	// first, and the sandbox is torn down once its containers stopped;
	// then the object goes for good.
	end = l.window("DEL", rep)
	grace := int64(30)
	for _, s := range boxes {
		if err := pods.Delete(ctx, s.name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
			return fmt.Errorf("delete pod: %w", err)
		}
	}
	if err := l.settle(ctx); err != nil {
		return err
	}
	d, errs = waves(boxes, l.concurrency, func(s *sandbox) error {
		return l.cni.DelNetworkList(ctx, l.chained, s.rt())
	})
	del.chained, del.errors = append(del.chained, d...), del.errors+errs
	zero := int64(0)
	for _, s := range boxes {
		if err := pods.Delete(ctx, s.name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			return fmt.Errorf("remove pod: %w", err)
		}
	}
	if err := l.settle(ctx); err != nil {
		return err
	}
	return end()
}

// waves runs f over boxes, concurrency at a time, wave after wave.
func waves(boxes []*sandbox, concurrency int, f func(*sandbox) error) ([]time.Duration, int) {
	var out []time.Duration
	fails := 0
	for lo := 0; lo < len(boxes); lo += concurrency {
		d, errs := wave(boxes[lo:min(len(boxes), lo+concurrency)], f)
		out, fails = append(out, d...), fails+errs
	}
	return out, fails
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
