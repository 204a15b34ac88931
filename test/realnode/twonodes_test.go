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
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
	"github.com/ambient-cni/ambient-cni/test/realnode/podapp"
)

// Two real nodes in one cluster: the first node (control plane, kubelet
// and containerd in the host's namespaces) and a worker with its own
// kubelet, containerd, network and mount namespaces, joined by flannel
// (kube subnet manager, host-gw). A pod on each node reaches the other
// across the nodes, and each sees the other's pod address (no
// masquerading between nodes). The file's name puts it after the
// single-node tests (go test runs files in name order): it needs istiod,
// which make check builds beside the first e2e tests.
func TestRealNodeCluster(t *testing.T) {
	ctx, out, _ := startNodeTest(t)
	n, err := Up(ctx, Options{Out: out, Images: testImages})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Down(); err != nil {
			t.Error(err)
		}
	})
	// istiod's node-untaint controller (its chart's taint.enabled) takes
	// the startup taint off a joining node once our agent is ready there,
	// as in a cluster whose node pools register with the taint.
	ist, err := n.StartIstiod(ctx, IstiodOptions{Untaint: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ist.Stop() }) // before Down (cleanups run last first)
	joinStart := time.Now()
	w, err := n.AddWorker(ctx, WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("node %s joined and Ready with flannel in %v", w.Name, time.Since(joinStart).Round(100*time.Millisecond))

	t.Run("pods across nodes", func(t *testing.T) { testAcrossNodes(ctx, t, n, w) })
	var pods map[string]*meshPod
	t.Run("mesh across nodes", func(t *testing.T) { pods = testMeshAcrossNodes(ctx, t, n, w) })
	if pods == nil {
		return
	}
	t.Run("cordon changes nothing", func(t *testing.T) { testCordon(ctx, t, n, w, pods) })
	t.Run("join and leave", func(t *testing.T) { testJoinLeave(ctx, t, n) })
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
// inside it delivered), an uncaptured one the client pod's. kubelet's
// probes on each node reach the captured pods directly, SNATed.
func testMeshAcrossNodes(ctx context.Context, t *testing.T, n *Node, w *Worker) map[string]*meshPod {
	for _, start := range []func(context.Context) error{n.StartStandIn, w.StartStandIn} {
		if err := start(ctx); err != nil {
			t.Fatal(err)
		}
	}
	begin := time.Now()
	// The chart's defaults (the agent's own startup-taint handling off):
	// istiod untaints a node joining later once its agent is ready.
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

	pods := startMeshPods(ctx, t, n, w, "mesh")
	tunneled := checkAcross(ctx, t, n, w, pods, "/mesh")
	t.Logf("connections through the tunnel across nodes: %d", tunneled)
	// kubelet's probes on each node still reach the captured pods
	// directly, SNATed by that node's agent to the probe address (through
	// the stand-in, the app would see its own address).
	for name, mp := range pods {
		if _, err := n.WaitPodReady(ctx, mp.pod.Namespace, name); err != nil {
			t.Error(err)
		}
		if !mp.captured {
			continue
		}
		var seen []string
		err := n.Poll(ctx, "probes of "+name, func(ctx context.Context) (bool, error) {
			var err error
			seen, err = n.probedFromSNAT(ctx, mp.pod)
			return err == nil, err
		})
		if err != nil {
			t.Errorf("%s on %s: %v", name, mp.node, err)
			continue
		}
		t.Logf("%s on %s: kubelet's probes arrive from %s (SNAT); probe sources seen %v", name, mp.node, ambient.DefaultProbeSNATv4, seen)
	}
	if t.Failed() {
		return nil
	}
	return pods
}

// startMeshPods starts a captured pod (an ambient namespace's) and a
// plain one on each node, in namespaces named after prefix, waits until
// the captured ones are, and tells each node's stand-in the other's
// captured pod, as istiod tells ztunnel its HBONE workloads. The pods are
// named cap-first, plain-first (the first node), cap-second and
// plain-second (the worker).
func startMeshPods(ctx context.Context, t *testing.T, n *Node, w *Worker, prefix string) map[string]*meshPod {
	t.Helper()
	suffix := randHex(4)
	mesh, plain := prefix+"-"+suffix, prefix+"-plain-"+suffix
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
	for name, mp := range pods {
		if !mp.captured {
			continue
		}
		captured := func(ctx context.Context) (bool, error) { return n.Captured(ctx, mp.pod) }
		if mp.node == w.Name {
			captured = func(ctx context.Context) (bool, error) { return w.Captured(ctx, mp.pod) }
		}
		if err := n.Poll(ctx, name+" captured", captured); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.SetStandInRemote(ctx, []string{pods["cap-second"].pod.Status.PodIP}); err != nil {
		t.Fatal(err)
	}
	if err := w.SetStandInRemote(ctx, []string{pods["cap-first"].pod.Status.PodIP}); err != nil {
		t.Fatal(err)
	}
	return pods
}

// checkAcross makes a request from each pod of startMeshPods to each pod
// on the other node and checks its path: a captured client's through its
// node's stand-in (tunneled when the server is captured), a captured
// server's through its own; each server sees the source it should (a
// captured server its own address, as the stand-in inside it delivered;
// an uncaptured one the client pod's). It returns the number of requests
// that took the tunnel. marker prefixes the requests' paths: one per call.
func checkAcross(ctx context.Context, t *testing.T, n *Node, w *Worker, pods map[string]*meshPod, marker string) (tunneled int) {
	t.Helper()
	records := func(ctx context.Context, node string) ([]ztunnel.Record, error) {
		if node == w.Name {
			return w.StandInRecords(ctx)
		}
		return n.StandInRecords(ctx)
	}
	for _, from := range []string{"cap-first", "plain-first", "cap-second", "plain-second"} {
		for _, to := range []string{"cap-first", "plain-first", "cap-second", "plain-second"} {
			a, b := pods[from], pods[to]
			if a.node == b.node {
				continue
			}
			path := fmt.Sprintf("%s-%s-to-%s", marker, from, to)
			if err := fetch(ctx, a.pod, b.pod, path); err != nil {
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
			seen, err := seenFrom(ctx, b.pod, path)
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
	return tunneled
}

// agentOn returns the agent pod on a node.
func agentOn(ctx context.Context, n *Node, node string) (*corev1.Pod, error) {
	pods, err := n.AgentPods(ctx)
	if err != nil {
		return nil, err
	}
	for i := range pods {
		if pods[i].Spec.NodeName == node {
			return &pods[i], nil
		}
	}
	return nil, fmt.Errorf("no agent pod on %s", node)
}

// testCordon: cordoning and uncordoning a node changes nothing: the same
// agent pod runs there, its captured pod stays captured, the tunnel across
// the nodes carries on.
func testCordon(ctx context.Context, t *testing.T, n *Node, w *Worker, pods map[string]*meshPod) {
	before, err := agentOn(ctx, n, w.Name)
	if err != nil {
		t.Fatal(err)
	}
	for i, on := range []bool{true, false} {
		if err := w.Cordon(ctx, on); err != nil {
			t.Fatal(err)
		}
		marker := fmt.Sprintf("/cordon-%d", i)
		if err := fetch(ctx, pods["cap-first"].pod, pods["cap-second"].pod, marker); err != nil {
			t.Errorf("cordon=%v: cap-first → cap-second: %v", on, err)
		}
		if ok, err := w.Captured(ctx, pods["cap-second"].pod); !ok {
			t.Errorf("cordon=%v: cap-second no longer captured: %v", on, err)
		}
		now, err := agentOn(ctx, n, w.Name)
		if err != nil {
			t.Fatal(err)
		}
		if now.UID != before.UID {
			t.Errorf("cordon=%v: the agent pod on %s changed (%s → %s)", on, w.Name, before.Name, now.Name)
		}
	}
}

// testJoinLeave: a node registered with the startup taint joins: the
// DaemonSet's agent runs there and becomes ready, istiod takes the taint
// off, and a pod started there is captured. Then the node is drained and
// deleted: its agent releases its pod, and nothing of it is left in the
// first node's agent or stand-in.
func testJoinLeave(ctx context.Context, t *testing.T, n *Node) {
	begin := time.Now()
	w, err := n.AddWorker(ctx, WorkerOptions{StartupTaint: true})
	if err != nil {
		t.Fatal(err)
	}
	joined := time.Now()
	t.Logf("node %s registered with the startup taint and Ready in %v", w.Name, joined.Sub(begin).Round(100*time.Millisecond))
	if err := w.StartStandIn(ctx); err != nil {
		t.Fatal(err)
	}
	err = n.Poll(ctx, "agent ready on "+w.Name+" and the startup taint gone", func(ctx context.Context) (bool, error) {
		a, err := agentOn(ctx, n, w.Name)
		if err != nil {
			return false, err
		}
		if !podReady(a) {
			return false, fmt.Errorf("agent %s not ready: %s", a.Name, podSummary(a))
		}
		node, err := n.Client.CoreV1().Nodes().Get(ctx, w.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, tn := range node.Spec.Taints {
			if tn.Key == nodetaint.Key {
				return false, fmt.Errorf("taint %s still on %s", tn.Key, w.Name)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	mesh := "join-" + randHex(4)
	if err := n.CreateNamespace(ctx, mesh, map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}); err != nil {
		t.Fatal(err)
	}
	p := w.AppPod(mesh, "joined", AppOptions{})
	if _, err := n.Client.CoreV1().Pods(mesh).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ready, err := n.WaitPodReady(ctx, mesh, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Poll(ctx, "joined pod captured", func(ctx context.Context) (bool, error) { return w.Captured(ctx, ready) }); err != nil {
		t.Fatal(err)
	}
	t.Logf("node join to first captured pod: %v", time.Since(joined).Round(100*time.Millisecond))

	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	err = n.Poll(ctx, "the drained node's agent released its pod", func(ctx context.Context) (bool, error) {
		st, err := w.AgentState(ctx)
		if err != nil {
			return false, err
		}
		for _, ap := range st {
			if ap.UID == string(ready.UID) {
				return false, fmt.Errorf("agent on %s still has %s/%s (%s)", w.Name, ap.Namespace, ap.Name, ap.State)
			}
		}
		wls, err := w.StandInWorkloads(ctx)
		if err != nil {
			return false, err
		}
		for _, wl := range wls {
			if wl.UID == string(ready.UID) {
				return false, fmt.Errorf("the stand-in on %s still serves it", w.Name)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	if err := w.Down(); err != nil {
		t.Fatal(err)
	}
	err = n.Poll(ctx, "one agent per node left", func(ctx context.Context) (bool, error) {
		agents, err := n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		for _, a := range agents {
			if a.Spec.NodeName == w.Name {
				return false, fmt.Errorf("agent %s of the deleted node still exists", a.Name)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	st, err := n.AgentState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wls, err := n.StandInWorkloads(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, ap := range st {
		if ap.UID == string(ready.UID) {
			t.Errorf("the first node's agent has the deleted node's pod %s/%s", ap.Namespace, ap.Name)
		}
	}
	for _, wl := range wls {
		if wl.UID == string(ready.UID) {
			t.Errorf("the first node's stand-in serves the deleted node's pod")
		}
	}
}

// podReady reports the Ready condition.
func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
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
