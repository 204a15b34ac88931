package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The tests in this file pin where the agent behaves as Istio's istio-cni
// does (issue 11; docs/differences-from-istio.md lists where it does not).

// settleController returns once the pod controller has handled every
// change queued before the call: it has one worker that takes changes in
// order, so a pod label flipped on and then off again (each waited for)
// comes after everything queued earlier. sentinel is a running pod in a
// namespace that is not enabled.
func (n *node) settleController(sentinel *kubesim.Pod) {
	n.t.Helper()
	n.setPodMode(sentinel, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, sentinel)
	n.setPodMode(sentinel, "")
	n.waitUnenrolled(sentinel)
}

// TestTerminatingPodStaysCaptured: a pod deleted gracefully stays in the
// mesh for its whole grace period, as in Istio: its rules, its ztunnel
// workload, its probe address and its annotation stay while the object
// carries a deletionTimestamp, and its traffic (a preStop hook's, a
// draining server's) still goes through the stand-in both ways. Only when
// kubelet tears the sandbox down and the object goes is it removed. Both
// ways in are covered: a pod captured by its CNI ADD and one captured by
// the controller while running.
func TestTerminatingPodStaysCaptured(t *testing.T) {
	n := newNode(t, nodeOptions{})
	ctx := context.Background()
	shop := n.namespace("shop", nil)
	plain := n.namespace("plain", nil)
	running := n.runPod(podSpec(shop, "running", nil, nil))
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, running)
	viaCNI := n.runPod(podSpec(shop, "via-cni", nil, nil))
	peer := n.runPod(podSpec(shop, "peer", nil, nil))
	n.waitEnrolled(waitLong, viaCNI, peer)
	sentinel := n.runPod(podSpec(plain, "sentinel", nil, nil))

	for _, p := range []*kubesim.Pod{viaCNI, running} {
		pods := n.env.Client.CoreV1().Pods(p.Obj.Namespace)
		uid := p.Obj.UID
		// The user's delete: kubelet would now run preStop hooks and
		// signal the containers, and keep the sandbox for up to the grace
		// period.
		grace := int64(600)
		if err := pods.Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace, Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil {
			t.Fatalf("graceful delete of %s: %v", p.Obj.Name, err)
		}
		obj, err := pods.Get(ctx, p.Obj.Name, metav1.GetOptions{})
		if err != nil || obj.DeletionTimestamp == nil {
			t.Fatalf("%s after a graceful delete: %v, deletionTimestamp %v", p.Obj.Name, err, obj.DeletionTimestamp)
		}
		n.settleController(sentinel)

		if got, ok := n.d.Agent().EnrolledUID(p.Obj.Namespace, p.Obj.Name); !ok || got != uid {
			t.Fatalf("terminating pod %s left the agent state (%q, %v)", p.Obj.Name, got, ok)
		}
		if _, ok := n.zt.Workload(string(uid)); !ok {
			t.Fatalf("terminating pod %s is no longer served by the stand-in", p.Obj.Name)
		}
		if slices.ContainsFunc(n.zt.Messages(), func(m ztunnel.Message) bool { return m.Kind == ztunnel.KindDel && m.UID == string(uid) }) {
			t.Fatalf("the stand-in got a Del for terminating pod %s", p.Obj.Name)
		}
		if got := n.annotation(p); got != ambient.RedirectionEnabled {
			t.Fatalf("terminating pod %s: annotation %q, want %q", p.Obj.Name, got, ambient.RedirectionEnabled)
		}
		if !n.hasRules(p) {
			t.Fatalf("terminating pod %s lost its rules:\n%s", p.Obj.Name, n.rulesDump(p))
		}
		if !n.inProbeSet(p) {
			t.Fatalf("terminating pod %s: its IP left the host probe set", p.Obj.Name)
		}
		// Its traffic during the grace period is still in the mesh.
		mustGet(t, p, peer)
		n.requireTunneled(p, peer)
		mustGet(t, peer, p)
		n.requireTunneled(peer, p)

		// kubelet is done: sandbox torn down (CNI DEL), status updated,
		// object removed. The agent lets the pod go without a word (in
		// particular without looking for its vanished network).
		mark := n.logs.mark()
		if err := n.kube.Teardown(ctx, p); err != nil {
			t.Fatalf("teardown of %s: %v", p.Obj.Name, err)
		}
		if err := n.kube.SetStatus(ctx, p, corev1.PodRunning); err != nil {
			t.Fatal(err)
		}
		zero := int64(0)
		if err := pods.Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil {
			t.Fatalf("final delete of %s: %v", p.Obj.Name, err)
		}
		n.waitStandIn(func() bool { _, ok := n.zt.Workload(string(uid)); return !ok }, "the stand-in to drop "+p.Obj.Name)
		poll.Within(t, waitLong, p.Obj.Name+" gone from the agent state", func() bool {
			_, ok := n.d.Agent().EnrolledUID(p.Obj.Namespace, p.Obj.Name)
			return !ok
		})
		if n.inProbeSet(p) {
			t.Fatalf("%s: its IP is still in the host probe set after the pod went", p.Obj.Name)
		}
		for _, w := range n.logs.warningsSince(mark) {
			t.Errorf("agent complained while %s went: %s", p.Obj.Name, w)
		}
	}
}

// TestPodWithIPsEnrolledBeforeRunning: a running pod is enrolled as soon
// as it has IPs, whatever its phase, as in Istio: here a pod whose init
// containers still run (phase Pending, sandbox up with its IPs) when its
// namespace is labelled. Its init containers' traffic must be captured
// too.
func TestPodWithIPsEnrolledBeforeRunning(t *testing.T) {
	n := newNode(t, nodeOptions{})
	ctx := context.Background()
	shop := n.namespace("shop", nil)
	p := n.runPod(podSpec(shop, "init", nil, nil))
	if err := n.kube.SetStatus(ctx, p, corev1.PodPending); err != nil {
		t.Fatal(err)
	}
	if p.Obj.Status.Phase != corev1.PodPending || len(p.Obj.Status.PodIPs) == 0 {
		t.Fatalf("pod status %+v, want Pending with IPs", p.Obj.Status)
	}
	peer := n.runPod(podSpec(shop, "peer", nil, nil))
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, p, peer)
	mustGet(t, p, peer)
	n.requireTunneled(p, peer)
}

// revokeAgentRBAC deletes the agent's RoleBindings and ClusterRoleBindings
// (as helm uninstall does, or an operator's mistake) and waits until the
// agent's read of its DaemonSet is refused.
func (n *node) revokeAgentRBAC() {
	n.t.Helper()
	ctx := context.Background()
	rbac := n.env.Client.RbacV1()
	rbs, err := rbac.RoleBindings(n.agentNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	for _, rb := range rbs.Items {
		if err := rbac.RoleBindings(n.agentNS).Delete(ctx, rb.Name, metav1.DeleteOptions{}); err != nil {
			n.t.Fatal(err)
		}
	}
	crbs, err := rbac.ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	for _, crb := range crbs.Items {
		if slices.ContainsFunc(crb.Subjects, func(s rbacv1.Subject) bool { return s.Namespace == n.agentNS }) {
			if err := rbac.ClusterRoleBindings().Delete(ctx, crb.Name, metav1.DeleteOptions{}); err != nil {
				n.t.Fatal(err)
			}
		}
	}
	poll.Within(n.t, waitLong, "the agent's DaemonSet read refused", func() bool {
		_, err := n.client.AppsV1().DaemonSets(n.agentNS).Get(ctx, n.cfg.DaemonSet, metav1.GetOptions{})
		return apierrors.IsForbidden(err)
	})
}

// pluginInstalled reports whether the plugin binary is on the node and
// the primary conflist names it.
func (n *node) pluginInstalled() (binary, chained bool) {
	n.t.Helper()
	_, err := os.Stat(filepath.Join(n.binDir, cnibin.PluginName))
	conf, cerr := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf))
	if cerr != nil {
		n.t.Fatal(cerr)
	}
	return err == nil, bytes.Contains(conf, []byte(`"`+cnibin.PluginName+`"`))
}

// TestShutdownUninstallsOnlyOnProof: a stopping agent removes the plugin
// only on proof of an uninstall. Losing its RBAC while its DaemonSet lives
// (RBAC briefly wrong) leaves the plugin installed and says why; the order
// helm uninstall deletes things in (the release's signal, the DaemonSet,
// then RBAC, then the pods stop) still removes it, because the agent's
// watch saw the signal go.
func TestShutdownUninstallsOnlyOnProof(t *testing.T) {
	t.Run("rbac lost", func(t *testing.T) {
		n := newNode(t, nodeOptions{Upgrade: true})
		poll.Within(t, waitLong, "the agent's watch sees the release signal", func() bool { return n.d.ReleaseSignalSeen() == "present" })
		n.revokeAgentRBAC()
		mark := n.logs.mark()
		n.stopDaemon()
		if bin, chained := n.pluginInstalled(); !bin || !chained {
			t.Fatalf("RBAC lost, DaemonSet alive: plugin binary %v, chained %v; want both kept", bin, chained)
		}
		if !slices.ContainsFunc(n.logs.warningsSince(mark), func(w string) bool {
			return strings.Contains(w, "leaving the plugin installed") && strings.Contains(w, "not proof of an uninstall")
		}) {
			t.Errorf("no warning saying why the plugin stays: %q", n.logs.warningsSince(mark))
		}
	})
	t.Run("helm uninstall order", func(t *testing.T) {
		n := newNode(t, nodeOptions{Upgrade: true})
		poll.Within(t, waitLong, "the agent's watch sees the release signal", func() bool { return n.d.ReleaseSignalSeen() == "present" })
		n.deleteReleaseSignal()
		if err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Delete(context.Background(), n.cfg.DaemonSet, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		poll.Within(t, waitLong, "the agent's watch sees the release signal deleted", func() bool { return n.d.ReleaseSignalSeen() == "deleted" })
		n.revokeAgentRBAC()
		n.stopDaemon()
		if bin, chained := n.pluginInstalled(); bin || chained {
			t.Fatalf("uninstalled: plugin binary %v, chained %v; want both gone", bin, chained)
		}
	})
}

// debugGet asks the daemon's debug socket, as root on the node would.
func (n *node) debugGet(path string) (int, []byte) {
	n.t.Helper()
	sock := n.d.DebugSocket()
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	resp, err := c.Get("http://agent" + path)
	if err != nil {
		n.t.Fatalf("debug GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		n.t.Fatal(err)
	}
	return resp.StatusCode, b
}

// explain is the agent's answer for one pod.
func (n *node) explain(namespace, name string) *explainwire.Report {
	n.t.Helper()
	code, body := n.debugGet("/debug/explain?pod=" + namespace + "/" + name)
	if code != http.StatusOK {
		n.t.Fatalf("explain %s/%s: HTTP %d %s", namespace, name, code, body)
	}
	var r explainwire.Report
	if err := json.Unmarshal(body, &r); err != nil {
		n.t.Fatalf("explain %s/%s: %v\n%s", namespace, name, err, body)
	}
	n.t.Logf("explain %s/%s: %s", namespace, name, body)
	return &r
}

// TestDebugOnlyOnTheRootSocket: the debug endpoints (pod names, UIDs, IPs,
// netns paths) and the health endpoints are not served on the metrics
// address, only on the root-only socket next to the agent
// socket, which install-cni's own debug command reads.
func TestDebugOnlyOnTheRootSocket(t *testing.T) {
	n := newNode(t, nodeOptions{})
	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "web", nil, nil))
	n.waitEnrolled(waitLong, p)
	maddr := n.metricsAddress()
	for _, path := range []string{"/debug/pods", "/debug/explain", "/debug/explain?pod=" + shop + "/web", "/readyz", "/healthz", "/livez"} {
		code, body := n.getFrom(maddr, path)
		if code != http.StatusNotFound || strings.Contains(body, string(p.Obj.UID)) {
			t.Errorf("%s on the metrics address %s: HTTP %d %q; want 404 and nothing about pods", path, maddr, code, body)
		}
	}
	if code, _ := n.getFrom(maddr, "/metrics"); code != http.StatusOK {
		t.Errorf("/metrics on the metrics address: HTTP %d", code)
	}
	sock := n.d.DebugSocket()
	if filepath.Dir(sock) != filepath.Dir(n.cfg.AgentSocket) {
		t.Errorf("debug socket %s is not in the agent's private directory", sock)
	}
	for path, perm := range map[string]os.FileMode{filepath.Dir(sock): 0o700, sock: 0o600} {
		if st, err := os.Stat(path); err != nil || st.Mode().Perm() != perm {
			t.Errorf("%s: mode %v (%v), want %v", path, st.Mode().Perm(), err, perm)
		}
	}
	var out bytes.Buffer
	if err := installcni.DebugMain([]string{"--agent-socket=" + n.cfg.AgentSocket, "pods"}, func(string) string { return "" }, &out, io.Discard); err != nil {
		t.Fatalf("install-cni debug pods: %v", err)
	}
	if !strings.Contains(out.String(), string(p.Obj.UID)) {
		t.Errorf("install-cni debug pods does not list the captured pod:\n%s", out.String())
	}
	n.stopDaemon()
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("debug socket left behind by a stopped agent: %v", err)
	}
}

// TestExplain: for any pod of the node the debug endpoint says why it is
// or is not captured: the policy's reason, whether its netns was found,
// whether its rules verify clean now (drift named), whether ztunnel acked
// it, and its annotation, with the rules backend the agent runs (the
// shipped auto: nftables here).
func TestExplain(t *testing.T) {
	n := newNode(t, nodeOptions{})
	ctx := context.Background()
	shop := n.namespace("shop", nil)
	good := n.runPod(podSpec(shop, "good", nil, nil))
	drifted := n.runPod(podSpec(shop, "drifted", nil, nil))
	rejected := n.runPod(podSpec(shop, "rejected", nil, nil))
	optOut := n.runPod(podSpec(shop, "opt-out", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone}, nil))
	finished := n.runPod(podSpec(shop, "finished", nil, nil))
	if err := n.kube.Finish(ctx, finished); err != nil {
		t.Fatal(err)
	}
	// Objects only (no sandbox): a hostNetwork pod, a sidecar pod, a pod
	// of an excluded namespace, and one whose status shows an IP no
	// process of it holds.
	create := func(p *corev1.Pod) *corev1.Pod {
		obj, err := n.kube.Create(ctx, p)
		if err != nil {
			t.Fatalf("create %s: %v", p.Name, err)
		}
		t.Cleanup(func() {
			zero := int64(0)
			_ = n.env.Client.CoreV1().Pods(obj.Namespace).Delete(context.Background(), obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		})
		return obj
	}
	hostNet := podSpec(shop, "host-net", nil, nil)
	hostNet.Spec.HostNetwork = true
	create(hostNet)
	create(podSpec(shop, "sidecar", nil, map[string]string{ambient.SidecarStatusAnnotation: "{}"}))
	// Bare pods need their namespace's default ServiceAccount; no
	// controller makes kube-system's here.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "default"}}
	if _, err := n.env.Client.CoreV1().ServiceAccounts("kube-system").Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	system := create(podSpec("kube-system", testnet.RandName("system-", 6), nil, nil))
	ghost := create(podSpec(shop, "ghost", nil, nil))
	// An address of the node's pod network that host-local never handed out
	// (it allocates from the bottom).
	ghostIP := netip.AddrFrom4([4]byte{n.subnet.Addr().As4()[0], n.subnet.Addr().As4()[1], n.subnet.Addr().As4()[2], 250})
	patch := fmt.Sprintf(`{"status":{"phase":"Running","podIP":%q,"podIPs":[{"ip":%q}]}}`, ghostIP, ghostIP)
	if _, err := n.env.Client.CoreV1().Pods(shop).Patch(ctx, ghost.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}

	n.zt.SetFaults(ztunnel.Faults{RejectAdd: func(uid string) string {
		if uid == string(rejected.Obj.UID) {
			return "rejected by the test"
		}
		return ""
	}})
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, good, drifted)
	poll.Within(t, waitLong, "the rejected pod captured, pending", func() bool { return n.d.Agent().Pending(rejected.Obj.UID) })
	n.deleteFirstOutputRule(drifted.NS.Path())

	// The annotation is read from the agent's informer cache, a moment
	// behind the API.
	var r *explainwire.Report
	poll.Within(t, waitLong, "the captured pod explained as fine", func() bool { r = n.explain(shop, "good"); return r.OK })
	if !r.OK || r.Verdict != "captured (namespace labelled ambient)" || !r.Policy.Capture || r.Policy.NamespaceLabel != ambient.DataplaneModeAmbient ||
		r.Captured == nil || !r.Captured.ZtunnelAcked || r.Captured.Via != "controller" || !r.Captured.Rules.Clean ||
		r.Captured.Rules.Backend != n.rules.Name || !r.Netns.Found || r.Annotation != ambient.RedirectionEnabled || r.UID != string(good.Obj.UID) {
		t.Errorf("captured pod explained as %+v", r)
	}
	r = n.explain(shop, "drifted")
	if r.OK || r.Captured == nil || r.Captured.Rules.Clean || len(r.Captured.Rules.Drift) == 0 ||
		!slices.ContainsFunc(r.Problems, func(p string) bool { return strings.Contains(p, "drifted") }) {
		t.Errorf("drifted pod explained as %+v", r)
	}
	r = n.explain(shop, "rejected")
	if r.OK || r.Captured == nil || r.Captured.ZtunnelAcked || r.Captured.State != ambient.RedirectionPending ||
		!slices.ContainsFunc(r.Problems, func(p string) bool { return strings.Contains(p, "ztunnel has not acknowledged") }) {
		t.Errorf("pod ztunnel rejected explained as %+v", r)
	}
	r = n.explain(shop, "ghost")
	if r.OK || r.Captured != nil || r.Netns.Found || !strings.HasPrefix(r.Verdict, "NOT CAPTURED, but should be") ||
		!strings.Contains(r.Netns.How, "not found") {
		t.Errorf("pod whose netns cannot be found explained as %+v", r)
	}
	for name, want := range map[string]enablement.Reason{
		optOut.Obj.Name: enablement.ReasonPodOptOut, "host-net": enablement.ReasonHostNetwork, "sidecar": enablement.ReasonSidecar,
		finished.Obj.Name: enablement.ReasonTerminal,
	} {
		r := n.explain(shop, name)
		if !r.OK || r.Policy.Capture || r.Policy.Reason != string(want) || r.Verdict != "not captured: "+string(want) || r.Captured != nil || r.Netns.Found {
			t.Errorf("%s explained as %+v; want not captured: %s", name, r, want)
		}
	}
	if r := n.explain("kube-system", system.Name); !r.OK || r.Policy.Reason != string(enablement.ReasonExcludedNamespace) {
		t.Errorf("pod of an excluded namespace explained as %+v", r)
	}
	if code, body := n.debugGet("/debug/explain?pod=" + shop + "/nobody"); code != http.StatusNotFound {
		t.Errorf("unknown pod: HTTP %d %s", code, body)
	}
	code, body := n.debugGet("/debug/explain")
	var all explainwire.NodeReport
	if err := json.Unmarshal(body, &all); code != http.StatusOK || err != nil {
		t.Fatalf("explain all: HTTP %d %v\n%s", code, err, body)
	}
	if all.Captured != 3 || all.WithProblems != 3 || all.RulesBackend != n.rules.Name || all.ZtunnelConnections == nil || *all.ZtunnelConnections != 1 {
		t.Errorf("node report: %d pods, %d captured, %d with problems, backend %q, ztunnels %v; want 3 captured, 3 with problems",
			all.Pods, all.Captured, all.WithProblems, all.RulesBackend, all.ZtunnelConnections)
	}
}
