//go:build realnode

package realnode

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/kubectlplugin"
)

// A second node joins in the middle of the switch: the first node is
// ambient-cni's (block 4 ran there), istio-cni's DaemonSet runs on
// labelled nodes (block 2) and ours on every node (block 3). The new node
// registers labelled for istio-cni, as a node pool carries a label (block
// 2: new nodes get it or not), so istio-cni takes it and ours stands by
// there. Pods on the two nodes reach each other both ways while one node
// is ours and the other istio-cni's; then the new node switches by block
// 4, with connections across the nodes held and a request loop running
// and an ambient pod created on it every 2 s, and they still do. The node
// then leaves: the later steps are the first node's alone.
func (s *switchTest) testSecondNode(t *testing.T) {
	ctx := context.Background()
	m := s.mode() + "-second-node"
	mk := newMarker()
	mk.mark("join")
	w, err := s.n.AddWorker(ctx, WorkerOptions{Labels: map[string]string{kubectlplugin.SwitchLabel: "on"}, IstioCNI: s.ic})
	if err != nil {
		t.Fatalf("a second node joins: %v", err)
	}
	defer func() {
		if err := w.Down(); err != nil {
			t.Errorf("node %s leaves: %v", w.Name, err)
		}
	}()
	if err := w.StartStandIn(ctx); err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(s.n.Dir, s.n.CNIConfDir)
	if err != nil {
		t.Fatal(err)
	}
	confDir := w.host(rel)
	loaded := func() (string, []byte, error) {
		p, err := runtimeConfIn(confDir)
		if err != nil {
			return "", nil, err
		}
		b, err := os.ReadFile(p)
		return p, b, err
	}
	if err := s.waitChainIn(ctx, loaded, "istio-cni", "ambient-cni"); err != nil {
		t.Fatalf("istio-cni on the new node: %v", err)
	}
	if err := s.waitStandingBy(ctx, w.Name); err != nil {
		t.Fatal(err)
	}
	mk.mark("standing by")
	mk.span(t, m+"-join-to-ours-standing-by-seconds", "join", "standing by")

	// One node ours, the other istio-cni's: both ways across.
	pods := startMeshPods(ctx, t, s.n, w, "second")
	if n := checkAcross(ctx, t, s.n, w, pods, "/mixed"); n != 2 {
		t.Errorf("%d requests took the tunnel between a node of ours and one of istio-cni's, want 2 (one each way)", n)
	}
	if t.Failed() {
		return
	}
	ns := pods["cap-second"].pod.Namespace

	// The new node switches under traffic across the nodes.
	tr := s.crossTraffic(t, w, pods)
	defer tr.Stop()
	firstBefore := s.traffic.Counts()
	crossBefore := tr.Counts()
	stopChain := chainSampler(loaded)
	stopSample := sampleWorkerCapture(w, ns)
	sampledFrom := time.Now()
	kinds := []podKind{{name: "ns", ns: ns, ambient: true}}
	created, err := s.createKindsDuring(t, onWorker(w), kinds, "second", func() error {
		return s.switchNodeOf(ctx, t, mk.mark, w.Name, loaded, holds(w.AgentState, ns, "cap-second"))
	})
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	sampled := time.Since(sampledFrom)
	if err := tr.Settle(ctx, time.Now(), time.Minute); err != nil {
		t.Error(err)
	}
	cross := tr.Counts().Sub(crossBefore)
	first := s.settled(t, firstBefore)
	if err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	mk.span(t, m+"-node-label-to-istio-cni-gone-seconds", "node switch", "istio-cni gone")
	mk.span(t, m+"-node-label-to-ours-chained-seconds", "node switch", "ours chained")
	mk.span(t, m+"-node-label-to-pods-adopted-seconds", "node switch", "adopted")

	if order := checkChains(t, "second node's switch", chains, false, false); strings.Join(order, ",") != "istio-cni,ambient-cni" {
		t.Errorf("the new node's chain ended in %v during its switch, want istio-cni's then ours", order)
	}
	figure(t, m+"-capture-samples", samples)
	figure(t, m+"-sandboxes-sampled", sandboxes)
	figure(t, m+"-sampled-seconds", sampled.Round(100*time.Millisecond).Seconds())
	figure(t, m+"-window-uncaptured-samples", len(bad))
	if samples == 0 {
		t.Errorf("no sample of the new node's ambient pods was taken (%d sandboxes)", sandboxes)
	}
	if len(bad) > 0 {
		t.Errorf("ambient pods of the new node seen uncaptured:\n%s", strings.Join(bad, "\n"))
	}
	figure(t, m+"-across-connections-reset", cross.Broken)
	figure(t, m+"-across-requests-failed", cross.LoopFailed)
	figure(t, m+"-across-requests-ok", cross.LoopOK)
	if cross.Broken > 0 || cross.LoopFailed > 0 {
		t.Errorf("across the nodes: %d held connections broke, %d requests failed: %s", cross.Broken, cross.LoopFailed, cross.Listed())
	}
	// The first node's own traffic does not notice.
	if first.Broken > 0 || first.LoopFailed > 0 {
		t.Errorf("on the first node: %d held connections broke, %d requests failed: %s", first.Broken, first.LoopFailed, first.Listed())
	}
	s.checkKinds(t, onWorker(w), kinds, m, created)

	// Both ways across again, both nodes ours; the adopted pod holds
	// exactly the rules of a pod ours captured at its start there.
	if n := checkAcross(ctx, t, s.n, w, pods, "/ours"); n != 2 {
		t.Errorf("%d requests took the tunnel between the two nodes of ours, want 2", n)
	}
	var ref string
	for _, kp := range created {
		if kp.err == nil {
			ref = kp.name
		}
	}
	if ref != "" {
		want := s.workerRules(t, w, ns, ref)
		got := s.workerRules(t, w, ns, "cap-second")
		if !slices.Equal(got, want) {
			t.Errorf("cap-second's rules after the adoption differ from %s's (captured by ours at its start):\n%s\n--\n%s", ref, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
	for _, p := range []string{ns, pods["plain-second"].pod.Namespace} {
		_ = s.n.Client.CoreV1().Namespaces().Delete(ctx, p, metav1.DeleteOptions{})
	}
}

// crossTraffic holds connections between the captured pods of
// startMeshPods, half each way, and runs a request loop from the new
// node's to the first node's, through both stand-ins.
func (s *switchTest) crossTraffic(t *testing.T, w *Worker, pods map[string]*meshPod) *Traffic {
	t.Helper()
	ctx := context.Background()
	first, second := pods["cap-first"].pod, pods["cap-second"].pod
	firstNS, err := s.n.PodNetns(ctx, first.Namespace, first.Name)
	if err != nil {
		t.Fatal(err)
	}
	secondNS, err := w.PodNetns(ctx, second.Namespace, second.Name)
	if err != nil {
		t.Fatal(err)
	}
	there := Flow{Name: "cap-first→cap-second", Netns: firstNS, Dst: podAddr(second)}
	back := Flow{Name: "cap-second→cap-first", Netns: secondNS, Dst: podAddr(first)}
	var held []Flow
	for i := range heldConns / 2 {
		if i%2 == 0 {
			held = append(held, there)
		} else {
			held = append(held, back)
		}
	}
	tr, err := StartTraffic(ctx, held, back)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// workerRules are a worker pod's in-pod rules as normalizedRules reads
// them.
func (s *switchTest) workerRules(t *testing.T, w *Worker, ns, name string) []string {
	t.Helper()
	netns, err := w.PodNetns(context.Background(), ns, name)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := NetnsRules(context.Background(), netns)
	if err != nil {
		t.Fatal(err)
	}
	got := slices.DeleteFunc(normalizeRules(rules), emptyTableLine.MatchString)
	slices.Sort(got)
	return got
}

// sampleWorkerCapture is life.sampleCaptureIn for a worker's pods.
func sampleWorkerCapture(w *Worker, namespaces ...string) (stop func() (samples, sandboxes int, uncaptured []string)) {
	var mu sync.Mutex
	netns := map[string]string{} // by sandbox: a sandbox keeps its process
	// A look at a sandbox's rules as NetnsRules takes it (eight processes)
	// took about a second on a node busy with the switch, so a 3-second
	// window got two rounds: the look is captureProbe's one process, and
	// the listing (crictl in the worker's namespaces) is kept a second.
	var (
		listed   []readySandbox
		listedAt time.Time
	)
	return sampleCaptureVia(func(ctx context.Context) ([]readySandbox, error) {
		if time.Since(listedAt) < time.Second {
			return listed, nil
		}
		sbs, err := readySandboxesVia(ctx, w.crictl, namespaces)
		if err != nil {
			return nil, err
		}
		listed, listedAt = sbs, time.Now()
		return sbs, nil
	}, func(ctx context.Context, id string) (string, error) {
		mu.Lock()
		p := netns[id]
		mu.Unlock()
		if p == "" {
			var err error
			if p, err = w.sandboxNetns(ctx, id); err != nil {
				return "", err
			}
			mu.Lock()
			netns[id] = p
			mu.Unlock()
		}
		return captureProbe(ctx, p)
	})
}

// captureProbe is the part of NetnsRules that shows capture (HasCaptureRules)
// in a sampled netns, read by one process instead of eight: the nat
// table's chains of both iptables flavours (where the capture's redirects
// are) and the nftables tables (a native backend's is named after Istio).
func captureProbe(ctx context.Context, netns string) (string, error) {
	out, err := exec.CommandContext(ctx, "nsenter", "--net="+netns, "sh", "-c",
		"iptables-nft-save -t nat && iptables-legacy-save -t nat && nft list tables").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("capture probe in %s: %w: %s", netns, err, out)
	}
	return string(out), nil
}
