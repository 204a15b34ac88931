package nodeagent

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// fakeProbe is the host probe set in memory.
type fakeProbe struct {
	mu  sync.Mutex
	ips map[netip.Addr]bool
}

func (f *fakeProbe) Ensure() error { return nil }
func (f *fakeProbe) Remove() error { return nil }
func (f *fakeProbe) AddIP(ip netip.Addr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ips[ip] = true
	return nil
}
func (f *fakeProbe) DelIP(ip netip.Addr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.ips, ip)
	return nil
}
func (f *fakeProbe) IPs() ([]netip.Addr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []netip.Addr
	for ip := range f.ips {
		out = append(out, ip)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out, nil
}

func (f *fakeProbe) has(ip string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ips[netip.MustParseAddr(ip)]
}

// markedPod is a pod a previous agent captured, as the API shows it after
// a restart; ips may be empty (a kubelet restart cleared them).
func markedPod(name, uid string, ips ...string) *corev1.Pod {
	p := pod("shop", name, uid, nil)
	p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
	p.Status.Phase = corev1.PodRunning
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return p
}

// TestRestoreUnresolvedKeepsPod: at the agent, a
// captured pod whose netns is not found at restart is in the ZDS snapshot
// as Keep (no netns), its probe-set entry survives the startup sync, and
// while any such pod's IPs are unknown nothing is pruned; once the pods are
// resolved (captured again, or deleted) the deferred prune runs.
func TestRestoreUnresolvedKeepsPod(t *testing.T) {
	testnet.RequireRoot(t)
	probe := &fakeProbe{ips: map[netip.Addr]bool{}}
	for _, ip := range []string{"10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.99"} {
		_ = probe.AddIP(netip.MustParseAddr(ip))
	}
	rules, zt, ann := newRecordedRules(), &fakeZtunnel{}, &fakeAnnotator{}
	dir := t.TempDir() // the node files: never the real node's
	a, err := NewAgent(Config{Rules: rules, Ztunnel: zt, Annotator: ann, HostProbe: probe, Layout: nodefiles.InDir(dir)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close(); requireNoInvalidTransitions(t, a) })
	ctx := context.Background()

	// Restored with its netns (10.9.0.1), without it but with IPs known
	// (10.9.0.2), and without it after a kubelet restart cleared its IPs
	// (its IP 10.9.0.3 is in the set). 10.9.0.99 belongs to a pod deleted
	// while the agent was down.
	found := markedPod("found", "u-found", "10.9.0.1")
	pn := testnet.NewNS(t)
	if err := rules.seed(pn.Path(), a.ruleConfig(found)); err != nil {
		t.Fatal(err)
	}
	if err := a.Restore(ctx, found, openNS(t, pn)); err != nil {
		t.Fatal(err)
	}
	known := markedPod("known", "u-known", "10.9.0.2")
	a.RestoreUnresolved(known)
	noIPs := markedPod("noips", "u-noips")
	a.RestoreUnresolved(noIPs)
	a.RestoreUnresolved(markedPod("found", "u-found", "10.9.0.1")) // already restored: untouched
	if !a.Unresolved("u-known") || !a.Unresolved("u-noips") || a.Unresolved("u-found") {
		t.Fatalf("unresolved: known %v, noips %v, found %v", a.Unresolved("u-known"), a.Unresolved("u-noips"), a.Unresolved("u-found"))
	}

	ws := a.Workloads()
	slices.SortFunc(ws, func(x, y zds.Workload) int { return strings.Compare(x.UID, y.UID) })
	if len(ws) != 3 || ws[0].UID != "u-found" || ws[0].Netns == nil || ws[1].UID != "u-known" || ws[1].Netns != nil || ws[2].UID != "u-noips" || ws[2].Netns != nil {
		t.Fatalf("snapshot workloads: %+v, want u-found with its netns and Keep (no netns) for the two unresolved", ws)
	}

	if err := a.SyncHostProbe(); err != nil {
		t.Fatal(err)
	}
	for _, ip := range []string{"10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.99"} {
		if !probe.has(ip) {
			t.Errorf("probe set lost %s while a pod's IPs are unknown", ip)
		}
	}

	// The pod without IPs is captured again (its status got them back):
	// nothing unknown is left, so the deferred prune removes the deleted
	// pod's IP and keeps every pod's.
	pn3 := testnet.NewNS(t)
	if err := a.Capture(ctx, markedPod("noips", "u-noips", "10.9.0.3"), openNS(t, pn3), nil); err != nil {
		t.Fatal(err)
	}
	if a.Unresolved("u-noips") {
		t.Error("still unresolved after Capture")
	}
	if probe.has("10.9.0.99") {
		t.Error("the deferred prune did not run once the last unknown pod was resolved")
	}
	for _, ip := range []string{"10.9.0.1", "10.9.0.2", "10.9.0.3"} {
		if !probe.has(ip) {
			t.Errorf("probe set lost %s", ip)
		}
	}

	// The other unresolved pod is deleted: unenrolled without touching
	// rules (it has no netns), ztunnel told, its IP gone from the set.
	ops := rules.ops()
	if err := a.Unenroll(ctx, "u-known"); err != nil {
		t.Fatal(err)
	}
	if rules.ops() != ops {
		t.Errorf("rule ops for an unresolved pod: %q -> %q", ops, rules.ops())
	}
	if !slices.Contains(zt.dels, "u-known") || probe.has("10.9.0.2") || a.Unresolved("u-known") {
		t.Errorf("after unenroll: dels %v, probe has its IP %v", zt.dels, probe.has("10.9.0.2"))
	}
	// CHECK and DEL of an unresolved pod neither panic nor claim success.
	a.RestoreUnresolved(markedPod("again", "u-again", "10.9.0.4"))
	err = a.Check(ctx, PodInfo{Namespace: "shop", Name: "again", UID: "u-again"}, enablement.Decision{Enroll: true, Reason: "test"}, openNS(t, testnet.NewNS(t)))
	if err == nil {
		t.Error("CHECK of an unresolved pod passed")
	}
	if err := a.RemoveSandbox(ctx, SandboxDel{SandboxID: "sb-x", UID: "u-again"}); err != nil {
		t.Error(err)
	}
}

// TestUnresolvedPodInspectAndReleaseAll: the debug view and the uninstall
// release of a pod restored without its netns neither panic nor claim its
// rules were checked or removed.
func TestUnresolvedPodInspectAndReleaseAll(t *testing.T) {
	testnet.RequireRoot(t)
	probe := &fakeProbe{ips: map[netip.Addr]bool{}}
	rules, zt, ann := newRecordedRules(), &fakeZtunnel{}, &fakeAnnotator{}
	dir := t.TempDir() // the node files: never the real node's
	a, err := NewAgent(Config{Rules: rules, Ztunnel: zt, Annotator: ann, HostProbe: probe, Layout: nodefiles.InDir(dir)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close(); requireNoInvalidTransitions(t, a) })
	a.RestoreUnresolved(markedPod("lost", "u-lost", "10.9.0.5"))

	in, ok := a.Inspect("u-lost")
	if !ok || in.VerifyError == "" || len(in.Drift) > 0 {
		t.Errorf("Inspect of an unresolved pod: ok %v, %+v; want its rules reported unverifiable", ok, in)
	}
	ops := rules.ops()
	err = a.ReleaseAll(context.Background())
	if err == nil || !strings.Contains(err.Error(), "shop/lost") {
		t.Errorf("ReleaseAll: %v; want an error naming the pod whose rules it could not reach", err)
	}
	if rules.ops() != ops {
		t.Errorf("rule ops for an unresolved pod: %q -> %q", ops, rules.ops())
	}
	if a.get("u-lost") != nil || !slices.Contains(zt.dels, "u-lost") {
		t.Errorf("after ReleaseAll: still enrolled %v, ztunnel dels %v", a.get("u-lost") != nil, zt.dels)
	}
}

// TestRecordedPodRestoredWithoutNetns: a pod a previous agent captured and
// recorded, restored without its netns (the controller could not find
// it), takes its sandbox id and IPs from its capture record, which stays
// on disk; every way out handles the missing handle through the record:
// the DEL fast path (rules left to the namespace's destruction), a
// replayed DEL and an unenroll (our rules go from the recorded namespace),
// the uninstall release, GC; a capture whose apply fails leaves the
// previous agent's rules and the record in place; a snapshot ack or a
// debug view of it neither panics nor claims anything.
func TestRecordedPodRestoredWithoutNetns(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	names := []string{"del", "replayed", "unenroll", "release", "gc", "capture"}
	nss := map[string]string{}
	for _, n := range names {
		pn := testnet.NewNS(t)
		nss[n] = pn.Path()
		h.kube.SetPod(pod("shop", n, "u-"+n, nil))
		if _, err := h.add(ctx, info("shop/"+n, "u-"+n, "sb-"+n), pn); err != nil {
			t.Fatal(err)
		}
	}
	h.annotations(t, "u-del")
	h.restart(t)
	for _, n := range names {
		p := pod("shop", n, "u-"+n, nil) // its status lost its IPs
		p.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
		h.agent.RestoreUnresolved(p)
	}
	for _, p := range h.agent.Pods() {
		if !p.Unresolved || p.SandboxID != "sb-"+p.Name || p.Netns != nss[p.Name] ||
			!slices.Equal(p.IPs, []netip.Addr{netip.MustParseAddr("10.9.0.5")}) || p.State != StateEnabled {
			t.Errorf("restored without its netns: %+v; want the record's sandbox, netns path and IPs", p)
		}
	}
	if got := h.recorded(t); len(got) != len(names) {
		t.Fatalf("records %v: restoring without a netns must keep them", got)
	}
	for _, w := range h.agent.Workloads() {
		if w.Netns != nil {
			t.Errorf("workload %s has a netns", w.UID)
		}
		h.agent.SnapshotAcked(w.UID, nil)
	}
	if in, ok := h.agent.Inspect("u-del"); !ok || in.VerifyError == "" {
		t.Errorf("Inspect: %v %+v", ok, in)
	}
	rulesIn := func(n string) bool { return h.rules.populated(nss[n]) }

	// The DEL fast path: found by its recorded sandbox id, forgotten,
	// rules left to the namespace's destruction.
	if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: "sb-del", Netns: nss["del"]}); err != nil {
		t.Fatal(err)
	}
	if h.agent.get("u-del") != nil || !rulesIn("del") || slices.Contains(h.recorded(t), "u-del") || !slices.Contains(h.zt.dels, "u-del") {
		t.Errorf("DEL: held %v, rules %v, records %v, ztunnel dels %v", h.agent.get("u-del") != nil, rulesIn("del"), h.recorded(t), h.zt.dels)
	}
	// A replayed DEL: the runtime left the namespace; our rules go.
	if err := nodefiles.Spool(h.layout().DelSpool(), ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "sb-replayed", Netns: nss["replayed"]}); err != nil {
		t.Fatal(err)
	}
	if n, err := h.agent.DrainSpool(ctx); err != nil || n != 1 {
		t.Fatalf("DrainSpool = %d, %v", n, err)
	}
	if h.agent.get("u-replayed") != nil || rulesIn("replayed") {
		t.Errorf("replayed DEL: held %v, rules %v", h.agent.get("u-replayed") != nil, rulesIn("replayed"))
	}
	// Unenroll: rules from the recorded namespace, then annotation, then
	// record.
	if err := h.agent.Unenroll(ctx, "u-unenroll"); err != nil {
		t.Fatal(err)
	}
	if got := h.annotations(t, "u-unenroll"); got != "enabled," {
		t.Errorf("unenroll: annotation writes %q, want it cleared", got)
	}
	if h.agent.get("u-unenroll") != nil || rulesIn("unenroll") || slices.Contains(h.recorded(t), "u-unenroll") {
		t.Errorf("unenroll: held %v, rules %v, records %v", h.agent.get("u-unenroll") != nil, rulesIn("unenroll"), h.recorded(t))
	}
	// GC: its recorded sandbox is no longer the runtime's.
	if n := h.agent.GC(ctx, "", []string{"sb-release", "sb-capture"}); n != 1 || h.agent.get("u-gc") != nil {
		t.Errorf("GC removed %d, still held %v", n, h.agent.get("u-gc") != nil)
	}

	// A capture found its namespace but the apply failed: the previous
	// agent's rules and the record stay (ztunnel still serves the pod).
	capturePod := pod("shop", "capture", "u-capture", nil)
	h.rules.setApplyErr(errors.New("injected"))
	pn, err := netns.Open(nss["capture"])
	if err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Capture(ctx, capturePod, pn, nil); err == nil {
		t.Fatal("capture with a failing apply succeeded")
	}
	h.rules.setApplyErr(nil)
	if !rulesIn("capture") || !slices.Contains(h.recorded(t), "u-capture") || !h.agent.Unresolved("u-capture") {
		t.Errorf("failed capture: rules %v, records %v, unresolved %v", rulesIn("capture"), h.recorded(t), h.agent.Unresolved("u-capture"))
	}

	// The uninstall release reaches the recorded namespace; nothing is
	// left and nothing fails.
	if err := h.agent.ReleaseAll(ctx); err != nil {
		t.Errorf("ReleaseAll: %v", err)
	}
	if rulesIn("release") || rulesIn("capture") || len(h.agent.Pods()) != 0 {
		t.Errorf("after ReleaseAll: rules %v %v, held %v", rulesIn("release"), rulesIn("capture"), h.agent.Pods())
	}
}

// The ipv6 setting reaches every pod's rule options.
func TestRuleConfigIPv4Only(t *testing.T) {
	for _, v4only := range []bool{false, true} {
		a := &Agent{cfg: Config{IPv4Only: v4only}}
		if got := a.ruleConfig(&corev1.Pod{}).IPv4Only; got != v4only {
			t.Errorf("IPv4Only %v: pod options say %v", v4only, got)
		}
	}
}

// TestUnenrollOfLastUnresolvedPodRunsDeferredPrune: the probe-set prune
// deferred while a pod restored without its netns had unknown IPs runs
// once that pod is unenrolled (the controller's way for an unresolved pod
// whose sandbox is gone), as it does when a DEL or a capture resolves it:
// the IP of a pod deleted while the agent was down does not stay in the
// set.
func TestUnenrollOfLastUnresolvedPodRunsDeferredPrune(t *testing.T) {
	testnet.RequireRoot(t)
	probe := &fakeProbe{ips: map[netip.Addr]bool{}}
	_ = probe.AddIP(netip.MustParseAddr("10.9.0.99"))
	a, err := NewAgent(Config{Rules: newRecordedRules(), Ztunnel: &fakeZtunnel{}, Annotator: &fakeAnnotator{}, HostProbe: probe, Layout: nodefiles.InDir(t.TempDir())})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close(); requireNoInvalidTransitions(t, a) })
	a.RestoreUnresolved(markedPod("noips", "u-noips"))
	if err := a.SyncHostProbe(); err != nil {
		t.Fatal(err)
	}
	if !probe.has("10.9.0.99") {
		t.Fatal("pruned while a pod's IPs are unknown")
	}
	if err := a.Unenroll(context.Background(), "u-noips"); err != nil {
		t.Fatal(err)
	}
	if probe.has("10.9.0.99") {
		t.Error("the deferred prune did not run once the last unknown pod was unenrolled")
	}
}
