package integration

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// TestAgentRestartKeepsTraffic: with three enrolled pods, the agent stops
// (an upgrade: its DaemonSet remains) and a new one starts. A TCP
// connection opened through the stand-in before the restart still carries
// data during and after it, the in-pod rules are left exactly as they were
// (same rules, counters only grown: nothing was re-created), and the
// stand-in's new connection got a snapshot naming all three pods.
func TestAgentRestartKeepsTraffic(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	b := n.runPod(podSpec(shop, "b", nil, nil))
	c := n.runPod(podSpec(shop, "c", nil, nil))
	pods := []*kubesim.Pod{a, b, c}
	n.waitEnrolled(waitLong, pods...)

	const echoPort = 9090
	testnet.ServeEcho(t, b.NS, echoPort)
	conn := dial(t, a, netip4Port(b, echoPort))
	roundTrip(t, conn, "before the restart")
	if !n.hasRecord(func(r ztunnel.Record) bool {
		return r.UID == string(a.Obj.UID) && r.Port == ambient.ZtunnelOutboundPort && r.OrigDst == netip4Port(b, echoPort) && r.Tunneled
	}) {
		t.Fatalf("echo connection did not go through the stand-in: %+v", n.zt.Records())
	}
	mustGet(t, c, a)
	mustGet(t, b, c)
	before := map[string]string{}
	for _, p := range pods {
		before[p.Obj.Name] = n.dump(p.NS.Path())
	}
	served := n.zt.Workloads()
	conns, msgs := n.zt.Connections(), len(n.zt.Messages())

	n.stopDaemon()
	conf, err := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf))
	if err != nil || !strings.Contains(string(conf), `"`+cnibin.PluginName+`"`) {
		t.Fatalf("an upgrade must leave the plugin chained (err %v):\n%s", err, conf)
	}
	roundTrip(t, conn, "while the agent is down")

	n.startDaemon()
	n.waitStandIn(func() bool { return n.zt.Connections() > conns && n.zt.Ready() }, "the stand-in's snapshot from the new agent")
	roundTrip(t, conn, "after the restart")

	// The snapshot on the new connection: an Add with the netns for each
	// pod, then SnapshotSent.
	var snap []ztunnel.Message
	for _, m := range n.zt.Messages()[msgs:] {
		if m.Conn == conns+1 {
			snap = append(snap, m)
		}
	}
	if len(snap) != 4 || snap[3].Kind != ztunnel.KindSnapshotSent {
		t.Fatalf("snapshot on the new connection: %+v, want three Adds then SnapshotSent", snap)
	}
	for _, p := range pods {
		if !slices.ContainsFunc(snap[:3], func(m ztunnel.Message) bool {
			return m.Kind == ztunnel.KindAdd && m.UID == string(p.Obj.UID) && m.FDs == 1 && m.AckError == ""
		}) {
			t.Errorf("snapshot does not name %s with its netns: %+v", p.Obj.Name, snap)
		}
	}
	if after := n.zt.Workloads(); !slices.EqualFunc(served, after, func(x, y ztunnel.Workload) bool {
		return x.UID == y.UID && x.Netns == y.Netns && slices.Equal(x.Ports, y.Ports)
	}) {
		t.Fatalf("stand-in workloads changed across the restart: %+v -> %+v", served, after)
	}

	mustGet(t, c, a)
	mustGet(t, b, c)
	for _, p := range pods {
		after := n.dump(p.NS.Path())
		if err := n.rulesKept(before[p.Obj.Name], after); err != nil {
			t.Errorf("pod %s: %v", p.Obj.Name, err)
		}
	}
	if got := counter(t, n.metrics.RuleDrift); got != 0 {
		t.Errorf("the restarted agent repaired drift %v times; there was none", got)
	}
	for _, p := range pods {
		if got := n.annotation(p); got != ambient.RedirectionEnabled {
			t.Errorf("pod %s annotation %q after the restart", p.Obj.Name, got)
		}
	}
}

// TestRestartRepairsRuleRemovedWhileDown: a rule deleted by hand while the
// agent was down is back when the restarted agent reports ready; the
// other pod's rules are left untouched; a pod deleted while the agent was
// down is cleaned up (ztunnel drops it with the snapshot, its IP leaves
// the host probe set, its spooled DEL is replayed).
func TestRestartRepairsRuleRemovedWhileDown(t *testing.T) {
	// An upgrade: the plugin stays installed and spools DELs meanwhile.
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	b := n.runPod(podSpec(shop, "b", nil, nil))
	gone := n.runPod(podSpec(shop, "gone", nil, nil))
	n.waitEnrolled(waitLong, a, b, gone)
	mustGet(t, a, b)
	bBefore := n.dump(b.NS.Path())

	n.stopDaemon()
	// Deleted while the agent is down: the plugin spools the DEL.
	if err := n.kube.Delete(context.Background(), gone); err != nil {
		t.Fatalf("delete pod while the agent is down: %v", err)
	}
	if spooled, _ := nodefiles.List(n.cfg.Layout().DelSpool()); len(spooled) != 1 {
		t.Fatalf("spooled DELs while the agent is down: %+v, want the deleted pod's", spooled)
	}
	n.deleteFirstOutputRule(a.NS.Path())
	verifier := n.rules.Rules
	want := ruleset.PodConfig{ProbeSNATv4: n.cfg.ProbeSNATv4, ProbeSNATv6: n.cfg.ProbeSNATv6, DNSCapture: n.cfg.DNSCapture}
	drift, err := verifier.Verify(a.NS.Path(), want)
	if err != nil || drift.Empty() {
		t.Fatalf("the hand-made drift is not visible (err %v)", err)
	}
	t.Logf("drift made while the agent is down: %s", drift)

	n.startDaemon() // returns once ready, i.e. after the startup restore
	if drift, err := verifier.Verify(a.NS.Path(), want); err != nil || !drift.Empty() {
		t.Fatalf("after restart: drift %s, err %v", drift, err)
	}
	if got := counter(t, n.metrics.RuleDrift); got != 1 {
		t.Errorf("drift repairs counted %v, want 1", got)
	}
	if err := n.rulesKept(bBefore, n.dump(b.NS.Path())); err != nil {
		t.Errorf("pod b (no drift): %v", err)
	}
	n.waitStandIn(func() bool { return n.zt.Ready() && n.zt.Connections() >= 2 }, "the stand-in's snapshot from the new agent")
	mustGet(t, a, b)
	n.requireTunneled(a, b)

	if _, ok := n.zt.Workload(string(gone.Obj.UID)); ok {
		t.Error("the stand-in still serves the pod deleted while the agent was down")
	}
	if _, ok := n.d.Agent().EnrolledUID(shop, "gone"); ok {
		t.Error("the pod deleted while the agent was down is in the agent state")
	}
	if n.inProbeSet(gone) {
		t.Error("the IP of the pod deleted while the agent was down is still in the host probe set")
	}
	if !n.inProbeSet(a) || !n.inProbeSet(b) {
		t.Error("the restored pods' IPs are not in the host probe set")
	}
	if spooled, _ := nodefiles.List(n.cfg.Layout().DelSpool()); len(spooled) != 0 {
		t.Errorf("spooled DELs left after the restart: %+v", spooled)
	}
}

// counter reads a prometheus counter.
func counter(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// roundTrip sends msg on an echo connection and requires it back.
func roundTrip(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("write %q: %v", msg, err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
		t.Fatalf("echo of %q: %q, %v", msg, buf, err)
	}
}

// TestPodStartedWhileAgentGoneRecheckedOnReturn: with the agent gone and
// no API server to ask (this node's agent has no plugin credential), the
// real plugin decides by the persistent snapshot, which may predate a
// label put on a pod or its namespace while the agent was away: a new pod
// opted in by its own label waits (code 11), and so does a pod the
// snapshot lists as outside the mesh (its sandbox restarted, same UID);
// a pod of the control plane's namespaces starts and is recorded. When
// the agent returns the retried pods start, the labelled one captured,
// and the record is re-checked.
func TestPodStartedWhileAgentGoneRecheckedOnReturn(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	plain := n.namespace("plain", nil)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	outside := n.runPod(podSpec(plain, "outside", nil, nil))
	n.waitEnrolled(waitLong, a)
	state := n.cfg.Layout().StateSnapshot()
	poll.Within(t, waitLong, "the snapshot lists this node's pods", func() bool {
		s, err := nodefiles.ReadSnapshot(state)
		return err == nil && len(s.Pods) >= 2
	})

	n.stopDaemon()
	ctx := context.Background()
	obj, err := n.kube.Create(ctx, podSpec(plain, "late", ambientLabel, nil))
	if err != nil {
		t.Fatal(err)
	}
	var te *types.Error
	if _, err := n.kube.Start(ctx, obj); !errors.As(err, &te) || te.Code != types.ErrTryAgainLater {
		t.Fatalf("SECURITY: a pod opted in by its label started while the agent was gone: %v; want code 11", err)
	}
	// The snapshot cannot tell whether the pod it saw outside the mesh
	// has been labelled since: the restarted sandbox waits too.
	if _, err := n.kube.Start(ctx, outside.Obj); !errors.As(err, &te) || te.Code != types.ErrTryAgainLater {
		t.Fatalf("SECURITY: a pod the snapshot lists outside the mesh started while neither the agent nor the API server could vouch for it: %v; want code 11", err)
	}
	// The agent's own namespace is the control plane's; its pods need the
	// default ServiceAccount no controller made here.
	if _, err := n.env.Client.CoreV1().ServiceAccounts(n.cfg.PodNamespace).Create(ctx,
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	cpObj, err := n.kube.Create(ctx, podSpec(n.cfg.PodNamespace, testnet.RandName("cp-", 6), nil, nil))
	if err != nil {
		t.Fatal(err)
	}
	cp, err := n.kube.Start(ctx, cpObj)
	if err != nil {
		t.Fatalf("a control-plane pod, agent gone: %v", err)
	}
	if e, err := nodefiles.ListAdds(n.cfg.Layout().AddSpool()); err != nil || len(e) != 1 {
		t.Fatalf("recorded ADDs while the agent is gone: %+v, %v; want the control-plane pod's", e, err)
	}

	n.startDaemon()
	poll.Within(t, waitLong, "the record of the pod re-checked", func() bool {
		e, _ := nodefiles.ListAdds(n.cfg.Layout().AddSpool())
		return len(e) == 0
	})
	late, err := n.kube.Start(ctx, obj)
	if err != nil {
		t.Fatalf("the runtime's retry once the agent is back: %v", err)
	}
	restarted, err := n.kube.Start(ctx, outside.Obj)
	if err != nil {
		t.Fatalf("the runtime's retry of the restarted pod once the agent is back: %v", err)
	}
	serveApp(t, late)
	n.waitEnrolled(waitLong, late)
	if n.hasRules(restarted) || n.hasRules(cp) {
		t.Error("a pod outside the mesh got rules on the agent's return")
	}
	mustGet(t, late, a)
}
