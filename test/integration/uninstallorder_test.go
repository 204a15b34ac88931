package integration

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// releaseWatch notes, at the first rule removal of an uninstall (the
// first pod released), what the node looked like.
type releaseWatch struct {
	ruleset.Applier
	mu      sync.Mutex
	at      func() string
	first   string
	removes int
}

func (r *releaseWatch) Remove(netns string) error {
	r.mu.Lock()
	if r.removes++; r.removes == 1 && r.at != nil {
		r.first = r.at()
	}
	r.mu.Unlock()
	return r.Applier.Remove(netns)
}

// TestUninstallOrder: an uninstall (no DaemonSet) writes the uninstall
// marker, then unchains the plugin, then releases the pods, then removes
// the rest and, last, the marker. Each kill point is safe: before the
// unchaining the marker makes a plugin that finds no agent let pods
// through (test/chaos TestUninstallKilled); after it no config names the
// plugin. A new agent removes a stale marker before it chains the plugin.
func TestUninstallOrder(t *testing.T) {
	w := &releaseWatch{}
	n := newNode(t, nodeOptions{AgentHook: func(c *nodeagent.Config) { w.Applier = c.Rules; c.Rules = w }})
	marker := n.cfg.Layout().Uninstalling()
	conf := filepath.Join(n.confDir, simnode.PrimaryConf)
	chained := func() bool {
		b, err := os.ReadFile(conf)
		return err == nil && bytes.Contains(b, []byte(`"`+cnibin.PluginName+`"`))
	}
	w.at = func() string {
		_, err := os.Lstat(marker)
		return "marker present: " + map[bool]string{true: "yes", false: "no"}[err == nil] +
			"; plugin chained: " + map[bool]string{true: "yes", false: "no"}[chained()]
	}
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	n.waitEnrolled(waitLong, a)

	n.stopDaemon()
	w.mu.Lock()
	first, removes := w.first, w.removes
	w.mu.Unlock()
	if removes == 0 {
		t.Fatal("the uninstall released no pod")
	}
	if first != "marker present: yes; plugin chained: no" {
		t.Errorf("when the first pod was released: %s; want the marker written and the plugin unchained before", first)
	}
	if n.hasRules(a) {
		t.Error("the pod keeps its rules")
	}
	if chained() {
		t.Error("the plugin is still chained after the uninstall")
	}
	if _, err := os.Lstat(marker); !os.IsNotExist(err) {
		t.Errorf("the marker outlived a complete uninstall: %v", err)
	}
	logs := strings.Join(n.logs.all(), "\n")
	iMarker, iUnchained := strings.Index(logs, "uninstall: marker written"), strings.Index(logs, "uninstall: plugin unchained")
	if iMarker < 0 || iUnchained < 0 || iMarker > iUnchained {
		t.Errorf("log order: marker at %d, unchained at %d; want the marker first", iMarker, iUnchained)
	}

	// An uninstall cut short left its marker; the mesh is installed again:
	// the new agent removes it before it chains the plugin.
	if err := os.WriteFile(marker, []byte("left by a killed uninstall\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	n.startDaemon()
	if _, err := os.Lstat(marker); !os.IsNotExist(err) {
		t.Errorf("a new agent left the stale marker: %v", err)
	}
	if !chained() {
		t.Error("the new agent did not chain the plugin")
	}
}

// TestUninstallMarkerOnReleaseSignalDeletion: the agent writes the
// uninstall marker the moment its watch sees the release's signal deleted
// (helm uninstall's hook deletes it before the DaemonSet, helm's own
// uninstall before the DaemonSet and the RBAC, so before any agent gets
// SIGTERM), so a kill anywhere in the shutdown that follows finds it; a
// signal created again takes the marker away. The agent serves
// throughout. Then the helm order: signal, DaemonSet, the agent stops: an
// uninstall, marker gone last.
func TestUninstallMarkerOnReleaseSignalDeletion(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	marker := n.cfg.Layout().Uninstalling()
	exists := func() bool { _, err := os.Lstat(marker); return err == nil }
	poll.Within(t, waitLong, "the watch seeing the release signal", func() bool { return n.d.ReleaseSignalSeen() == "present" })
	if exists() {
		t.Fatal("marker written while the release lives")
	}
	ctx := context.Background()
	n.deleteReleaseSignal()
	poll.Within(t, waitLong, "the marker after the signal's deletion", exists)
	if failed := n.d.Ready(); len(failed) > 0 {
		t.Errorf("the agent stopped serving when the release signal went: %v", failed)
	}
	if err := kubeenv.CreateReleaseSignal(ctx, n.env.Client, n.agentNS, n.cfg.ReleaseSignal); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, waitLong, "the marker gone once the signal is back", func() bool { return !exists() })

	n.deleteReleaseSignal()
	poll.Within(t, waitLong, "the marker after the second deletion", exists)
	if err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Delete(ctx, n.cfg.DaemonSet, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.stopDaemon()
	if exists() {
		t.Error("the marker outlived a complete uninstall")
	}
	if b, err := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf)); err != nil || bytes.Contains(b, []byte(`"`+cnibin.PluginName+`"`)) {
		t.Errorf("plugin still chained after the uninstall (%v)", err)
	}
}

// TestDaemonSetDeletedWhileRunning: the DaemonSet deleted alone (the
// release's signal left in place; no garbage collector here, so nothing
// deletes the agent, as with --cascade=orphan) writes no marker while the
// agent runs; when it stops, its read of the DaemonSet (NotFound, its RBAC
// intact) is proof of an uninstall: pods released, plugin unchained,
// marker gone.
func TestDaemonSetDeletedWhileRunning(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	n.waitEnrolled(waitLong, a)
	marker := n.cfg.Layout().Uninstalling()
	if err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Delete(context.Background(), n.cfg.DaemonSet, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if failed := n.d.Ready(); len(failed) > 0 {
		t.Errorf("the agent stopped serving when its DaemonSet went: %v", failed)
	}
	n.stopDaemon()
	if n.hasRules(a) {
		t.Error("the pod keeps its rules after the uninstall")
	}
	if bin, chained := n.pluginInstalled(); bin || chained {
		t.Errorf("DaemonSet deleted, agent stopped: plugin binary %v, chained %v; want both gone", bin, chained)
	}
	if _, err := os.Lstat(marker); !os.IsNotExist(err) {
		t.Errorf("the marker outlived a complete uninstall: %v", err)
	}
}

// TestRenamedDaemonSetIsAnUpgrade: helm upgrade with a new name for the
// DaemonSet (istioCompat.names, nameOverride) creates the new DaemonSet,
// deletes the old release's RBAC, then its DaemonSet, and the old agent
// stops; the release's signal, named for the release, stays. The agent's
// read at shutdown is refused, and the signal was never seen deleted: no
// proof of an uninstall, so the stop is an upgrade (another DaemonSet of
// the chart schedules onto the node: its agent takes over). The pods keep their rules,
// ztunnel gets no Del, the plugin stays chained, and the uninstall marker
// is never written.
func TestRenamedDaemonSetIsAnUpgrade(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	ctx := context.Background()
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	b := n.runPod(podSpec(shop, "b", nil, nil))
	n.waitEnrolled(waitLong, a, b)
	poll.Within(t, waitLong, "the watch seeing the release signal", func() bool { return n.d.ReleaseSignalSeen() == "present" })

	// The new release's DaemonSet: the chart's selector labels, a new name.
	labels := map[string]string{"app.kubernetes.io/name": "ambient-cni", "app.kubernetes.io/instance": "mesh"}
	renamed := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: testnet.RandName("istio-cni-node-", 6), Namespace: n.agentNS, Labels: labels},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "install-cni", Image: "x"}}},
			},
		},
	}
	if _, err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Create(ctx, renamed, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	n.revokeAgentRBAC()
	if err := n.env.Client.AppsV1().DaemonSets(n.agentNS).Delete(ctx, n.cfg.DaemonSet, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if seen := n.d.ReleaseSignalSeen(); seen != "present" {
		t.Errorf("the release signal, after the rename: %q, want present", seen)
	}
	n.stopDaemon()

	// The new agent takes the pods over as they are.
	if !n.hasRules(a) || !n.hasRules(b) {
		t.Errorf("a pod lost its rules in a rename: a %v, b %v", n.hasRules(a), n.hasRules(b))
	}
	if dels := slices.DeleteFunc(n.zt.Messages(), func(m ztunnel.Message) bool { return m.Kind != ztunnel.KindDel }); len(dels) > 0 {
		t.Errorf("ztunnel got a Del in a rename: %+v", dels)
	}
	if bin, chained := n.pluginInstalled(); !bin || !chained {
		t.Errorf("rename: plugin binary %v, chained %v; want both kept", bin, chained)
	}
	if _, err := os.Lstat(n.cfg.Layout().Uninstalling()); !os.IsNotExist(err) {
		t.Errorf("the uninstall marker left behind by a rename: %v", err)
	}
	if logs := strings.Join(n.logs.all(), "\n"); strings.Contains(logs, "uninstall: marker written") {
		t.Error("the uninstall marker was written in a rename")
	}
}
