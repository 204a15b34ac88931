package app

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient/kubeclienttest"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// switchLabel is the node label the migration page moves istio-cni's
// DaemonSet off a node with.
const switchLabel = "ambient-cni.io/istio-cni"

// takeoverApp is an App set to take over from istio-cni on node "x", in
// namespace istio-system where istio-cni's DaemonSet selects nodes
// labelled switchLabel=on, with the primary config holding istio-cni's
// entry (its run directory, returned, holding no socket).
func takeoverApp(t *testing.T) (a *App, cs *fake.Clientset, conf, runDir string) {
	t.Helper()
	dir := t.TempDir()
	runDir = filepath.Join(dir, "istio-cni")
	plugin := filepath.Join(dir, "ambient-cni")
	for _, d := range []string{runDir, filepath.Join(dir, "net.d")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(plugin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	conf = filepath.Join(dir, "net.d", "10-containerd-net.conflist")
	chained := `{"cniVersion": "1.0.0", "name": "containerd-net", "plugins": [
  {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]]}},
  {"type": "istio-cni", "cni_agent_run_dir": "` + runDir + `", "ambient_enabled": true}]}`
	if err := os.WriteFile(conf, []byte(chained), 0o644); err != nil {
		t.Fatal(err)
	}
	cs = fake.NewClientset(
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "x", Labels: map[string]string{switchLabel: "on"}}},
		&appsv1.DaemonSet{
			ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: apicalls.IstioCNIDaemonSet},
			Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				NodeSelector: map[string]string{switchLabel: "on"},
			}}},
		})
	cfg, err := Parse([]string{"--node-name=x", "--pod-namespace=istio-system", "--pod-name=agent", "--plugin-binary=" + plugin,
		"--cni-bin-dir=" + filepath.Join(dir, "bin"), "--cni-conf-dir=" + filepath.Join(dir, "net.d"),
		"--agent-socket=" + filepath.Join(dir, "run", "agent.sock"), "--state-dir=" + filepath.Join(dir, "state"),
		"--zds-socket=" + filepath.Join(dir, "zds", "ztunnel.sock"), "--istio-cni-run-dir=" + runDir, "--cni-host-conf-dir=/etc/cni/net.d"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	// The host's rules are the real node's (a realnode suite may run
	// beside): the host probe SNAT goes to a namespace that is not there.
	a, err = New(Options{Config: cfg, Client: kubeclienttest.FromClientset(cs), HostNetns: filepath.Join(dir, "no-host-netns")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.rules.Close() })
	return a, cs, conf, runDir
}

// TestTakeoverWaitsForIstioCNIsDaemonSetToLeave: istio-cni's socket
// missing is not enough to take over: it is also missing while
// istio-cni's pod restarts, and the pod that comes back would chain
// itself after ours. The agent takes over only once istio-cni's
// DaemonSet no longer schedules onto the node (the node labelled out of
// its nodeSelector), and not while its agent still answers.
func TestTakeoverWaitsForIstioCNIsDaemonSetToLeave(t *testing.T) {
	a, cs, conf, runDir := takeoverApp(t)
	before, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}

	// istio-cni's pod away (no socket), its DaemonSet still on the node.
	if err := a.installer.IstioCNIHolds(); err == nil || !strings.Contains(err.Error(), "still schedules onto node x") {
		t.Errorf("IstioCNIHolds with istio-cni's DaemonSet still on the node: %v, want it to say so", err)
	}
	if err := a.installer.Install(t.Context()); !errors.Is(err, installer.ErrIstioCNIChained) {
		t.Fatalf("Install while istio-cni's DaemonSet still schedules onto the node: %v, want ErrIstioCNIChained", err)
	}
	if got, _ := os.ReadFile(conf); string(got) != string(before) {
		t.Fatalf("took over while istio-cni's DaemonSet still schedules onto the node:\n%s", got)
	}

	// The node labelled out of istio-cni's DaemonSet, its agent still
	// answering (its pod terminating): still not.
	node, err := cs.CoreV1().Nodes().Get(t.Context(), "x", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Labels[switchLabel] = "off"
	if _, err := cs.CoreV1().Nodes().Update(t.Context(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", filepath.Join(runDir, ambient.IstioCNIEventSocket))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.installer.IstioCNIHolds(); err == nil || !strings.Contains(err.Error(), "still answers") {
		t.Errorf("IstioCNIHolds while istio-cni's agent answers: %v, want it to say so", err)
	}
	_ = ln.Close()

	// Both: the takeover goes ahead.
	if err := a.installer.IstioCNIHolds(); err != nil {
		t.Fatalf("IstioCNIHolds once istio-cni left the node: %v", err)
	}
	if err := a.installer.Install(t.Context()); err != nil {
		t.Fatalf("Install once istio-cni left the node: %v", err)
	}
	got, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(got), `"istio-cni"`) || !strings.Contains(string(got), `"`+installer.DefaultPluginName+`"`) {
		t.Errorf("after the takeover the primary holds:\n%s", got)
	}
	// Our entry tells the plugin where istio-cni runs and where the host
	// keeps the chain, for a node given back while our agent is down.
	var list struct{ Plugins []ambient.PluginConf }
	if err := json.Unmarshal(got, &list); err != nil {
		t.Fatal(err)
	}
	if e := list.Plugins[len(list.Plugins)-1]; e.IstioCNIRunDir != runDir || e.IstioCNIConfDir != "/etc/cni/net.d" {
		t.Errorf("our entry's istioCNIRunDir %q and istioCNIConfDir %q, want %q and the host's /etc/cni/net.d", e.IstioCNIRunDir, e.IstioCNIConfDir, runDir)
	}
}

// TestTakeoverNeedsIstioCNIsDaemonSetFound: a DaemonSet of that name not
// found (another name, another namespace) is no proof that istio-cni left.
func TestTakeoverNeedsIstioCNIsDaemonSetFound(t *testing.T) {
	a, cs, _, _ := takeoverApp(t)
	if err := cs.AppsV1().DaemonSets("istio-system").Delete(t.Context(), apicalls.IstioCNIDaemonSet, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := a.installer.IstioCNIHolds(); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Errorf("IstioCNIHolds with istio-cni's DaemonSet not found: %v, want a refusal saying so", err)
	}
}

// TestStandbyStartOrder: with the takeover set, the agent serves its
// probes before it waits for istio-cni, and binds ztunnel's socket and
// adds its host rules only after: binding renames over the socket a live
// istio-cni serves ztunnel on. Without it the start is unchanged.
func TestStandbyStartOrder(t *testing.T) {
	a, _, _, _ := takeoverApp(t)
	got := stepNames(a.withStandby(newComponents(t.Context(), a.zds, a.log), a.startSteps(newComponents(t.Context(), a.zds, a.log))))
	at := func(name string) int {
		i := slices.Index(got, name)
		if i < 0 {
			t.Fatalf("no step %q in %q", name, got)
		}
		return i
	}
	wait := at(standbyStep)
	if at("debug socket") > wait || at("health and metrics servers") > wait {
		t.Errorf("probes are served only after the standby: %q", got)
	}
	for _, after := range []string{"ZDS socket", "host probe SNAT", "installer and watches", "pod cache sync"} {
		if at(after) < wait {
			t.Errorf("step %q runs before the standby: %q", after, got)
		}
	}

	plain := testApp(t)
	cs := newComponents(t.Context(), plain.zds, plain.log)
	steps := plain.startSteps(cs)
	if got := stepNames(plain.withStandby(cs, steps)); !slices.Equal(got, stepNames(steps)) {
		t.Errorf("without a takeover the start changed: %q", got)
	}
}

// TestStandbyIsReady: standing by, the agent answers ready (helm --wait
// passes on every node before istio-cni leaves any); once the standby
// ends, readiness is the installer's and the servers' again.
func TestStandbyIsReady(t *testing.T) {
	a, _, _, _ := takeoverApp(t)
	if len(a.Ready()) == 0 {
		t.Fatal("a fresh agent that has not started answers ready")
	}
	a.standby.Store(true)
	if r := a.Ready(); len(r) != 0 {
		t.Errorf("standing by, readiness fails: %q", r)
	}
	a.standby.Store(false)
	if len(a.Ready()) == 0 {
		t.Error("after the standby, readiness passes without the plugin chained")
	}
}

// TestGivesTheNodeBackWhenIstioCNIReturns: once the agent serves, a pod of
// istio-cni's DaemonSet scheduled onto the node (the node labelled back)
// ends the agent with errIstioCNIReturns, which its stop takes as a give-
// back (giveBackSteps); a terminating istio-cni pod (the one that left during the
// switch) and our own pods, labelled k8s-app as istio-cni's with
// istioCompat.names, do not.
func TestGivesTheNodeBackWhenIstioCNIReturns(t *testing.T) {
	a, cs, _, _ := takeoverApp(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 2)
	go func() { done <- a.pods.Run(ctx) }() // owner: this test, which cancels and waits
	defer func() { cancel(); <-done }()
	pod := func(name string, labels map[string]string, terminating bool) {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: name, Labels: labels}, Spec: corev1.PodSpec{NodeName: "x"}}
		if terminating {
			now := metav1.Now()
			p.DeletionTimestamp = &now
			p.Finalizers = []string{"test"}
		}
		if _, err := cs.CoreV1().Pods("istio-system").Create(t.Context(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	istio := map[string]string{"k8s-app": apicalls.IstioCNIDaemonSet, "app.kubernetes.io/name": "istio-cni"}
	pod("istio-cni-old", istio, true)
	pod("ours", map[string]string{"k8s-app": apicalls.IstioCNIDaemonSet, "app.kubernetes.io/name": "ambient-cni"}, false)

	if err := a.pods.WaitForSync(t.Context()); err != nil {
		t.Fatal(err)
	}
	if name := a.istioCNIPodHere(); name != "" {
		t.Fatalf("took %s for istio-cni coming back", name)
	}
	pod("istio-cni-back", istio, false)
	poll.Until(t, "the agent sees istio-cni's pod on the node", func() bool { return a.istioCNIPodHere() == "istio-cni-back" })
	wctx, wcancel := context.WithCancel(t.Context())
	defer wcancel()
	if err := a.watchIstioCNIReturn(wctx); !errors.Is(err, errIstioCNIReturns) {
		t.Fatalf("watch ended with %v, want errIstioCNIReturns", err)
	}
}

// TestStandbyWithdrawsOurEntryBehindIstioCNI: the entry a give-back left
// chained in front of istio-cni's stays while istio-cni's agent does not
// answer (a pod that must be captured waits rather than start in a chain
// with neither plugin working), and goes, with our binary, once it
// answers; istio-cni's entry is untouched. The records of the pods handed
// over go at the same moment, not before: until istio-cni's agent has
// them, an uninstall releases them.
func TestStandbyWithdrawsOurEntryBehindIstioCNI(t *testing.T) {
	a, _, conf, runDir := takeoverApp(t)
	b, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	ours := `{"type": "ambient-cni", "agent_socket": "/run/ambient-cni/agent.sock"},
  {"type": "istio-cni"`
	both := strings.Replace(string(b), `{"type": "istio-cni"`, ours, 1)
	if err := os.WriteFile(conf, []byte(both), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(a.cfg.CNIBinDir, "ambient-cni")
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// A pod the give-back handed over to istio-cni, still recorded.
	rec := filepath.Join(a.layout.Records(), "d2b7c1e0-5b0e-4f7e-9a51-1c2d3e4f5a6b.json")
	if err := os.MkdirAll(filepath.Dir(rec), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rec, []byte(`{"uid": "d2b7c1e0-5b0e-4f7e-9a51-1c2d3e4f5a6b", "namespace": "shop", "name": "web", "netns": "/var/run/netns/x"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := a.agent.LoadRecords(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- a.awaitIstioCNI(ctx) }() // owner: this test, which cancels and waits
	defer func() { cancel(); <-done }()

	poll.Until(t, "the agent stands by", a.standby.Load)
	if got, _ := os.ReadFile(conf); string(got) != both {
		t.Fatalf("withdrew our entry while istio-cni's agent does not answer:\n%s", got)
	}
	if _, err := os.Stat(rec); err != nil {
		t.Fatalf("forgot the handed-over pod while istio-cni's agent does not answer: %v", err)
	}

	ln, err := net.Listen("unix", filepath.Join(runDir, ambient.IstioCNIEventSocket))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	poll.Until(t, "our entry withdrawn", func() bool {
		got, _ := os.ReadFile(conf)
		return !strings.Contains(string(got), `"ambient-cni"`)
	})
	got, _ := os.ReadFile(conf)
	if !strings.Contains(string(got), `"istio-cni"`) {
		t.Errorf("istio-cni's entry went with ours:\n%s", got)
	}
	if _, err := os.Stat(bin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("our binary is still there: %v", err)
	}
	if _, err := os.Stat(rec); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the handed-over pod's record is still there (an uninstall would release istio-cni's pod): %v", err)
	}
	if !a.standby.Load() {
		t.Error("the agent left the standby while istio-cni holds the node")
	}
}
