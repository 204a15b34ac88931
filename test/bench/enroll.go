package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// startPods runs n pods in namespace on the simulated kubelet: netns, CNI
// ADD through the node's conflist, a process in a kubelet-shaped cgroup,
// status Running with its IP. A few at a time, as a kubelet starts them.
func startPods(ctx context.Context, node *kubesim.Node, namespace string, n int) ([]*kubesim.Pod, error) {
	pods := make([]*kubesim.Pod, n)
	errs := make(chan error, n)
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			err := kubesim.Catch(func() error {
				p, err := node.Run(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: fmt.Sprintf("run-%03d", i)}})
				pods[i] = p
				return err
			})
			if err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return pods, errors.Join(all...)
}

// teardown removes pods' sandboxes (CNI DEL through node.Conf, process,
// netns) a few at a time; the objects stay (the API server goes with the run).
func teardown(node *kubesim.Node, pods []*kubesim.Pod) error {
	return eachPod(pods, func(p *kubesim.Pod) error { return node.Teardown(context.Background(), p) })
}

// deletePods deletes pods as a user and kubelet do (the object marked,
// the sandbox torn down, the object removed) a few at a time. A running
// pod's sandbox is not torn down under an object left showing it
// running: the agent takes such a pod for one to capture.
func deletePods(ctx context.Context, node *kubesim.Node, pods []*kubesim.Pod) error {
	return eachPod(pods, func(p *kubesim.Pod) error { return node.Delete(ctx, p) })
}

// eachPod runs do for every pod, eight at a time, and joins the errors.
func eachPod(pods []*kubesim.Pod, do func(*kubesim.Pod) error) error {
	errs := make(chan error, len(pods))
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, p := range pods {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := do(p); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// flipTimes are the two ends of an enrollment: every pod served by
// ztunnel (its rules in place and the stand-in's ack: the dataplane), and
// every pod annotated enabled (what istiod sees; the API writes).
type flipTimes struct {
	captured, enabled time.Duration
}

// enrollFlip labels the namespace ambient and returns how long it took
// until every one of its n pods was annotated enabled, watching the pods
// (a watch, not polling, so the benchmark adds no list load), and until
// served reported them all served by the ztunnel stand-in.
func enrollFlip(ctx context.Context, client kubernetes.Interface, namespace string, n int, limit time.Duration, zt *ztunnel.StandIn, uids []types.UID) (flipTimes, error) {
	var times flipTimes
	var capturedAt time.Time
	servedAll := func() bool {
		for _, u := range uids {
			if _, ok := zt.Workload(string(u)); !ok {
				return false
			}
		}
		return true
	}
	zctx, zcancel := context.WithCancel(ctx)
	defer zcancel()
	zdone := make(chan error, 1)
	took, err := enrollWatch(ctx, client, namespace, n, limit, func() {
		go func() {
			err := zt.Wait(zctx, servedAll)
			capturedAt = time.Now()
			zdone <- err
		}()
	})
	if err != nil {
		return times, err
	}
	times.enabled = took.d
	if err := <-zdone; err != nil {
		return times, fmt.Errorf("pods not all served by the stand-in: %w", err)
	}
	times.captured = capturedAt.Sub(took.start)
	return times, nil
}

type started struct {
	start time.Time
	d     time.Duration
}

func enrollWatch(ctx context.Context, client kubernetes.Interface, namespace string, n int, limit time.Duration, onStart func()) (started, error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	pods := client.CoreV1().Pods(namespace)
	list, err := pods.List(ctx, metav1.ListOptions{})
	if err != nil {
		return started{}, err
	}
	if len(list.Items) != n {
		return started{}, fmt.Errorf("namespace %s holds %d pods, want %d", namespace, len(list.Items), n)
	}
	enabled := map[types.UID]bool{}
	for _, p := range list.Items {
		if p.Annotations[ambient.RedirectionAnnotation] != "" {
			return started{}, fmt.Errorf("pod %s is annotated before the label", p.Name)
		}
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		return started{}, err
	}
	defer w.Stop()
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}})
	start := time.Now()
	onStart()
	if _, err := client.CoreV1().Namespaces().Patch(ctx, namespace, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return started{}, fmt.Errorf("label namespace %s: %w", namespace, err)
	}
	for len(enabled) < n {
		select {
		case <-ctx.Done():
			return started{}, fmt.Errorf("%d of %d pods enabled after %v", len(enabled), n, time.Since(start).Round(time.Millisecond))
		case ev, ok := <-w.ResultChan():
			if !ok {
				return started{}, fmt.Errorf("pod watch closed with %d of %d pods enabled", len(enabled), n)
			}
			if ev.Type == watch.Error {
				return started{}, fmt.Errorf("pod watch: %v", ev.Object)
			}
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			if p.Annotations[ambient.RedirectionAnnotation] == ambient.RedirectionEnabled {
				enabled[p.UID] = true
			} else {
				delete(enabled, p.UID)
			}
		}
	}
	return started{start, time.Since(start)}, nil
}

// enrollNode is the simulated kubelet that runs the pods of the
// enrollment flips, and the pods it runs.
type enrollNode struct {
	kube    *kubesim.Node
	own     *kubesim.Owner
	running []*kubesim.Pod
	// pluginLog takes the plugins' stderr (istio-cni's plugin logs each
	// call), out of the progress output.
	pluginLog *os.File
}

// newEnrollNode makes a simulated kubelet named name, its files under dir,
// whose runtime runs the chained conflist with the plugins of binDir.
// pidns, when set, is the PID namespace its pods' processes start in (the
// agent's, when the agent has one of its own and finds pods in its /proc).
func newEnrollNode(dir string, client kubernetes.Interface, name, binDir string, chained []byte, pidns string) (*enrollNode, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	log, err := os.Create(filepath.Join(dir, "plugin-stderr.log"))
	if err != nil {
		return nil, err
	}
	e := &enrollNode{own: &kubesim.Owner{Dir: dir}, pluginLog: log}
	if err := kubesim.Catch(func() error {
		e.kube = kubesim.NewNode(e.own, client, name, []string{binDir}, chained)
		return nil
	}); err != nil {
		log.Close()
		return nil, err
	}
	e.kube.CNI = libcni.NewCNIConfigWithCacheDir([]string{binDir}, filepath.Join(dir, "cni-cache"),
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: log}, PluginDecoder: version.PluginDecoder{}})
	e.kube.PIDNamespace = pidns
	return e, nil
}

// Close tears the pods down through primary, the chain without the mesh's
// plugin, and removes the node's files.
func (e *enrollNode) Close(primary *libcni.NetworkConfigList) error {
	e.kube.Conf = primary
	err := teardown(e.kube, e.running)
	e.running = nil
	err = errors.Join(err, kubesim.Catch(func() error { e.own.Close(); return nil }))
	return errors.Join(err, e.pluginLog.Close())
}

// enrollRunning measures the enrollment flips of r.sz.enroll running pods
// on node, each in a namespace of its own labelled ambient at once, into
// r.res.Enroll: time until all annotated and until all served by the
// ztunnel stand-in, the agent's CPU and API requests over the flip, and
// the agent's memory after the largest. qps and burst are the agent's
// client-side limit: before each flip its token bucket refills.
func (r *backendRun) enrollRunning(ctx context.Context, node *enrollNode, qps float64, burst int) error {
	order := []int{len(r.sz.enroll) - 1}
	for i := range len(r.sz.enroll) - 1 {
		order = append(order, i)
	}
	// The large flip first, so the RSS after it is the agent's with
	// exactly that many pods enrolled.
	type flip struct {
		ns   string
		pods int
		uids []types.UID
	}
	var flips []flip
	for _, i := range order {
		n := r.sz.enroll[i]
		ns, err := createNamespace(ctx, r.client, fmt.Sprintf("enroll-%d-%s", n, r.res.Name), nil)
		if err != nil {
			return err
		}
		r.logf("starting %d running pods", n)
		pods, err := startPods(ctx, node.kube, ns, n)
		for _, p := range pods {
			if p != nil {
				node.running = append(node.running, p)
			}
		}
		if err != nil {
			return fmt.Errorf("start running pods: %w", err)
		}
		var uids []types.UID
		for _, p := range pods {
			uids = append(uids, p.Obj.UID)
		}
		flips = append(flips, flip{ns, n, uids})
	}
	enrolls := make([]Enroll, len(r.sz.enroll))
	// Between flips the client's token bucket refills (burst/QPS): a
	// flip starts with the burst available, as one after a quiet spell
	// does on a node.
	refill := time.Duration(float64(burst) / qps * float64(time.Second))
	for k, f := range flips {
		if err := r.settle(ctx); err != nil {
			return err
		}
		if err := sleep(ctx, refill); err != nil {
			return err
		}
		var stopProfile func() ([]string, error)
		var err error
		if r.o.Profile && k == 0 {
			if stopProfile, err = r.profile(fmt.Sprintf("enroll-%d", f.pods)); err != nil {
				return err
			}
		}
		cpu0, err := procstat.ReadCPU(r.pid())
		if err != nil {
			return err
		}
		mark, err := r.auditLog.mark()
		if err != nil {
			return err
		}
		times, err := enrollFlip(ctx, r.client, f.ns, f.pods, 10*time.Minute, r.zt, f.uids)
		took := times.enabled
		if err != nil {
			return fmt.Errorf("enroll %d running pods: %w", f.pods, err)
		}
		if err := r.settle(ctx); err != nil {
			return err
		}
		cpu1, err := procstat.ReadCPU(r.pid())
		if err != nil {
			return err
		}
		if stopProfile != nil {
			files, err := stopProfile()
			if err != nil {
				return err
			}
			r.res.Profiles = append(r.res.Profiles, files...)
		}
		reqs := r.auditLog.since(mark)
		cpu := cpu1.Sub(cpu0)
		e := Enroll{
			Pods: f.pods, Seconds: took.Seconds(), MsPerPod: ms(took) / float64(f.pods),
			CPUMsPerPod: ms(cpu.Total()) / float64(f.pods), OwnCPUMsPerPod: ms(cpu.Own) / float64(f.pods),
			APIPerPod: float64(len(reqs)) / float64(f.pods), APIRequests: summarize(reqs), APIServerMs: meanServerMs(reqs),
			APIPerSecond: float64(len(reqs)) / took.Seconds(), Running: len(node.running),
			CapturedSeconds: times.captured.Seconds(),
		}
		r.logf("enrolled %d running pods in %.2f s (%.1f ms per pod, %.2f API requests per pod, agent CPU %.2f ms per pod; all served by ztunnel after %.2f s)", f.pods, e.Seconds, e.MsPerPod, e.APIPerPod, e.CPUMsPerPod, e.CapturedSeconds)
		if k == 0 {
			if r.res.MemoryPods, err = r.memory(); err != nil {
				return err
			}
			r.res.RSSPodsMB, r.res.RSSPods = r.res.MemoryPods.RSSMiB, f.pods
		}
		enrolls[order[k]] = e
	}
	r.res.Enroll = enrolls
	return nil
}
