//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/test/realnode/podapp"
)

// Two real nodes in one cluster: the first node (control plane, kubelet
// and containerd in the host's namespaces) and a worker with its own
// kubelet, containerd, network and mount namespaces, joined by flannel
// (kube subnet manager, host-gw). A pod on each node reaches the other
// across the nodes, and each sees the other's pod address (no
// masquerading between nodes).
func TestRealNodeCluster(t *testing.T) {
	ctx, out, _ := startNodeTest(t)
	n, err := Up(ctx, Options{Out: out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Down(); err != nil {
			t.Error(err)
		}
	})
	joinStart := time.Now()
	w, err := n.AddWorker(ctx, WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("node %s joined and Ready with flannel in %v", w.Name, time.Since(joinStart).Round(100*time.Millisecond))

	ns := "cluster-" + randHex(4)
	if err := n.CreateNamespace(ctx, ns, nil); err != nil {
		t.Fatal(err)
	}
	pods := map[string]*corev1.Pod{}
	for _, p := range []*corev1.Pod{n.AppPod(ns, "first", AppOptions{}), w.AppPod(ns, "second", AppOptions{})} {
		if _, err := n.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"first", "second"} {
		p, err := n.WaitPodReady(ctx, ns, name)
		if err != nil {
			t.Fatal(err)
		}
		pods[name] = p
	}
	if pods["first"].Spec.NodeName == pods["second"].Spec.NodeName {
		t.Fatalf("both pods on %s", pods["first"].Spec.NodeName)
	}
	for _, pair := range [][2]string{{"first", "second"}, {"second", "first"}} {
		from, to := pods[pair[0]], pods[pair[1]]
		marker := fmt.Sprintf("/cross-%s-to-%s", pair[0], pair[1])
		if err := fetch(ctx, from, to, marker); err != nil {
			t.Errorf("%s (%s on %s) → %s (%s on %s): %v", pair[0], from.Status.PodIP, from.Spec.NodeName, pair[1], to.Status.PodIP, to.Spec.NodeName, err)
			continue
		}
		seen, err := seenFrom(ctx, to, marker)
		if err != nil {
			t.Error(err)
			continue
		}
		if seen.String() != from.Status.PodIP {
			t.Errorf("%s saw %s's request from %s, want its pod address %s", pair[1], pair[0], seen, from.Status.PodIP)
		}
	}
}

// fetch has pod from GET path on pod to (the app's /fetch) and checks the
// answer is to's.
func fetch(ctx context.Context, from, to *corev1.Pod, path string) error {
	body, err := httpGet(ctx, appURL(from, "/fetch?url="+url.QueryEscape(appURL(to, path))))
	if err != nil {
		return err
	}
	var res podapp.FetchResult
	if err := json.Unmarshal(body, &res); err != nil {
		return err
	}
	if res.Err != "" || res.Status != 200 || strings.TrimSpace(res.Body) != to.Name {
		return fmt.Errorf("status %d body %q err %q", res.Status, res.Body, res.Err)
	}
	return nil
}
