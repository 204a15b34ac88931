package integration

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// TestZtunnelHandoff is issue 4's acceptance on the whole agent: an ADD
// with no ztunnel connected fails with the retryable CNI error after the
// configured wait and succeeds on retry once a stand-in connects; then
// two enrolled pods talk through A's 15001 and B's 15008, and an
// unenrolled pod reaches B through B's 15006.
func TestZtunnelHandoff(t *testing.T) {
	const wait = time.Second
	n := newNode(t, nodeOptions{ZtunnelWait: wait, NoStandIn: true})
	shop := n.namespace("shop", ambientLabel)
	plain := n.namespace("plain", nil)
	ctx := context.Background()

	start := time.Now()
	_, err := n.kube.Run(ctx, podSpec(shop, "a", nil, nil))
	took := time.Since(start)
	var cerr *cnitypes.Error
	if !errors.As(err, &cerr) || cerr.Code != 11 {
		t.Fatalf("ADD with no ztunnel: %v; want CNI error 11 (try again later)", err)
	}
	if took < wait {
		t.Fatalf("ADD failed after %v, before the configured ztunnel wait of %v", took, wait)
	}
	t.Logf("ADD without ztunnel failed after %v: %v", took.Round(time.Millisecond), cerr)
	obj, err := n.env.Client.CoreV1().Pods(shop).Get(ctx, "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(n.d.Agent().Pods()) != 0 {
		t.Fatalf("the failed sandbox is still in the agent state: %+v", n.d.Agent().Pods())
	}
	// The failed ADD wanted the pod marked pending (never enabled); the
	// runtime's DEL of the failed sandbox writes nothing, the retry's ADD
	// marks it enabled.
	if got := obj.Annotations[ambient.RedirectionAnnotation]; got == ambient.RedirectionEnabled {
		t.Fatalf("the failed sandbox left annotation %q", got)
	}

	n.startStandIn(ztunnel.Faults{})
	a, err := n.kube.Start(ctx, obj) // the runtime's retry
	if err != nil {
		t.Fatalf("ADD retry with a stand-in connected: %v", err)
	}
	serveApp(t, a)
	b := n.runPod(podSpec(shop, "b", nil, nil))
	c := n.runPod(podSpec(plain, "c", nil, nil))
	n.waitEnrolled(waitLong, a, b)
	n.requireNotEnrolled(c)

	mustGet(t, a, b)
	n.requireTunneled(a, b)
	mustGet(t, c, b)
	if !n.hasRecord(func(r ztunnel.Record) bool {
		return r.UID == string(b.Obj.UID) && r.Port == ambient.ZtunnelInboundPlaintextPort && r.OrigDst == app(b) && r.Err == ""
	}) {
		t.Fatalf("c -> b did not go through b's 15006: %+v", n.zt.Records())
	}
}

// TestReadyzAndMetrics: /readyz is ready with the plugin chained and turns
// not-ready while the primary config lacks our entry; /metrics exposes
// the named metrics and counts an ADD.
func TestReadyzAndMetrics(t *testing.T) {
	testnet.RequireCommands(t, "chattr")
	n := newNode(t, nodeOptions{})
	if code, body := n.get("/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz = %d %s", code, body)
	}
	addsBefore := n.metric(`ambient_cni_cni_requests_total{result="enrolled",verb="ADD"}`)
	istioAddsBefore := n.metric(`istio_cni_plugin_requests_total{response_code="200"}`)

	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "a", nil, nil))
	n.waitEnrolled(waitLong, p)
	if got := n.metric(`ambient_cni_cni_requests_total{result="enrolled",verb="ADD"}`); got != addsBefore+1 {
		t.Errorf("enrolled ADDs counted %v -> %v, want one more", addsBefore, got)
	}
	if got := n.metric(`istio_cni_plugin_requests_total{response_code="200"}`); got != istioAddsBefore+1 {
		t.Errorf("istio-cni's count of answered ADDs %v -> %v, want one more", istioAddsBefore, got)
	}
	if got := n.metric(`istio_cni_installs_total{result="SUCCESS"}`); got < 1 {
		t.Errorf(`istio_cni_installs_total{result="SUCCESS"} = %v after the install`, got)
	}
	if got := n.metric(`nodeagent_reconcile_events_total{type="add"}`); got < 2 {
		t.Errorf(`nodeagent_reconcile_events_total{type="add"} = %v after a namespace and a pod`, got)
	}
	if got := n.metric(`ambient_cni_cni_add_duration_seconds_count`); got < 1 {
		t.Errorf("ADD latency histogram count %v", got)
	}
	_, text := n.getFrom(n.metricsAddress(), "/metrics")
	for _, name := range []string{
		"ambient_cni_cni_requests_total", "ambient_cni_cni_add_duration_seconds", "ambient_cni_enrolled_pods",
		"ambient_cni_ztunnel_connections", "ambient_cni_rule_errors_total", "ambient_cni_installer_reinstalls_total",
		"ambient_cni_verify_drift_total", "ambient_cni_pods_unproven",
		// istio-cni's names, for its dashboards and alerts.
		"istio_cni_install_ready", "ztunnel_connected", "istio_cni_plugin_requests_total",
		"istio_cni_installs_total", "nodeagent_reconcile_events_total",
	} {
		if !strings.Contains(text, "# TYPE "+name+" ") {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	poll.Within(t, waitLong, "gauges: one enabled pod, one ztunnel", func() bool {
		return n.metric(`ambient_cni_enrolled_pods{state="enabled"}`) == 1 && n.metric(`ambient_cni_ztunnel_connections`) == 1 &&
			n.metric(`ztunnel_connected`) == 1 && n.metric(`istio_cni_install_ready`) == 1
	})

	// Take our entry out of the primary config and keep the installer from
	// putting it back: an immutable directory refuses the installer's
	// temp file and rename, while an in-place rewrite still works, as a
	// primary CNI's would.
	reinstalls := n.metric("ambient_cni_installer_reinstalls_total")
	path := filepath.Join(n.confDir, simnode.PrimaryConf)
	chained, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	unchained := cnibin.Conflist(cnibin.Network{Bridge: n.bridge, Subnet: n.subnet, DataDir: filepath.Join(n.dir, "ipam")})
	t.Cleanup(func() { _ = exec.Command("chattr", "-i", n.confDir).Run() })
	if out, err := exec.Command("chattr", "+i", n.confDir).CombinedOutput(); err != nil {
		testnet.Missing(t, "chattr +i on the test's conf dir: "+err.Error()+": "+string(out))
	}
	if err := os.WriteFile(path, unchained, 0o644); err != nil {
		t.Fatal(err)
	}
	code, body := n.get("/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "installer") {
		t.Fatalf("/readyz with our entry gone = %d %q, want 503 naming the installer", code, body)
	}
	t.Logf("/readyz without our entry: %d %s", code, strings.TrimSpace(body))
	// Still not ready a moment later: the installer cannot repair it yet.
	time.Sleep(300 * time.Millisecond)
	if code, _ := n.get("/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d while the entry is still missing", code)
	}

	if out, err := exec.Command("chattr", "-i", n.confDir).CombinedOutput(); err != nil {
		t.Fatalf("chattr -i: %v %s", err, out)
	}
	poll.Within(t, waitLong, "/readyz ready again once the installer restored our entry", func() bool {
		code, _ := n.get("/readyz")
		return code == http.StatusOK
	})
	if got, _ := os.ReadFile(path); string(got) != string(chained) {
		t.Errorf("restored config differs from the chained one:\n%s\nwant:\n%s", got, chained)
	}
	// The counter moves just after the write /readyz already sees.
	poll.Within(t, waitLong, "the repair counted in installer_reinstalls_total", func() bool {
		return n.metric("ambient_cni_installer_reinstalls_total") > reinstalls
	})
}

// TestShippedRBACSuffices: the agent's client has exactly the shipped
// permissions (every test runs under them); writes the agent never needs
// are refused, and with them refused a pod is still enrolled, annotated,
// evented on and removed.
func TestShippedRBACSuffices(t *testing.T) {
	n := newNode(t, nodeOptions{})
	ctx := context.Background()
	review, err := n.client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := "system:serviceaccount:" + n.agentNS + ":" + agentSA; review.Status.UserInfo.Username != want {
		t.Fatalf("agent client is %q, want %q", review.Status.UserInfo.Username, want)
	}

	shop := n.namespace("shop", nil)
	p := n.runPod(podSpec(shop, "a", nil, nil))
	dry := []string{metav1.DryRunAll}
	pods := n.client.CoreV1().Pods(shop)
	forbidden := map[string]error{}
	obj, err := pods.Get(ctx, "a", metav1.GetOptions{}) // allowed: get
	if err != nil {
		t.Fatalf("get pod with the shipped RBAC: %v", err)
	}
	_, forbidden["update pods"] = pods.Update(ctx, obj, metav1.UpdateOptions{DryRun: dry})
	forbidden["delete pods"] = pods.Delete(ctx, "a", metav1.DeleteOptions{DryRun: dry})
	_, forbidden["patch pods"] = pods.Patch(ctx, "a", types.MergePatchType, []byte(`{"metadata":{"annotations":{"x":"y"}}}`), metav1.PatchOptions{DryRun: dry})
	_, forbidden["update pods/status"] = pods.UpdateStatus(ctx, obj, metav1.UpdateOptions{DryRun: dry})
	_, forbidden["create pods"] = pods.Create(ctx, podSpec(shop, "b", nil, nil), metav1.CreateOptions{DryRun: dry})
	_, forbidden["patch namespaces"] = n.client.CoreV1().Namespaces().Patch(ctx, shop, types.MergePatchType, labelPatch(ambient.DataplaneModeAmbient), metav1.PatchOptions{DryRun: dry})
	_, forbidden["list secrets"] = n.client.CoreV1().Secrets(shop).List(ctx, metav1.ListOptions{})
	// The agent reads its own Node (is the DaemonSet still for this node?),
	// nothing more of Nodes.
	// (The simulated node has no Node object: NotFound proves the read was
	// authorized.)
	if _, err := n.client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("get own node with the shipped RBAC: %v", err)
	}
	_, forbidden["list nodes"] = n.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	_, forbidden["patch nodes"] = n.client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{DryRun: dry})
	_, forbidden["list daemonsets elsewhere"] = n.client.AppsV1().DaemonSets(shop).List(ctx, metav1.ListOptions{})
	// Of Services, only the release's signal, by name; no DaemonSet watched.
	_, forbidden["watch daemonsets"] = n.client.AppsV1().DaemonSets(n.agentNS).Watch(ctx, metav1.ListOptions{})
	_, forbidden["list services"] = n.client.CoreV1().Services(n.agentNS).List(ctx, metav1.ListOptions{})
	_, forbidden["get another service"] = n.client.CoreV1().Services(n.agentNS).Get(ctx, "kubernetes", metav1.GetOptions{})
	forbidden["delete the release signal"] = n.client.CoreV1().Services(n.agentNS).Delete(ctx, n.cfg.ReleaseSignal, metav1.DeleteOptions{DryRun: dry})
	for verb, err := range forbidden {
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s with the shipped RBAC: %v, want Forbidden", verb, err)
		}
	}

	// And the agent needed none of it: enroll, annotate, unenroll, remove.
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, p)
	n.setNamespaceMode(shop, "")
	n.waitUnenrolled(p)
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, p)
	if err := n.kube.Delete(ctx, p); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, waitLong, "pod removed from the agent", func() bool { return len(n.d.Agent().Pods()) == 0 })
}

// get fetches one of the health endpoints as kubelet's exec probe does:
// over the debug socket.
func (n *node) get(path string) (int, string) {
	n.t.Helper()
	code, body := n.debugGet(path)
	return code, string(body)
}

// metricsAddress is the daemon's /metrics address, waiting for it to be
// bound.
func (n *node) metricsAddress() string {
	n.t.Helper()
	if n.metricsAddr == "" {
		select {
		case n.metricsAddr = <-n.maddr:
		case <-time.After(waitLong):
			n.t.Fatalf("/metrics not served after %v", waitLong)
		}
	}
	return n.metricsAddr
}

// getFrom fetches a path from one of the daemon's TCP listeners.
func (n *node) getFrom(addr, path string) (int, string) {
	n.t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + path)
	if err != nil {
		n.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		n.t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// metric returns one sample of /metrics by its exact series text (name
// and labels as the exposition format prints them); absent is 0.
func (n *node) metric(series string) float64 {
	n.t.Helper()
	_, text := n.getFrom(n.metricsAddress(), "/metrics")
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	m := re.FindStringSubmatch(text)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		n.t.Fatalf("metric %s: %v", series, err)
	}
	return v
}

// agentEvent waits for an Event of reason on the agent's pod and returns
// the first one.
func (n *node) agentEvent(reason string) corev1.Event {
	n.t.Helper()
	var ev corev1.Event
	poll.Within(n.t, waitLong, "a "+reason+" Event on the agent's pod", func() bool {
		list, err := n.env.Client.CoreV1().Events(n.agentNS).List(context.Background(), metav1.ListOptions{
			FieldSelector: fields.AndSelectors(fields.OneTermEqualSelector("involvedObject.name", n.agentPod),
				fields.OneTermEqualSelector("reason", reason)).String(),
		})
		if err != nil || len(list.Items) == 0 {
			return false
		}
		ev = list.Items[0]
		return true
	})
	return ev
}
