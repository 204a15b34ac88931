package nodeagent

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
	"github.com/ambient-cni/ambient-cni/test/testnet"
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

// TestRestoreUnresolvedKeepsPod is issue 12 item 1 at the agent: a
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
	a, err := NewAgent(Config{Rules: rules, Ztunnel: zt, Annotator: ann, HostProbe: probe, SnapshotFile: t.TempDir() + "/snap"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	ctx := context.Background()

	// Restored with its netns (10.9.0.1), without it but with IPs known
	// (10.9.0.2), and without it after a kubelet restart cleared its IPs
	// (its IP 10.9.0.3 is in the set). 10.9.0.99 belongs to a pod deleted
	// while the agent was down.
	found := markedPod("found", "u-found", "10.9.0.1")
	pn := testnet.NewNS(t)
	if err := rules.real.Apply(pn.Path(), a.ruleConfig(found)); err != nil {
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
	if err := a.RemoveSandbox(ctx, "sb-x", "u-again"); err != nil {
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
	a, err := NewAgent(Config{Rules: rules, Ztunnel: zt, Annotator: ann, HostProbe: probe, SnapshotFile: t.TempDir() + "/snap"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
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
