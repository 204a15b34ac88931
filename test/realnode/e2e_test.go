//go:build realnode

package realnode

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The end-to-end tests of issue 13 on a real node: `make e2e` (build tag
// realnode). One node serves every case, in order; the host is compared
// before and after.

// scanHelperEnv makes the test binary a netns scanner (see
// testPrivateCgroupNamespace) instead of running tests.
const scanHelperEnv = "AMBIENT_REALNODE_SCAN_UIDS"

func TestMain(m *testing.M) {
	if uids := os.Getenv(scanHelperEnv); uids != "" {
		os.Exit(scanHelper(uids))
	}
	os.Exit(runWithImages(m))
}

// testImages are the images the nodes of this test binary run, built by
// the first node's start (NewImageCache says why).
var testImages *ImageCache

// runWithImages runs the tests with testImages kept in a directory of
// their own, removed after the last test.
func runWithImages(m *testing.M) int {
	dir, err := os.MkdirTemp("", "realnode-images-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "image cache:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	testImages = NewImageCache(dir)
	return m.Run()
}

// lineWriter sends each written line to t.Log (streamed under -v).
type lineWriter struct {
	t   *testing.T
	buf bytes.Buffer
	mu  sync.Mutex
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	for {
		line, err := w.buf.ReadString('\n')
		if err != nil {
			w.buf.WriteString(line)
			return len(p), nil
		}
		w.t.Log(strings.TrimRight(line, "\n"))
	}
}

func TestRealNode(t *testing.T) {
	ctx, out, _ := startNodeTest(t)

	// A node whose owner was killed (no chance to tear down) is torn down
	// by the next Up: the host snapshot at the end covers it too.
	killedDir := startAndKillNode(t)

	// Registered with the startup taint, and the agent installed to
	// remove it, as a node pool set up against the scheduling race.
	n, err := Up(ctx, Options{Out: out, Images: testImages, StartupTaint: true})
	if err != nil {
		t.Fatalf("node up: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Down(); err != nil {
			t.Errorf("down: %v", err)
		}
	})
	if killedDir != "" {
		if _, err := os.Stat(killedDir); err == nil {
			t.Errorf("the killed node's directory %s is still there after the next Up", killedDir)
		}
	}
	if err := n.InstallAgent(ctx, "install", ImageTag); err != nil {
		t.Fatalf("helm install: %v", err)
	}
	e := &e2e{n: n, out: out}
	// Before the ztunnel stand-in runs: the taint waits for it.
	t.Run("the startup taint goes only once the agent can capture", e.testStartupTaint)
	if !e.standIn {
		if err := n.StartStandIn(ctx); err != nil {
			t.Fatalf("ztunnel stand-in: %v", err)
		}
		e.standIn = true
	}

	t.Run("the egress guard catches traffic off the machine", e.testGuardCatches)
	t.Run("agent runs as the chart's DaemonSet pod", e.testAgentPod)
	t.Run("a tampered image or chart is refused before helm runs", e.testTamperedRefused)
	t.Run("kubectl ambient-cni explains captured, uncaptured and failing pods", e.testKubectlPlugin)
	t.Run("story", e.testStory)
	t.Run("graceful deletion keeps the pod captured until its container is gone", e.testGracefulDeletion)
	t.Run("a pod that exits (phase Succeeded) is cleaned up", e.testSucceeded)
	t.Run("pod deletion runs CNI DEL through containerd and leaves no state", e.testDeleteRunsDEL)
	t.Run("netns discovery from a private cgroup namespace", e.testPrivateCgroupNamespace)
	t.Run("agent pod restart under pod churn", e.testAgentRestartUnderChurn)
	t.Run("a crashlooping agent blocks only the pods it must capture", e.testAgentCrashloop)
	t.Run("a hung agent holds only the pods it must capture", e.testAgentHung)
	t.Run("a DaemonSet that leaves the node unchains the plugin", e.testNodeSelectorExcludes)
	t.Run("a taken metrics port stops neither pods nor the agent", e.testMetricsPortTaken)
	t.Run("containerd calls CNI STATUS and the node follows it only when the operator chose so", e.testStatusThroughTheRuntime)
	t.Run("the verifier finds tampering from the host, repairs and reports it", e.testVerifier)
	t.Run("helm upgrade keeps the plugin installed throughout", e.testHelmUpgrade)
	t.Run("helm uninstall restores the config and releases captured pods", e.testHelmUninstall)
	t.Run("nothing was sent off the machine", testNoEgress(n))
}

// startAndKillNode runs `node up` in a child process until the node is up
// with the agent and the stand-in, then SIGKILLs it: the worst failure, no
// teardown at all. It returns the node's directory.
func startAndKillNode(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "node")
	build := exec.Command("go", "build", "-o", bin, "./test/realnode/cmd/node")
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the node command: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "up")
	cmd.Dir = root
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	dir := ""
	ready := make(chan bool, 1)
	go func() { // owner: this function, which waits on ready and then the process
		sc := bufio.NewScanner(stdout)
		told := false
		for sc.Scan() {
			line := sc.Text()
			t.Log("[killed node] " + line)
			if f := strings.Fields(line); len(f) >= 4 && f[0] == "node" && strings.HasPrefix(f[3], os.TempDir()) {
				dir = f[3]
			}
			if strings.Contains(line, "the node stays up") && !told {
				ready <- true
				told = true
			}
		}
		if !told {
			ready <- false
		}
	}()
	select {
	case ok := <-ready:
		if !ok {
			_ = cmd.Wait()
			t.Fatal("the node to be killed never came up")
		}
	case <-time.After(10 * time.Minute):
		_ = cmd.Process.Kill()
		t.Fatal("the node to be killed did not come up in 10 minutes")
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	t.Logf("killed the node in %s with SIGKILL", dir)
	return dir
}

func repoRoot() (string, error) {
	t, err := FindTools()
	return t.Repo, err
}

type e2e struct {
	n   *Node
	out io.Writer
	// standIn is set once the ztunnel stand-in runs.
	standIn bool
}

// ambientNamespace creates a namespace labelled ambient.
func (e *e2e) namespace(t *testing.T, name string, ambientOn bool) {
	t.Helper()
	var labels map[string]string
	if ambientOn {
		labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	}
	if err := e.n.CreateNamespace(context.Background(), name, labels); err != nil {
		t.Fatal(err)
	}
}

// start creates an app pod and waits until it is Ready.
func (e *e2e) start(t *testing.T, ns, name string, o AppOptions) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	if _, err := e.n.Client.CoreV1().Pods(ns).Create(ctx, e.n.AppPod(ns, name, o), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := e.n.WaitPodReady(ctx, ns, name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (e *e2e) mustCaptured(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if err := e.n.Poll(context.Background(), p.Name+" captured", func(ctx context.Context) (bool, error) { return e.n.captured(ctx, p) }); err != nil {
		t.Fatalf("%s/%s: %v", p.Namespace, p.Name, err)
	}
}

// records returns the stand-in's records of uid to dst.
func (e *e2e) records(t *testing.T, uid types.UID, port int, dst netip.AddrPort) []ztunnel.Record {
	t.Helper()
	recs, err := e.n.StandInRecords(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []ztunnel.Record
	for _, r := range recordsOf(recs, uid) {
		if r.Port == port && r.OrigDst == dst && r.Err == "" {
			out = append(out, r)
		}
	}
	return out
}

func podAddr(p *corev1.Pod) netip.AddrPort {
	return netip.AddrPortFrom(netip.MustParseAddr(p.Status.PodIP), AppPort)
}

// requests returns the log entries of a pod whose path starts with prefix.
func requests(t *testing.T, p *corev1.Pod, prefix string) []string {
	t.Helper()
	entries, err := appLog(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Path, prefix) {
			out = append(out, e.Remote)
		}
	}
	return out
}

// agentForgot waits until neither the agent nor the stand-in holds uid and
// the host probe set lacks ip.
func (e *e2e) agentForgot(t *testing.T, uid types.UID, ip string) {
	t.Helper()
	err := e.n.Poll(context.Background(), "agent forgets "+string(uid), func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentState(ctx)
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if p.UID == string(uid) {
				return false, fmt.Errorf("the agent still holds it (%s)", p.State)
			}
		}
		wls, err := e.n.StandInWorkloads(ctx)
		if err != nil {
			return false, err
		}
		for _, w := range wls {
			if w.UID == string(uid) {
				return false, fmt.Errorf("the stand-in still serves it")
			}
		}
		ips, _, err := hostProbeSet()
		if err != nil {
			return false, err
		}
		for _, m := range ips {
			if m == ip {
				return false, fmt.Errorf("the host probe set still holds %s", ip)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
}

// testNet is TEST-NET-1 (RFC 5737): documentation addresses, never routed
// anywhere; the guard rejects the attempts before they leave anyway.
const testNet = "192.0.2.1"

// The guard is not vacuous: an attempt off the machine from the node's own
// processes and one from a pod are both counted (and rejected); then the
// counters start over for the real run.
func (e *e2e) testGuardCatches(t *testing.T) {
	ctx := context.Background()
	c, err := net.DialTimeout("tcp", testNet+":80", 5*time.Second)
	if err == nil {
		_ = c.Close()
		t.Fatalf("a connection to %s succeeded", testNet)
	}
	e.namespace(t, "guard", false)
	pod := e.n.AppPod("guard", "leaker", AppOptions{RestartNever: true, Args: []string{"get", "-timeout", "5s", "http://" + testNet + "/"}})
	if _, err := e.n.Client.CoreV1().Pods("guard").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.n.WaitPodPhase(ctx, "guard", "leaker", corev1.PodFailed); err != nil {
		t.Fatal(err)
	}
	hits, err := e.n.GuardHits()
	if err != nil {
		t.Fatal(err)
	}
	if hits["node to outside"] == 0 || hits["pods to outside"] == 0 {
		t.Errorf("guard counted %v: want both the node's and the pod's attempt", hits)
	}
	zero := int64(0)
	if err := e.n.Client.CoreV1().Pods("guard").Delete(ctx, "leaker", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if err := e.n.ResetGuard(); err != nil {
		t.Fatal(err)
	}
}

func (e *e2e) testAgentPod(t *testing.T) {
	ctx := context.Background()
	pods, err := e.n.AgentPods(ctx)
	if err != nil || len(pods) != 1 {
		t.Fatalf("agent pods: %d, %v", len(pods), err)
	}
	p := pods[0]
	if len(p.OwnerReferences) != 1 || p.OwnerReferences[0].Kind != "DaemonSet" {
		t.Errorf("agent pod owners %+v: want its DaemonSet", p.OwnerReferences)
	}
	if !p.Spec.HostNetwork || p.Spec.ServiceAccountName != Release {
		t.Errorf("hostNetwork=%v serviceAccount=%q", p.Spec.HostNetwork, p.Spec.ServiceAccountName)
	}
	c := p.Spec.Containers[0]
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("image %s (%s)", c.Image, c.ImagePullPolicy)
	}
	// The image pushed to the registry by digest, pulled by containerd;
	// the chart installed from the registry.
	if err := e.n.CheckAgentFromRegistry(ctx); err != nil {
		t.Error(err)
	}
	sc := c.SecurityContext
	if sc == nil || sc.Privileged == nil || *sc.Privileged || sc.Capabilities == nil || len(sc.Capabilities.Add) != 5 {
		t.Errorf("securityContext %+v: want the chart's (unprivileged, five capabilities)", sc)
	}
	env := map[string]string{}
	for _, v := range c.Env {
		env[v.Name] = v.Value
	}
	if env["KUBERNETES_SERVICE_HOST"] != "127.0.0.1" || env["KUBERNETES_SERVICE_PORT"] != strconv.Itoa(e.n.APIPort) {
		t.Errorf("API override: host %q port %q", env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"])
	}
	// The process really runs with exactly those capabilities, and in the
	// host's cgroup namespace (containerd on this cgroup v1 host).
	pid := e.containerPID(t, ReleaseNamespace, p.Name)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			// NET_ADMIN(12) NET_RAW(13) SYS_ADMIN(21) SYS_PTRACE(19) DAC_READ_SEARCH(2)
			if want := fmt.Sprintf("%016x", 1<<12|1<<13|1<<21|1<<19|1<<2); strings.TrimSpace(v) != want {
				t.Errorf("agent CapEff %s, want %s", strings.TrimSpace(v), want)
			}
		}
		if v, ok := strings.CutPrefix(line, "NoNewPrivs:"); ok && strings.TrimSpace(v) != "1" {
			t.Errorf("agent NoNewPrivs %s, want 1", strings.TrimSpace(v))
		}
	}
	self, _ := os.Readlink("/proc/self/ns/cgroup")
	its, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/cgroup", pid))
	t.Logf("agent pid %d: cgroup namespace %s (host: %s)", pid, its, self)
	body, err := e.n.AgentGet(ctx, "/readyz")
	if err != nil {
		t.Errorf("agent /readyz: %v %s", err, body)
	}
	conf, err := os.ReadFile(e.n.CNIConfFile)
	if err != nil || !bytes.Contains(conf, []byte(`"ambient-cni"`)) {
		t.Errorf("conflist does not chain the plugin: %s %v", conf, err)
	}
	if _, err := os.Stat(filepath.Join(e.n.CNIBinDir, "ambient-cni")); err != nil {
		t.Errorf("plugin binary not installed: %v", err)
	}
}

// testStartupTaint: the node registered with the startup taint keeps it
// while the agent's pod is ready (helm --wait returned) but no ztunnel has
// its snapshot, so a pod the scheduler places is refused the node; once
// the stand-in acked its snapshot the agent removes the taint (and only
// it) and the pod is scheduled and runs. It starts the stand-in.
func (e *e2e) testStartupTaint(t *testing.T) {
	ctx := context.Background()
	n := e.n
	taints := func() (startup bool, all []corev1.Taint) {
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return nodetaint.Has(node.Spec.Taints), node.Spec.Taints
	}
	if startup, all := taints(); !startup {
		t.Fatalf("agent ready without a ztunnel, but the node's taints %+v lack %s", all, nodetaint.Key)
	}
	ns := "startup-taint"
	e.namespace(t, ns, false)
	pod := n.AppPod(ns, "scheduled", AppOptions{})
	// Placed by the scheduler, not bound to the node; the node lifecycle
	// controller does not run here, so the node keeps the not-ready taint
	// the API server puts on a new node: tolerate that one only.
	pod.Spec.NodeName = ""
	pod.Spec.Tolerations = []corev1.Toleration{{Key: "node.kubernetes.io/not-ready", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
	if _, err := n.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err := n.Poll(ctx, "the scheduler to refuse the tainted node", func(ctx context.Context) (bool, error) {
		p, err := n.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range p.Status.Conditions {
			// The pod tolerates every other taint of the node: the startup
			// taint is why (the pod is scheduled once it goes, below).
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				t.Logf("scheduler: %s", c.Message)
				return true, nil
			}
		}
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("scheduled onto %s before the agent could capture", p.Spec.NodeName)
		}
		return false, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if startup, all := taints(); !startup {
		t.Fatalf("taint gone before a ztunnel connected: %+v", all)
	}
	before := len(func() []corev1.Taint { _, all := taints(); return all }())

	if err := n.StartStandIn(ctx); err != nil {
		t.Fatalf("ztunnel stand-in: %v", err)
	}
	e.standIn = true
	if err := n.Poll(ctx, "the startup taint to go", func(context.Context) (bool, error) { startup, _ := taints(); return !startup, nil }); err != nil {
		t.Fatal(err)
	}
	if _, all := taints(); len(all) != before-1 {
		t.Errorf("taints %+v: want the %d others kept", all, before-1)
	}
	p, err := n.WaitPodReady(ctx, ns, pod.Name)
	if err != nil {
		t.Fatal(err)
	}
	if p.Spec.NodeName != n.Name {
		t.Errorf("pod scheduled onto %q, want %s", p.Spec.NodeName, n.Name)
	}
	if err := n.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64(0))}); err != nil {
		t.Error(err)
	}
}

// containerPID returns the host PID of a pod's first container.
func (e *e2e) containerPID(t *testing.T, ns, name string) int {
	t.Helper()
	ctx := context.Background()
	id, err := e.n.SandboxID(ctx, ns, name)
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.n.crictl(ctx, "ps", "--pod", id, "--state", "running", "-q")
	if err != nil || len(strings.Fields(out)) == 0 {
		t.Fatalf("containers of %s/%s: %q %v", ns, name, out, err)
	}
	out, err = e.n.crictl(ctx, "inspect", "-o", "json", strings.Fields(out)[0])
	if err != nil {
		t.Fatal(err)
	}
	var info struct{ Info struct{ Pid int } }
	if err := json.Unmarshal([]byte(out), &info); err != nil || info.Info.Pid == 0 {
		t.Fatalf("container pid: %v", err)
	}
	return info.Info.Pid
}

func (e *e2e) testStory(t *testing.T) {
	s := &Story{N: e.n, Out: e.out}
	if err := s.Run(context.Background()); err != nil {
		t.Errorf("the story stopped: %v", err)
	}
	for _, p := range s.Failed() {
		t.Errorf("%s: %s: %v", p.Step, p.Claim, p.Err)
	}
	if err := s.Table(context.Background(), e.out); err != nil {
		t.Error(err)
	}
}

// A pod deleted with a grace period and a preStop hook keeps its capture
// while its container still runs: the hook's request and the one the app
// makes after SIGTERM both go through ztunnel.
func (e *e2e) testGracefulDeletion(t *testing.T) {
	ctx := context.Background()
	e.namespace(t, "grace", true)
	sink := e.start(t, "grace", "sink", AppOptions{})
	e.mustCaptured(t, sink)
	grace := int64(30)
	leaver := e.start(t, "grace", "leaver", AppOptions{
		Grace:      &grace,
		PreStopGet: appURL(sink, "/prestop"), PreStopWait: 3 * time.Second,
		TermGet: appURL(sink, "/term"), TermDelay: 2 * time.Second,
	})
	e.mustCaptured(t, leaver)
	netns, err := e.n.PodNetns(ctx, "grace", "leaver")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.n.Client.CoreV1().Pods("grace").Delete(ctx, "leaver", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// While the preStop hook runs, the pod is terminating and still
	// captured.
	waitRequest := func(path string) {
		t.Helper()
		if err := e.n.Poll(ctx, "sink gets "+path, func(context.Context) (bool, error) {
			return len(requests(t, sink, path)) > 0, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitRequest("/prestop")
	cur, err := e.n.Client.CoreV1().Pods("grace").Get(ctx, "leaver", metav1.GetOptions{})
	if err != nil || cur.DeletionTimestamp == nil {
		t.Fatalf("leaver should be terminating: %v", err)
	}
	if v := cur.Annotations[ambient.RedirectionAnnotation]; v != ambient.RedirectionEnabled {
		t.Errorf("terminating pod lost its annotation (%q) while its container runs", v)
	}
	if rules, err := NetnsRules(ctx, netns); err != nil || !HasCaptureRules(rules) {
		t.Errorf("terminating pod lost its capture rules while its container runs (%v)", err)
	}
	waitRequest("/term")
	if err := e.n.WaitPodGone(ctx, "grace", "leaver"); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/prestop", "/term"} {
		from := requests(t, sink, path)
		if len(from) == 0 || !strings.HasPrefix(from[0], sink.Status.PodIP+":") {
			t.Errorf("%s reached the sink from %v: want via the stand-in inside the sink (%s)", path, from, sink.Status.PodIP)
		}
	}
	if recs := e.records(t, leaver.UID, ambient.ZtunnelOutboundPort, podAddr(sink)); len(recs) < 2 {
		t.Errorf("the stand-in proxied %d of the leaver's 2 requests during its grace period: %+v", len(recs), recs)
	}
	e.agentForgot(t, leaver.UID, leaver.Status.PodIP)
}

// A pod whose container exits 0 (phase Succeeded) is unenrolled and its
// sandbox torn down; its one request was captured.
func (e *e2e) testSucceeded(t *testing.T) {
	ctx := context.Background()
	e.namespace(t, "once", true)
	sink := e.start(t, "once", "sink", AppOptions{})
	e.mustCaptured(t, sink)
	pod := e.n.AppPod("once", "job", AppOptions{RestartNever: true, Args: []string{"get", "-timeout", "60s", appURL(sink, "/job")}})
	if _, err := e.n.Client.CoreV1().Pods("once").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := e.n.WaitPodPhase(ctx, "once", "job", corev1.PodSucceeded)
	if err != nil {
		t.Fatal(err)
	}
	if recs := e.records(t, p.UID, ambient.ZtunnelOutboundPort, podAddr(sink)); len(recs) == 0 {
		t.Error("the job's request did not go through the stand-in")
	}
	err = e.n.Poll(ctx, "succeeded pod cleaned up", func(ctx context.Context) (bool, error) {
		cur, err := e.n.Client.CoreV1().Pods("once").Get(ctx, "job", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if v, ok := cur.Annotations[ambient.RedirectionAnnotation]; ok {
			return false, fmt.Errorf("annotation %s=%s on a Succeeded pod", ambient.RedirectionAnnotation, v)
		}
		if _, err := e.n.SandboxID(ctx, "once", "job"); err == nil {
			return false, fmt.Errorf("its sandbox is still ready")
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	e.agentForgot(t, p.UID, p.Status.PodIP)
}

// Deleting a captured pod makes kubelet stop its sandbox; containerd runs
// CNI DEL through the chain, our plugin tells the agent, and nothing of the
// pod is left: no netns, no address reservation, no cached result, no
// veth, no agent or ztunnel state, no spooled DEL.
func (e *e2e) testDeleteRunsDEL(t *testing.T) {
	ctx := context.Background()
	e.namespace(t, "del", true)
	p := e.start(t, "del", "victim", AppOptions{})
	e.mustCaptured(t, p)
	id, err := e.n.SandboxID(ctx, "del", "victim")
	if err != nil {
		t.Fatal(err)
	}
	netns, err := e.n.PodNetns(ctx, "del", "victim")
	if err != nil {
		t.Fatal(err)
	}
	ipam := filepath.Join(e.n.Dir, "cni", "ipam", "ambient-node", p.Status.PodIP)
	cache := filepath.Join("/var/lib/cni/results", "ambient-node-"+id+"-eth0")
	for _, f := range []string{netns, ipam, cache} {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("before the delete: %v", err)
		}
	}
	vethsBefore := e.bridgePorts(t)
	delsBefore := e.answeredDELs(t)
	if err := e.n.Client.CoreV1().Pods("del").Delete(ctx, "victim", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.n.WaitPodGone(ctx, "del", "victim"); err != nil {
		t.Fatal(err)
	}
	err = e.n.Poll(ctx, "sandbox state gone", func(ctx context.Context) (bool, error) {
		for _, f := range []string{netns, ipam, cache} {
			if _, err := os.Stat(f); err == nil {
				return false, fmt.Errorf("%s is still there", f)
			}
		}
		if n := e.bridgePorts(t); n != vethsBefore-1 {
			return false, fmt.Errorf("%d veths on the bridge, want %d", n, vethsBefore-1)
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	if got := e.answeredDELs(t); got <= delsBefore {
		t.Errorf("the agent answered no CNI DEL (%v before, %v after)", delsBefore, got)
	}
	log, _ := os.ReadFile(filepath.Join(e.n.Dir, "containerd.log"))
	if !bytes.Contains(log, []byte(`TearDown network for sandbox \"`+id+`\" successfully`)) {
		t.Errorf("containerd did not tear down the network of sandbox %s", id)
	}
	msgs, err := e.n.StandInMessages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	del := false
	for _, m := range msgs {
		del = del || (m.Kind == ztunnel.KindDel && m.UID == string(p.UID))
	}
	if !del {
		t.Error("ztunnel got no Del for the pod")
	}
	e.agentForgot(t, p.UID, p.Status.PodIP)
	spool, _ := os.ReadDir(e.n.Layout().DelSpool())
	if len(spool) > 0 {
		t.Errorf("DELs spooled (the plugin could not reach the agent): %v", spool)
	}
}

// bridgePorts counts the links attached to the node's bridge.
func (e *e2e) bridgePorts(t *testing.T) int {
	t.Helper()
	out, err := exec.Command("ip", "-o", "link", "show", "master", e.n.Bridge).Output()
	if err != nil {
		t.Fatal(err)
	}
	return len(strings.Fields(strings.ReplaceAll(string(out), " ", "")))
}

// answeredDELs sums the agent's successfully answered CNI DELs (whatever
// their verdict) from its /metrics.
func (e *e2e) answeredDELs(t *testing.T) float64 {
	t.Helper()
	b, err := e.n.AgentGet(context.Background(), "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, line := range strings.Split(string(b), "\n") {
		series, v, ok := strings.Cut(line, " ")
		if !ok || !strings.HasPrefix(series, "ambient_cni_cni_requests_total{") || !strings.Contains(series, `verb="DEL"`) {
			continue
		}
		if strings.Contains(series, `result="error"`) || strings.Contains(series, `result="rejected"`) || strings.Contains(series, `result="retry"`) {
			continue
		}
		f, _ := strconv.ParseFloat(v, 64)
		sum += f
	}
	return sum
}

// The agent runs in a private cgroup namespace on nodes whose runtime
// gives containers one (cgroup v2): /proc/<pid>/cgroup of the pods then
// reads relative to the agent's own cgroup. This node's runtime shares
// the host's, so the scan runs from a helper that joins the agent
// container's cgroups and unshares its cgroup namespace, as such a runtime
// would, and must still find every running pod's netns.
func (e *e2e) testPrivateCgroupNamespace(t *testing.T) {
	ctx := context.Background()
	e.namespace(t, "cgns", false)
	want := map[string]string{}
	var uids []string // uid=ip
	for i := range 2 {
		p := e.start(t, "cgns", fmt.Sprintf("p%d", i), AppOptions{})
		netns, err := e.n.PodNetns(ctx, "cgns", p.Name)
		if err != nil {
			t.Fatal(err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(netns, &st); err != nil {
			t.Fatal(err)
		}
		want[string(p.UID)] = strconv.FormatUint(st.Ino, 10)
		uids = append(uids, string(p.UID)+"="+p.Status.PodIP)
	}
	agents, err := e.n.AgentPods(ctx)
	if err != nil || len(agents) != 1 {
		t.Fatalf("agent pods: %v", err)
	}
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", e.containerPID(t, ReleaseNamespace, agents[0].Name)))
	if err != nil {
		t.Fatal(err)
	}
	var joins []string
	for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		mount := filepath.Join("/sys/fs/cgroup", strings.TrimPrefix(strings.Split(parts[1], ",")[0], "name="))
		if parts[1] == "" {
			mount = cgroupV2Mount()
		}
		joins = append(joins, filepath.Join(mount, parts[2], "cgroup.procs"))
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	script := `for f in "$@"; do echo $$ > "$f" || exit 1; done; exec unshare --cgroup ` + strconv.Quote(self)
	cmd := exec.Command("sh", append([]string{"-c", script, "sh"}, joins...)...)
	cmd.Env = append(os.Environ(), scanHelperEnv+"="+strings.Join(uids, ","))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("scan helper: %v\n%s", err, out)
	}
	var res struct {
		Cgroup string
		Found  map[string]string
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("scan helper output %q: %v", out, err)
	}
	t.Logf("the helper's own cgroup view:\n%s", res.Cgroup)
	if strings.Contains(res.Cgroup, "kubepods") {
		t.Fatalf("the helper is not in a private cgroup namespace:\n%s", res.Cgroup)
	}
	for uid, ino := range want {
		if res.Found[uid] != ino {
			t.Errorf("pod %s: scan from a private cgroup namespace found netns %q, want inode %s", uid, res.Found[uid], ino)
		}
	}
}

// scanHelper runs the agent's netns discovery (netns.Scanner) for
// uid=ip pairs and prints what it found, with its own cgroup view, as JSON.
func scanHelper(pairs string) int {
	want := map[types.UID][]netip.Addr{}
	for _, pair := range strings.Split(pairs, ",") {
		uid, ip, _ := strings.Cut(pair, "=")
		a, err := netip.ParseAddr(ip)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		want[types.UID(uid)] = []netip.Addr{a}
	}
	cg, _ := os.ReadFile("/proc/self/cgroup")
	found, err := netns.Scanner{}.Find(want)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	res := struct {
		Cgroup string
		Found  map[string]string
	}{Cgroup: string(cg), Found: map[string]string{}}
	for uid, f := range found {
		res.Found[string(uid)] = strconv.FormatUint(f.ID(), 10)
		_ = f.Close()
	}
	_ = json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

// The agent's DaemonSet pod is deleted and recreated (a rolling restart)
// while ten pods come and go: every pod that runs ends up captured, and
// none started uncaptured — each pod's first request, made at start, went
// through the stand-in.
func (e *e2e) testAgentRestartUnderChurn(t *testing.T) {
	ctx := context.Background()
	e.namespace(t, "churn", true)
	e.namespace(t, "sinks", false)
	sink := e.start(t, "sinks", "sink", AppOptions{})
	agents, err := e.n.AgentPods(ctx)
	if err != nil || len(agents) != 1 {
		t.Fatalf("agent pods: %d %v", len(agents), err)
	}
	old := agents[0]
	deleted := map[string]bool{"c1": true, "c4": true, "c7": true}
	var created []string
	for i := range 10 {
		name := fmt.Sprintf("c%d", i)
		pod := e.n.AppPod("churn", name, AppOptions{Hello: appURL(sink, "/hello-"+name)})
		if _, err := e.n.Client.CoreV1().Pods("churn").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		created = append(created, name)
		if i == 3 {
			// A rolling restart: kubelet stops the agent (grace period),
			// the DaemonSet controller creates the next one.
			if err := e.n.Client.CoreV1().Pods(ReleaseNamespace).Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		if i >= 4 && deleted[fmt.Sprintf("c%d", i-3)] {
			if err := e.n.Client.CoreV1().Pods("churn").Delete(ctx, fmt.Sprintf("c%d", i-3), metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(300 * time.Millisecond) // spread the churn over the restart; not a wait for anything
	}
	if err := e.n.Client.CoreV1().Pods("churn").Delete(ctx, "c7", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = e.n.Poll(ctx, "new agent ready", func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if p.Name == old.Name {
				return false, fmt.Errorf("old agent %s still there", p.Name)
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					return true, nil
				}
			}
		}
		return false, fmt.Errorf("no ready agent pod among %d", len(pods))
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range created {
		if deleted[name] {
			if err := e.n.WaitPodGone(ctx, "churn", name); err != nil {
				t.Error(err)
			}
			continue
		}
		p, err := e.n.WaitPodReady(ctx, "churn", name)
		if err != nil {
			t.Error(err)
			continue
		}
		e.mustCaptured(t, p)
		hellos := requests(t, sink, "/hello-"+name)
		recs := e.records(t, p.UID, ambient.ZtunnelOutboundPort, podAddr(sink))
		if len(hellos) == 0 || len(recs) < len(hellos) {
			t.Errorf("%s: %d requests reached the sink at start, the stand-in proxied %d of them: it started uncaptured", name, len(hellos), len(recs))
		}
	}
	// Deleted pods leave nothing in the agent or the stand-in.
	err = e.n.Poll(ctx, "deleted pods forgotten", func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentState(ctx)
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if p.Namespace == "churn" && deleted[p.Name] {
				return false, fmt.Errorf("the agent still holds %s", p.Name)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
}

// helm upgrade rolls the DaemonSet to a new image; the conflist entry and
// the plugin binary stay in place at every moment, and captured pods stay
// captured.
func (e *e2e) testHelmUpgrade(t *testing.T) {
	ctx := context.Background()
	const tag = "dev2"
	if _, err := e.n.PushAgentTag(ctx, tag); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var gaps []string
	var checks int
	done := make(chan struct{})
	go func() { // owner: this test; stopped below
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			checks++
			if err := pluginInstalled(e.n); err != nil {
				gaps = append(gaps, time.Now().Format("15:04:05.000")+" "+err.Error())
			}
		}
	}()
	err := e.n.InstallAgent(ctx, "upgrade", tag)
	if err == nil {
		err = e.n.Poll(ctx, "agent on "+tag, func(ctx context.Context) (bool, error) {
			pods, err := e.n.AgentPods(ctx)
			if err != nil || len(pods) != 1 {
				return false, fmt.Errorf("%d agent pods (%v)", len(pods), err)
			}
			p := pods[0]
			ready := false
			for _, c := range p.Status.Conditions {
				ready = ready || (c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue)
			}
			if p.Spec.Containers[0].Image != e.n.AgentImage(tag) || !ready {
				return false, fmt.Errorf("agent %s on %s ready=%v", p.Name, p.Spec.Containers[0].Image, ready)
			}
			return true, nil
		})
	}
	close(stop)
	<-done
	if err != nil {
		t.Fatal(err)
	}
	if len(gaps) > 0 {
		t.Errorf("the plugin was not installed at %d of %d checks during the upgrade:\n%s", len(gaps), checks, strings.Join(gaps, "\n"))
	}
	t.Logf("plugin checked installed %d times during the upgrade", checks)
	// Pods captured before the upgrade are still captured, and a new pod is.
	pods, err := e.n.Client.CoreV1().Pods("churn").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range pods.Items {
		e.mustCaptured(t, &pods.Items[i])
	}
	e.mustCaptured(t, e.start(t, "churn", "after-upgrade", AppOptions{}))
}

// pluginInstalled checks the node's conflist chains our plugin and its
// binary is in place.
func pluginInstalled(n *Node) error {
	b, err := os.ReadFile(n.CNIConfFile)
	if err != nil {
		return err
	}
	var conf struct {
		Plugins []struct{ Type string }
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return fmt.Errorf("conflist: %w", err)
	}
	found := false
	for _, p := range conf.Plugins {
		found = found || p.Type == "ambient-cni"
	}
	if !found {
		return fmt.Errorf("conflist does not chain ambient-cni")
	}
	if _, err := os.Stat(filepath.Join(n.CNIBinDir, "ambient-cni")); err != nil {
		return err
	}
	return nil
}

// helm uninstall puts the primary CNI config back byte for byte, new pods
// start without us, and the pods we had captured are released: no rules,
// no annotation, and kubelet probes reach them directly again.
func (e *e2e) testHelmUninstall(t *testing.T) {
	ctx := context.Background()
	probed := e.start(t, "churn", "probed", AppOptions{})
	e.mustCaptured(t, probed)
	pods, err := e.n.Client.CoreV1().Pods("churn").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.n.UninstallAgent(ctx); err != nil {
		t.Fatal(err)
	}
	uninstalled := time.Now()
	conf, err := os.ReadFile(e.n.CNIConfFile)
	if err != nil || !bytes.Equal(conf, e.n.CNIConfOriginal) {
		t.Errorf("conflist after uninstall (%v):\n%s\nwant the original:\n%s", err, conf, e.n.CNIConfOriginal)
	}
	if _, err := os.Stat(filepath.Join(e.n.CNIBinDir, "ambient-cni")); err == nil {
		t.Error("the plugin binary is still installed")
	}
	// New pods start without us, even in an ambient namespace.
	sink := e.start(t, "sinks", "sink-2", AppOptions{})
	fresh := e.start(t, "churn", "fresh", AppOptions{Hello: appURL(sink, "/hello-fresh")})
	if ok, err := e.n.releasedNoStandIn(ctx, fresh); !ok {
		t.Errorf("a pod started after uninstall: %v", err)
	}
	if recs := e.records(t, fresh.UID, ambient.ZtunnelOutboundPort, podAddr(sink)); len(recs) > 0 {
		t.Error("a pod started after uninstall had its traffic captured")
	}
	// Captured pods are released (one wait for all of them).
	err = e.n.Poll(ctx, "captured pods released", func(ctx context.Context) (bool, error) {
		var errs []string
		for i := range pods.Items {
			p := &pods.Items[i]
			if ok, err := e.n.releasedNoStandIn(ctx, p); !ok {
				errs = append(errs, fmt.Sprintf("%s/%s: %v", p.Namespace, p.Name, err))
			}
		}
		if len(errs) > 0 {
			return false, fmt.Errorf("%d of %d pods not released:\n%s", len(errs), len(pods.Items), strings.Join(errs, "\n"))
		}
		return true, nil
	})
	if err != nil {
		t.Errorf("after uninstall: %v", err)
	}
	// kubelet's probes reach the released pod directly from the node.
	err = e.n.Poll(ctx, "direct probes", func(ctx context.Context) (bool, error) {
		entries, err := appLog(ctx, probed)
		if err != nil {
			return false, err
		}
		for _, en := range entries {
			if en.Path == "/ready" && en.Time.After(uninstalled) && strings.HasPrefix(en.Remote, e.n.Gateway+":") {
				return true, nil
			}
		}
		return false, fmt.Errorf("no readiness probe from the node (%s) since the uninstall", e.n.Gateway)
	})
	if err != nil {
		t.Error(err)
	}
	for _, f := range iptablesFlavours {
		if save, _ := iptablesSave(f); strings.Contains(save, iptables.ChainProbeSNAT) {
			t.Errorf("%s: the host probe SNAT chain is still there", f)
		}
	}
	if tables, err := nftTables(); err != nil || slices.Contains(tables, "inet "+nftables.TableHost) {
		t.Errorf("the agent's host nftables table is still there (%v)", err)
	}
	if _, exists, _ := hostProbeSet(); exists {
		t.Error("the host probe set is still there")
	}
}

// releasedNoStandIn is released without asking the stand-in (after
// uninstall nothing tells it; released rules mean it gets no traffic).
func (n *Node) releasedNoStandIn(ctx context.Context, p *corev1.Pod) (bool, error) {
	return n.releasedFrom(ctx, p, false)
}
