package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
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
	errs := make(chan error, len(pods))
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, p := range pods {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := node.Teardown(context.Background(), p); err != nil {
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
