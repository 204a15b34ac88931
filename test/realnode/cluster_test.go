//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
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

	t.Run("pods across nodes", func(t *testing.T) { testAcrossNodes(ctx, t, n, w) })
	t.Run("mesh across nodes", func(t *testing.T) { testMeshAcrossNodes(ctx, t, n, w) })
}

// testAcrossNodes: a pod on each node reaches the other through flannel,
// and each sees the other's pod address.
func testAcrossNodes(ctx context.Context, t *testing.T, n *Node, w *Worker) {
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

// meshPod is a pod of the mesh test: on which node, captured or not.
type meshPod struct {
	pod      *corev1.Pod
	node     string
	captured bool
}

// testMeshAcrossNodes: the chart installed once runs an agent on each
// node; with a ztunnel stand-in on each, a captured pod's outbound
// connection to a captured pod on the other node goes through its node's
// stand-in (15001) over the HBONE-shaped tunnel to the destination pod's
// 15008 on the other node; an uncaptured client's arrives on 15006; a
// captured client reaches an uncaptured server directly. Each server sees
// the source it should: a captured server its own address (the stand-in
// inside it delivered), an uncaptured one the client pod's.
func testMeshAcrossNodes(ctx context.Context, t *testing.T, n *Node, w *Worker) {
	for _, start := range []func(context.Context) error{n.StartStandIn, w.StartStandIn} {
		if err := start(ctx); err != nil {
			t.Fatal(err)
		}
	}
	begin := time.Now()
	if err := n.InstallAgent(ctx, "install", ImageTag); err != nil {
		t.Fatal(err)
	}
	agents, err := n.AgentPods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	perNode := map[string]int{}
	for _, a := range agents {
		perNode[a.Spec.NodeName]++
	}
	if len(agents) != 2 || perNode[n.Name] != 1 || perNode[w.Name] != 1 {
		t.Fatalf("agents per node: %v, want one on %s and one on %s", perNode, n.Name, w.Name)
	}
	t.Logf("chart installed once, one agent per node ready in %v", time.Since(begin).Round(100*time.Millisecond))

	suffix := randHex(4)
	mesh, plain := "mesh-"+suffix, "plain-"+suffix
	if err := n.CreateNamespace(ctx, mesh, map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}); err != nil {
		t.Fatal(err)
	}
	if err := n.CreateNamespace(ctx, plain, nil); err != nil {
		t.Fatal(err)
	}
	specs := map[string]*corev1.Pod{
		"cap-first":    n.AppPod(mesh, "cap-first", AppOptions{}),
		"cap-second":   w.AppPod(mesh, "cap-second", AppOptions{}),
		"plain-first":  n.AppPod(plain, "plain-first", AppOptions{}),
		"plain-second": w.AppPod(plain, "plain-second", AppOptions{}),
	}
	pods := map[string]*meshPod{}
	for name, p := range specs {
		if _, err := n.Client.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pods[name] = &meshPod{node: p.Spec.NodeName, captured: p.Namespace == mesh}
	}
	for name, p := range specs {
		ready, err := n.WaitPodReady(ctx, p.Namespace, name)
		if err != nil {
			t.Fatal(err)
		}
		pods[name].pod = ready
	}
	captured := func(mp *meshPod) func(context.Context) (bool, error) {
		if mp.node == w.Name {
			return func(ctx context.Context) (bool, error) { return w.Captured(ctx, mp.pod) }
		}
		return func(ctx context.Context) (bool, error) { return n.Captured(ctx, mp.pod) }
	}
	for name, mp := range pods {
		if mp.captured {
			if err := n.Poll(ctx, name+" captured", captured(mp)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Each stand-in learns the other node's captured pods, as ztunnel
	// learns HBONE workloads from istiod.
	if err := n.SetStandInRemote(ctx, []string{pods["cap-second"].pod.Status.PodIP}); err != nil {
		t.Fatal(err)
	}
	if err := w.SetStandInRemote(ctx, []string{pods["cap-first"].pod.Status.PodIP}); err != nil {
		t.Fatal(err)
	}
	records := func(ctx context.Context, node string) ([]ztunnel.Record, error) {
		if node == w.Name {
			return w.StandInRecords(ctx)
		}
		return n.StandInRecords(ctx)
	}
	tunneled := 0
	for _, from := range []string{"cap-first", "plain-first", "cap-second", "plain-second"} {
		for _, to := range []string{"cap-first", "plain-first", "cap-second", "plain-second"} {
			a, b := pods[from], pods[to]
			if a.node == b.node {
				continue
			}
			marker := fmt.Sprintf("/mesh-%s-to-%s", from, to)
			if err := fetch(ctx, a.pod, b.pod, marker); err != nil {
				t.Errorf("%s → %s: %v", from, to, err)
				continue
			}
			dst := netip.AddrPortFrom(netip.MustParseAddr(b.pod.Status.PodIP), AppPort)
			err := n.Poll(ctx, from+" → "+to+" in the stand-ins' records", func(ctx context.Context) (bool, error) {
				if a.captured {
					recs, err := records(ctx, a.node)
					if err != nil {
						return false, err
					}
					if !slices.ContainsFunc(recordsOf(recs, a.pod.UID), func(r ztunnel.Record) bool {
						return r.Port == ambient.ZtunnelOutboundPort && r.OrigDst == dst && r.Tunneled == b.captured && r.Err == ""
					}) {
						return false, fmt.Errorf("no outbound record of %s to %s (tunneled: %v) on %s", from, dst, b.captured, a.node)
					}
				}
				if b.captured {
					port := ambient.ZtunnelInboundPlaintextPort
					if a.captured {
						port = ambient.ZtunnelInboundHBONEPort
					}
					recs, err := records(ctx, b.node)
					if err != nil {
						return false, err
					}
					if !slices.ContainsFunc(recordsOf(recs, b.pod.UID), func(r ztunnel.Record) bool {
						return r.Port == port && r.OrigDst == dst && r.Err == ""
					}) {
						return false, fmt.Errorf("no inbound record on %d of %s from %s on %s", port, to, from, b.node)
					}
				}
				return true, nil
			})
			if err != nil {
				t.Error(err)
				continue
			}
			if a.captured && b.captured {
				tunneled++
			}
			seen, err := seenFrom(ctx, b.pod, marker)
			if err != nil {
				t.Error(err)
				continue
			}
			want := a.pod.Status.PodIP
			if b.captured {
				want = b.pod.Status.PodIP // delivered by the stand-in inside it
			}
			if seen.String() != want {
				t.Errorf("%s saw %s's request from %s, want %s", to, from, seen, want)
			}
		}
	}
	t.Logf("connections through the tunnel across nodes: %d", tunneled)
	// kubelet's probes on each node still reach the captured pods.
	for name, mp := range pods {
		if _, err := n.WaitPodReady(ctx, mp.pod.Namespace, name); err != nil {
			t.Error(err)
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
