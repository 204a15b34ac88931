package nodeagent

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// harness is an agent with fake rules, ztunnel and annotator, the real
// pod cache over a fake API server, and the event server's decide-then-
// capture path (srv, not listening).
type harness struct {
	agent *Agent
	srv   *Server
	rules *recordedRules
	zt    *fakeZtunnel
	ann   *fakeAnnotator
	kube  *fakecluster.Cluster
	probe *fakeProbe
	dir   string
	stop  func() // stops the agent's writer and releases its handles
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	testnet.RequireRoot(t)
	h := &harness{rules: newRecordedRules(), zt: &fakeZtunnel{}, ann: &fakeAnnotator{}, probe: &fakeProbe{ips: map[netip.Addr]bool{}}, dir: t.TempDir(),
		kube: fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})}
	// Writes reach the pod objects as the agent's patch does: never to a
	// pod that is gone or replaced (a NotFound then, as from the patch).
	h.ann.onWrite = func(namespace, name string, uid types.UID, value string) {
		if err := h.kube.AnnotatePod(namespace, name, uid, ambient.RedirectionAnnotation, value); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("carry the annotator's write to the pod: %v", err)
		}
	}
	a, err := NewAgent(h.config())
	if err != nil {
		t.Fatal(err)
	}
	h.agent = a
	h.run(t)
	h.srv = NewServer(ServerConfig{Layout: h.layout()}, h.kube.Cache, a)
	h.kube.Start()
	h.kube.SetNamespace(namespace("shop", true))
	h.kube.SetNamespace(namespace("plain", false))
	return h
}

// layout is the harness agent's run directory.
func (h *harness) layout() nodefiles.Layout { return nodefiles.InDir(h.dir) }

// config is the harness agent's configuration.
func (h *harness) config() Config {
	return Config{
		Rules: h.rules, Ztunnel: h.zt, Annotator: h.ann, HostProbe: h.probe, Enablement: h.kube.Cache, Pods: h.kube.Cache,
		Layout: h.layout(),
		Netns:  netns.Policy{Roots: []string{"/var/run/netns", "/run/netns"}},
	}
}

// run runs the agent's annotation writer until the test ends, then
// releases the agent's handles and checks that no pod state transition
// was refused.
func (h *harness) run(t *testing.T) {
	t.Helper()
	a := h.agent
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = a.Run(ctx); close(done) }()
	var once sync.Once
	h.stop = func() { once.Do(func() { cancel(); <-done; _ = a.Close(); requireNoInvalidTransitions(t, a) }) }
	t.Cleanup(h.stop)
}

// restart "crashes" the agent (its handles released, nothing undone, its
// queued annotation writes lost) and starts a new one on the same node
// files, which loads the records.
func (h *harness) restart(t *testing.T) {
	t.Helper()
	h.stop()
	a, err := NewAgent(h.config())
	if err != nil {
		t.Fatal(err)
	}
	if err := a.LoadRecords(); err != nil {
		t.Fatal(err)
	}
	h.agent = a
	h.srv = NewServer(ServerConfig{Layout: h.layout()}, h.kube.Cache, a)
	h.run(t)
}

// annotations waits until the agent has no annotation write pending and
// returns the pod's write history.
func (h *harness) annotations(t *testing.T, uid types.UID) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.agent.FlushAnnotations(ctx); err != nil {
		t.Fatalf("annotation writes still pending: %v", err)
	}
	return h.ann.history(uid)
}

// recorded lists the uids with a capture record on disk.
func (h *harness) recorded(t *testing.T) []string {
	t.Helper()
	des, err := os.ReadDir(h.layout().Records())
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, de := range des {
		out = append(out, strings.TrimSuffix(de.Name(), ".json"))
	}
	return out
}

func openNS(t *testing.T, n ns.NetNS) *netns.Handle {
	t.Helper()
	h, err := netns.Open(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// add is a CNI ADD of pod p in the test's namespace n, the way the event
// server's socket handler takes it.
func (h *harness) add(ctx context.Context, p PodInfo, n ns.NetNS) (ambient.Verdict, error) {
	return h.srv.addPath(ctx, p, n.Path(), nil)
}

// check is a CNI CHECK of pod p in the test's namespace n, the way the
// event server's socket handler takes it.
func (h *harness) check(ctx context.Context, p PodInfo, n ns.NetNS) error {
	return h.srv.checkPath(ctx, p, n.Path())
}

func info(p string, uid, sandbox string) PodInfo {
	nsName, name, _ := strings.Cut(p, "/")
	return PodInfo{Namespace: nsName, Name: name, UID: types.UID(uid), SandboxID: sandbox, IPs: []netip.Addr{netip.MustParseAddr("10.9.0.5")}}
}

func TestEnrollAndRemove(t *testing.T) {
	h := newHarness(t)
	fds := testnet.OpenFDs(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))

	v, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn)
	if err != nil || v != ambient.VerdictEnrolled {
		t.Fatalf("HandleAdd = %q, %v", v, err)
	}
	want := []EnrolledPod{{UID: "u1", Namespace: "shop", Name: "web", ServiceAccount: "sa-web", SandboxID: "sb1", Netns: pn.Path(),
		IPs: []netip.Addr{netip.MustParseAddr("10.9.0.5")}, State: StateEnabled}}
	if diff := cmp.Diff(want, h.agent.Pods(), cmpopts.EquateComparable(netip.Addr{}), cmpopts.IgnoreFields(EnrolledPod{}, "NetnsID", "Rules", "Since")); diff != "" {
		t.Fatalf("state (-want +got):\n%s", diff)
	}
	if h.rules.count() != 1 || len(h.zt.adds) != 1 || h.zt.adds[0].UID != "u1" || h.zt.adds[0].Info.ServiceAccount != "sa-web" {
		t.Fatalf("rules %d, ztunnel adds %+v", h.rules.count(), h.zt.adds)
	}
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Errorf("annotations %q, want one write of enabled", got)
	}
	if got := h.recorded(t); !slices.Equal(got, []string{"u1"}) {
		t.Errorf("capture records %v, want u1's", got)
	}
	if uid, ok := h.agent.EnrolledUID("shop", "web"); !ok || uid != "u1" {
		t.Errorf("EnrolledUID = %q, %v", uid, ok)
	}
	if w := h.agent.Workloads(); len(w) != 1 || w[0].Netns == nil {
		t.Errorf("workloads = %+v", w)
	}
	// A repeated ADD for the same sandbox is idempotent.
	if v, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn); err != nil || v != ambient.VerdictEnrolled {
		t.Fatalf("second HandleAdd = %q, %v", v, err)
	}
	if len(h.agent.Pods()) != 1 {
		t.Fatalf("duplicate state after repeated ADD")
	}
	// DEL of an older sandbox of the same pod changes nothing.
	del := SandboxDel{SandboxID: "old-sandbox", UID: "u1", Namespace: "shop", Name: "web"}
	if err := h.agent.RemoveSandbox(context.Background(), del); err != nil || len(h.agent.Pods()) != 1 {
		t.Fatalf("DEL of another sandbox removed the pod (%v)", err)
	}
	// The DEL fast path: ztunnel told, state, probe set and record gone;
	// the rules are left to the namespace's destruction and the
	// annotation to the pod's; no API request.
	del.SandboxID = "sb1"
	for i := range 2 {
		if err := h.agent.RemoveSandbox(context.Background(), del); err != nil {
			t.Fatalf("DEL #%d: %v", i+1, err)
		}
	}
	if len(h.agent.Pods()) != 0 || h.zt.delLog() != "u1" {
		t.Errorf("after DEL: pods %v, dels %v", h.agent.Pods(), h.zt.delLog())
	}
	if ops := h.rules.ops(); strings.Contains(ops, "remove") {
		t.Errorf("rule ops %q: DEL must not rewrite rules in a netns being torn down", ops)
	}
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Errorf("annotations %q: DEL must not write the annotation", got)
	}
	if got := h.recorded(t); len(got) != 0 {
		t.Errorf("capture records after DEL: %v", got)
	}
	if n := testnet.OpenFDs(t); n != fds+1 { // +1: pn's own handle
		t.Errorf("open fds %d, want %d: netns handles leaked", n, fds+1)
	}
}

func TestEnrollDecisions(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("plain", "a", "u-a", nil))
	h.kube.SetPod(pod("plain", "b", "u-b", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}))
	h.kube.SetPod(pod("shop", "c", "u-c", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone}))
	for _, tc := range []struct {
		pod  string
		uid  string
		want ambient.Verdict
	}{{"plain/a", "u-a", ambient.VerdictNotEnrolled}, {"plain/b", "u-b", ambient.VerdictEnrolled}, {"shop/c", "u-c", ambient.VerdictNotEnrolled}} {
		v, err := h.add(context.Background(), info(tc.pod, tc.uid, "sb-"+tc.uid), pn)
		if err != nil || v != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.pod, v, err, tc.want)
		}
	}
	if ops := h.rules.ops(); ops != "apply" {
		t.Errorf("rule ops %q: only the pod-labelled pod gets rules", ops)
	}
	// Unknown pod, or the runtime naming another uid: retry later.
	for _, p := range []PodInfo{info("shop/ghost", "", "sb-x"), info("plain/a", "other-uid", "sb-y")} {
		if _, err := h.add(context.Background(), p, pn); !IsRetryable(err) {
			t.Errorf("%s/%s: %v, want retryable", p.Namespace, p.Name, err)
		}
	}
}

func TestEnrollFailures(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))

	h.rules.setApplyErr(errors.New("xtables lock busy"))
	_, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn)
	if !IsRetryable(err) || !strings.Contains(err.Error(), "xtables lock busy") || len(h.agent.Pods()) != 0 {
		t.Fatalf("apply failure: %v, state %v", err, h.agent.Pods())
	}
	// A failed apply leaves nothing behind: no record, no rules, no
	// annotation.
	if got := h.recorded(t); len(got) != 0 || h.rules.count() != 0 || h.annotations(t, "u1") != "" {
		t.Fatalf("after a failed apply: records %v, rules in %d namespaces, annotations %q", got, h.rules.count(), h.ann.history("u1"))
	}
	// ztunnel, handed the pod while its rules went in, forgets it again.
	if h.zt.addCount("u1") != 0 && h.zt.delLog() != "u1" {
		t.Fatalf("after a failed apply: ztunnel got %d Adds of u1 and Dels %q", h.zt.addCount("u1"), h.zt.delLog())
	}
	h.rules.setApplyErr(nil)
	h.zt.setAddErr(errors.New("no ztunnel connected"))
	_, err = h.add(context.Background(), info("shop/web", "u1", "sb1"), pn)
	if !IsRetryable(err) || !strings.Contains(err.Error(), "no ztunnel") {
		t.Fatalf("ztunnel failure: %v", err)
	}
	if p := h.agent.Pods(); len(p) != 1 || p[0].State != StatePending || !h.agent.Pending("u1") {
		t.Fatalf("state after ztunnel failure = %+v, want pending", p)
	}
	if got := h.annotations(t, "u1"); got != "pending" {
		t.Errorf("annotations %q", got)
	}
	h.zt.setAddErr(nil)
	if _, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if p := h.agent.Pods(); len(p) != 1 || p[0].State != StateEnabled || h.agent.Pending("u1") {
		t.Fatalf("state after retry = %+v", p)
	}
}

// TestHandoffOverlapsRules: a pod the agent does not hold yet is handed
// to ztunnel while its rules go in, and the ADD answers only once both
// are done.
func TestHandoffOverlapsRules(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	var sawAdd bool
	h.rules.mu.Lock()
	h.rules.onApply = func() {
		deadline := time.Now().Add(10 * time.Second)
		for h.zt.addCount("u1") == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		sawAdd = h.zt.addCount("u1") == 1
	}
	h.rules.mu.Unlock()
	if _, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatalf("add: %v", err)
	}
	if !sawAdd {
		t.Fatal("the rules' apply never saw the pod's ZDS Add: the handoff waited for the rules")
	}
	if p := h.agent.Pods(); len(p) != 1 || p[0].State != StateEnabled || h.rules.count() != 1 {
		t.Fatalf("state after the ADD = %+v, rules in %d namespaces", p, h.rules.count())
	}
}

func TestCheck(t *testing.T) {
	h := newHarness(t)
	pn, other := testnet.NewNS(t), testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	h.kube.SetPod(pod("plain", "x", "u2", nil))
	ctx := context.Background()
	if err := h.check(ctx, info("shop/web", "u1", "sb1"), pn); err == nil || !strings.Contains(err.Error(), "not enrolled") {
		t.Errorf("CHECK of an unenrolled pod that needs capture: %v", err)
	}
	if err := h.check(ctx, info("plain/x", "u2", "sb2"), pn); err != nil {
		t.Errorf("CHECK of a pod out of scope: %v", err)
	}
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	if err := h.check(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Errorf("clean CHECK: %v", err)
	}
	if err := h.check(ctx, info("shop/web", "u1", "sb1"), other); err == nil || !strings.Contains(err.Error(), "enrolled in netns") {
		t.Errorf("CHECK with another netns: %v", err)
	}
	h.rules.dropRule(t, pn.Path(), "ISTIO_OUTPUT")
	err := h.check(ctx, info("shop/web", "u1", "sb1"), pn)
	if !errors.Is(err, ErrDrift) || !strings.Contains(err.Error(), "ISTIO_OUTPUT") || IsRetryable(err) {
		t.Errorf("CHECK with drift: %v", err)
	}
}

func TestGCAndUnenroll(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for _, n := range []string{"a", "b", "c"} {
		h.kube.SetPod(pod("shop", n, "u-"+n, nil))
		if _, err := h.add(ctx, info("shop/"+n, "u-"+n, "sb-"+n), testnet.NewNS(t)); err != nil {
			t.Fatal(err)
		}
	}
	// d is enrolled by the controller (no sandbox id): GC leaves it alone.
	d := pod("shop", "d", "u-d", nil)
	h.kube.SetPod(d)
	if err := h.agent.Capture(ctx, d, openNS(t, testnet.NewNS(t)), nil); err != nil {
		t.Fatal(err)
	}
	// Wait for the annotation: written off the capture path, it would
	// otherwise coalesce with the unenroll's below.
	if got := h.annotations(t, "u-d"); got != "enabled" {
		t.Fatalf("annotations after capture: %q", got)
	}
	if n := h.agent.GC(ctx, "", []string{"sb-b"}); n != 2 {
		t.Errorf("GC removed %d, want 2", n)
	}
	var left []string
	for _, p := range h.agent.Pods() {
		left = append(left, p.Name)
	}
	if strings.Join(left, ",") != "b,d" {
		t.Errorf("after GC: %v", left)
	}
	if err := h.agent.Unenroll(ctx, "u-d"); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Unenroll(ctx, "u-unknown"); err != nil {
		t.Errorf("unenroll of an unknown uid: %v", err)
	}
	if len(h.agent.Pods()) != 1 || h.annotations(t, "u-d") != "enabled," {
		t.Errorf("after unenroll: %v, annotations %q", h.agent.Pods(), h.ann.history("u-d"))
	}
	if got := h.recorded(t); !slices.Equal(got, []string{"u-b"}) {
		t.Errorf("capture records %v, want only b's", got)
	}
}

func TestRestore(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	p := pod("shop", "web", "u1", nil)
	p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
	// A previous agent captured the pod.
	if err := h.rules.seed(pn.Path(), ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Restore(context.Background(), p, openNS(t, pn)); err != nil {
		t.Fatal(err)
	}
	if ops := h.rules.ops(); ops != "verify" || len(h.zt.adds) != 0 {
		t.Errorf("restore without drift: rule ops %q, ztunnel adds %d", ops, len(h.zt.adds))
	}
	h.rules.dropRule(t, pn.Path(), "ISTIO_OUTPUT")
	if err := h.agent.Restore(context.Background(), p, openNS(t, pn)); err != nil {
		t.Fatal(err)
	}
	if ops := h.rules.ops(); ops != "verify,verify,apply" {
		t.Errorf("restore with drift: rule ops %q", ops)
	}
	if ps := h.agent.Pods(); len(ps) != 1 || ps[0].State != StateEnabled {
		t.Errorf("state %+v", ps)
	}
	// Never the host's own namespace: no handle can be had for it.
	if ns, err := netns.Open("/proc/self/ns/net"); err == nil || !strings.Contains(err.Error(), "host network namespace") {
		_ = ns.Close()
		t.Errorf("a handle on the host netns: %v", err)
	}
}

func TestDrainSpool(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), testnet.NewNS(t)); err != nil {
		t.Fatal(err)
	}
	spool := h.layout().DelSpool()
	if err := nodefiles.Spool(spool, ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "sb1"}); err != nil {
		t.Fatal(err)
	}
	if err := nodefiles.Spool(spool, ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "sb-unknown", PodUID: "u9"}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(spool, "junk.json"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	n, err := h.agent.DrainSpool(ctx)
	if err != nil || n != 2 {
		t.Fatalf("DrainSpool = %d, %v", n, err)
	}
	if len(h.agent.Pods()) != 0 {
		t.Errorf("spooled DEL not applied: %v", h.agent.Pods())
	}
	if des, _ := os.ReadDir(spool); len(des) != 0 {
		t.Errorf("spool not emptied: %v", des)
	}
}

func TestSnapshotFollowsEnablement(t *testing.T) {
	h := newHarness(t)
	h.kube.Cache.OnEnablementChange(func() { _ = h.agent.RefreshSnapshot() })
	path := h.layout().Snapshot()
	read := func() *nodefiles.EnablementSnapshot {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		s, err := nodefiles.ParseSnapshot(b)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	// The first refresh (install-cni makes it once the cache is synced)
	// writes the first snapshot.
	if err := h.agent.RefreshSnapshot(); err != nil {
		t.Fatal(err)
	}
	s := read()
	ignoreWritten := cmpopts.IgnoreFields(nodefiles.EnablementSnapshot{}, "Written")
	want := &nodefiles.EnablementSnapshot{Generation: 1, EnabledNamespaces: []string{"shop"}, ExcludedNamespaces: []string{"kube-system"},
		Namespaces: []string{"plain", "shop"}}
	if diff := cmp.Diff(want, s, ignoreWritten); diff != "" {
		t.Fatalf("first snapshot (-want +got):\n%s", diff)
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Errorf("snapshot mode %v", st.Mode())
	}
	if err := h.agent.RefreshSnapshot(); err != nil || read().Generation != 1 {
		t.Errorf("unchanged content rewrote the snapshot (%v)", err)
	}
	// Changes reach the snapshot through the cache's notifications.
	h.kube.SetNamespace(namespace("blog", true))
	poll.Until(t, "blog in the snapshot", func() bool { return strings.Join(read().EnabledNamespaces, ",") == "blog,shop" })
	h.kube.SetPod(pod("plain", "solo", "u5", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}))
	poll.Until(t, "pod-level enablement in the snapshot", func() bool { return read().PodLevelEnablement })
	want = &nodefiles.EnablementSnapshot{Generation: 3, EnabledNamespaces: []string{"blog", "shop"}, PodLevelEnablement: true, ExcludedNamespaces: []string{"kube-system"},
		Namespaces: []string{"blog", "plain", "shop"}, Pods: map[string]bool{"u5": true}}
	if diff := cmp.Diff(want, read(), ignoreWritten); diff != "" {
		t.Errorf("snapshot after changes (-want +got):\n%s", diff)
	}
	// A new writer (agent restart) continues the generation.
	w := newSnapshotWriter(path, "")
	if wrote, err := w.Update(nil, false, nil, nil, nil); err != nil || !wrote || read().Generation != 4 {
		t.Errorf("restarted writer: %v %v gen %d", wrote, err, read().Generation)
	}
	var raw map[string]any
	b, _ := os.ReadFile(path)
	if err := json.Unmarshal(b, &raw); err != nil || raw["enabledNamespaces"] == nil {
		t.Errorf("empty lists must be written as [], got %s", b)
	}
	if leftovers, _ := filepath.Glob(filepath.Join(h.dir, ".*tmp")); len(leftovers) != 0 {
		t.Errorf("temp files left: %v", leftovers)
	}
}

func TestEnrollCyclesLeakNothing(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	ctx := context.Background()
	fds := testnet.OpenFDs(t)
	for i := range 200 {
		sb := "sb" + string(rune('a'+i%26))
		if _, err := h.add(ctx, info("shop/web", "u1", sb), pn); err != nil {
			t.Fatal(err)
		}
		if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: sb}); err != nil {
			t.Fatal(err)
		}
	}
	if n := testnet.OpenFDs(t); n != fds {
		t.Errorf("open fds %d after 200 add/del cycles, want %d", n, fds)
	}
	if sz := h.agent.TableSizes(); sz["locks"] != 0 || sz["lives"] > 1 {
		t.Errorf("per-pod locks left: %d, lives %d (want at most the one pod's)", sz["locks"], sz["lives"])
	}
	if got := h.recorded(t); len(got) != 0 {
		t.Errorf("capture records left: %v", got)
	}
}

// TestHeldNetnsDoesNotPinMount: the runtime must be able to unmount a
// pod's netns path (even without MNT_DETACH) while the agent still holds
// the pod, and the agent can still clean up through its own handle.
func TestHeldNetnsDoesNotPinMount(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	if _, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	_ = pn.Close() // the test's own handle was opened through the mount
	if err := unix.Unmount(pn.Path(), 0); err != nil {
		t.Fatalf("unmount the netns path while enrolled: %v", err)
	}
	if err := os.Remove(pn.Path()); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Unenroll(context.Background(), "u1"); err != nil || len(h.agent.Pods()) != 0 {
		t.Fatalf("unenroll after the netns path is gone: %v", err)
	}
	if ops := h.rules.ops(); ops != "apply,remove" || h.rules.count() != 0 {
		t.Errorf("rule ops %q, left %d: removal must work through the held handle", ops, h.rules.count())
	}
}

// TestSandboxReleased: a CNI DEL of a captured pod's sandbox is
// remembered (the controller then leaves the terminating pod alone), and
// forgotten once a sandbox of the pod is captured again; a DEL of a
// sandbox the agent never captured is not.
func TestSandboxReleased(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	if h.agent.SandboxReleased("u1") {
		t.Fatal("released before any DEL")
	}
	if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: "other", UID: "u2"}); err != nil || h.agent.SandboxReleased("u2") {
		t.Fatalf("DEL of an unknown sandbox remembered (%v)", err)
	}
	if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: "sb1", UID: "u1"}); err != nil || !h.agent.SandboxReleased("u1") {
		t.Fatalf("DEL of the captured sandbox not remembered (%v)", err)
	}
	// With the sandbox's IPs: a pod showing others runs a new sandbox.
	if at, ips, ok := h.agent.ReleasedSandbox("u1"); !ok || at.IsZero() || !slices.Equal(ips, info("shop/web", "u1", "sb1").IPs) {
		t.Fatalf("ReleasedSandbox = %v, %v, %v; want the DEL's time and the sandbox's IPs", at, ips, ok)
	}
	if _, err := h.add(ctx, info("shop/web", "u1", "sb2"), pn); err != nil {
		t.Fatal(err)
	}
	if h.agent.SandboxReleased("u1") {
		t.Fatal("still released after a new sandbox was captured")
	}
}

// TestSandboxReleasedAfterObjectGone: a DEL that comes after the pod's
// object is gone (PodGone has run) leaves no mark, which would otherwise
// stay for releasedTTL; PodGone drops a mark made before it.
func TestSandboxReleasedAfterObjectGone(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for _, c := range []struct {
		name, uid string
	}{{"late-del", "u1"}, {"early-del", "u2"}} {
		pn := testnet.NewNS(t)
		h.kube.SetPod(pod("shop", c.name, c.uid, nil))
		if _, err := h.add(ctx, info("shop/"+c.name, c.uid, "sb-"+c.uid), pn); err != nil {
			t.Fatal(err)
		}
		uid := types.UID(c.uid)
		if c.name == "late-del" {
			h.kube.DeletePod("shop", c.name)
			h.agent.PodGone(uid)
		}
		if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: "sb-" + c.uid, UID: uid, Namespace: "shop", Name: c.name}); err != nil {
			t.Fatal(err)
		}
		if c.name == "early-del" {
			if !h.agent.SandboxReleased(uid) {
				t.Fatal("DEL of a pod whose object still exists not remembered")
			}
			h.kube.DeletePod("shop", c.name)
			h.agent.PodGone(uid)
		}
		if h.agent.SandboxReleased(uid) {
			t.Errorf("%s: a mark is left for a pod whose object is gone", c.name)
		}
	}
}

// TestNodeFilesHaveNoDefaults: an agent configured without its node files
// is refused, rather than given the real node's directory (where a test
// that forgot one would write over the running agent's records).
func TestNodeFilesHaveNoDefaults(t *testing.T) {
	full := Config{Rules: &recordedRules{}, Layout: nodefiles.InDir(t.TempDir())}
	if a, err := NewAgent(full); err != nil {
		t.Fatalf("complete config refused: %v", err)
	} else {
		_ = a.Close()
	}
	c := full
	c.Layout = nodefiles.Layout{}
	if _, err := NewAgent(c); err == nil || !strings.Contains(err.Error(), "Layout") {
		t.Errorf("no Layout: %v; want an error naming it", err)
	}
	if err := NewServer(ServerConfig{}, nil, nil).Listen(); err == nil {
		t.Error("an event server with no socket listened (on the real node's path?)")
	}
}
