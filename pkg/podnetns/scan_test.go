package podnetns

import (
	"crypto/rand"
	"fmt"
	"net/netip"
	"testing"

	sandbox "github.com/ambient-cni/ambient-cni/test/podproc"
	"github.com/ambient-cni/ambient-cni/test/testnet"
	"github.com/containernetworking/plugins/pkg/ns"
)

func randUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// startPod starts a sandbox process for uid in a fresh netns.
func startPod(t *testing.T, uid string, d sandbox.Driver, root string) (ns.NetNS, *sandbox.Sandbox) {
	t.Helper()
	n := testnet.NewNS(t)
	sb, err := sandbox.Start(uid, n.Path(), sandbox.Options{Driver: d, Root: root})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sb.Stop)
	return n, sb
}

func TestScanFindsPodsInOnePass(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nsenter", "sleep")
	root := testnet.RandName("kubepods-test-", 8)
	a, b, hostPod, absent := randUID(), randUID(), randUID(), randUID()
	nsA, sbA := startPod(t, a, sandbox.Cgroupfs, root)
	nsB, sbB := startPod(t, b, sandbox.Systemd, root)

	// A process of a pod that lives in the host netns (hostNetwork, or a
	// leftover) must never be returned.
	hostSb, err := sandbox.Start(hostPod, "/proc/self/ns/net", sandbox.Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(hostSb.Stop)

	got, err := Scanner{}.Scan(map[string]bool{a: true, b: true, hostPod: true, absent: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("Scan found %d pods, want 2: %+v", len(got), got)
	}
	for uid, want := range map[string]struct {
		n  ns.NetNS
		sb *sandbox.Sandbox
	}{a: {nsA, sbA}, b: {nsB, sbB}} {
		f := got[uid]
		if f.PID != want.sb.Cmd.Process.Pid {
			t.Errorf("%s: pid %d, want %d", uid, f.PID, want.sb.Cmd.Process.Pid)
		}
		wantNs, err := statNetns(want.n.Path())
		if err != nil {
			t.Fatal(err)
		}
		if f.Netns != wantNs {
			t.Errorf("%s: netns %+v, want %+v", uid, f.Netns, wantNs)
		}
	}
}

func TestHoldsAnyOf(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t)
	ok, err := HoldsAnyOf(p.A.NS.Path(), []netip.Addr{p.B.V4, p.A.V6})
	if err != nil || !ok {
		t.Fatalf("HoldsAnyOf(A, [B.v4, A.v6]) = %v, %v; want true", ok, err)
	}
	ok, err = HoldsAnyOf(p.A.NS.Path(), []netip.Addr{p.B.V4, p.B.V6})
	if err != nil || ok {
		t.Fatalf("HoldsAnyOf(A, B's addrs) = %v, %v; want false", ok, err)
	}
	if _, err := HoldsAnyOf("/nonexistent/netns", nil); err == nil {
		t.Fatal("missing netns path accepted")
	}
}

// BenchmarkScan measures one /proc pass looking for 500 pods, most of
// them absent, on whatever this machine runs.
func BenchmarkScan(b *testing.B) {
	want := make(map[string]bool, 500)
	for range 500 {
		want[randUID()] = true
	}
	for b.Loop() {
		if _, err := (Scanner{}).Scan(want); err != nil {
			b.Fatal(err)
		}
	}
}
