package nodeagent

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The verifier's accessors: InPod reaches the held namespace (not an
// unknown pod's); Recapture captures the pod again there (rules, ztunnel,
// a changed annotation written again), telling ztunnel to drop it first
// when asked.
func TestInPodAndRecapture(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	ctx := context.Background()
	if err := h.agent.InPod("u1", func(*os.File) error { return nil }); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("InPod of an unknown pod: %v", err)
	}
	p, _ := h.kube.Cache.Pod("shop", "web")
	if err := h.agent.Recapture(ctx, p, false); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("Recapture of an unknown pod: %v", err)
	}
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	if got := h.annotations(t, "u1"); got != ambient.RedirectionEnabled {
		t.Fatalf("annotations %q", got)
	}
	var seen bool
	if err := h.agent.InPod("u1", func(f *os.File) error { seen = f != nil; return nil }); err != nil || !seen {
		t.Fatalf("InPod: %v (file %v)", err, seen)
	}

	// Drift behind the agent's back: a rule dropped, the annotation changed.
	h.rules.dropRule(t, pn.Path(), "ISTIO_OUTPUT")
	changed := p.DeepCopy()
	changed.Annotations = map[string]string{ambient.RedirectionAnnotation: "disabled"}
	h.kube.SetPod(changed)
	poll.Until(t, "the changed annotation in the pod cache", func() bool {
		c, err := h.kube.Cache.Pod("shop", "web")
		return err == nil && c.Annotations[ambient.RedirectionAnnotation] == "disabled"
	})
	adds := h.zt.addCount("u1")
	if err := h.agent.Recapture(ctx, changed, true); err != nil {
		t.Fatal(err)
	}
	if in, _ := h.agent.Inspect("u1"); len(in.Drift) > 0 || in.VerifyError != "" {
		t.Fatalf("after Recapture: %+v", in)
	}
	if h.zt.delLog() != "u1" || h.zt.addCount("u1") != adds+1 {
		t.Fatalf("ztunnel: dels %q, adds %d -> %d; want a Del, then an Add", h.zt.delLog(), adds, h.zt.addCount("u1"))
	}
	if got := h.annotations(t, "u1"); !strings.HasSuffix(got, ambient.RedirectionEnabled+","+ambient.RedirectionEnabled) {
		t.Fatalf("the changed annotation was not written again: history %q", got)
	}
}

// TestRecaptureAfterHoldChanged: Recapture copies the namespace the agent
// holds the pod in and lets go of the pod's lock before capturing. If
// meanwhile the pod moved on, the copy is all that keeps the old namespace
// alive, and capturing in it would hand ztunnel a namespace no pod lives
// in (every connection of the pod blackholed until the next proof), or
// re-enroll a pod the controller just let go. Recapture must then do
// nothing: no ztunnel Add, the agent's hold as the other path left it.
func TestRecaptureAfterHoldChanged(t *testing.T) {
	for _, c := range []struct {
		name string
		// gap runs in Recapture's gap: old is the namespace the agent
		// held the pod in, and it returns the namespace the agent must
		// hold the pod in afterwards (nil: none).
		gap func(t *testing.T, h *harness, old ns.NetNS) ns.NetNS
	}{
		{"sandbox recreated without our plugin", func(t *testing.T, h *harness, old ns.NetNS) ns.NetNS {
			// The runtime recreated the sandbox while our plugin was
			// not chained (no DEL, no ADD reached the agent); the
			// controller found the new namespace and captured it, and
			// the old one is torn down.
			next := testnet.NewNS(t)
			p, err := h.kube.Cache.Pod("shop", "web")
			if err != nil {
				t.Fatal(err)
			}
			if err := h.agent.Capture(context.Background(), p, openNS(t, next), nil); err != nil {
				t.Fatalf("capture in the new sandbox's netns: %v", err)
			}
			if err := testnet.RemoveNS(old); err != nil {
				t.Fatal(err)
			}
			return next
		}},
		{"unenrolled", func(t *testing.T, h *harness, old ns.NetNS) ns.NetNS {
			if err := h.agent.Unenroll(context.Background(), "u1"); err != nil {
				t.Fatalf("unenroll: %v", err)
			}
			if err := testnet.RemoveNS(old); err != nil {
				t.Fatal(err)
			}
			return nil
		}},
		{"CNI DEL", func(t *testing.T, h *harness, old ns.NetNS) ns.NetNS {
			del := SandboxDel{SandboxID: "sb1", UID: "u1", Namespace: "shop", Name: "web", Netns: old.Path()}
			if err := h.agent.RemoveSandbox(context.Background(), del); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if err := testnet.RemoveNS(old); err != nil {
				t.Fatal(err)
			}
			return nil
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			pn := testnet.NewNS(t)
			h.kube.SetPod(pod("shop", "web", "u1", nil))
			ctx := context.Background()
			if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
				t.Fatal(err)
			}
			p, _ := h.kube.Cache.Pod("shop", "web")
			var want ns.NetNS
			addsAfterGap := -1
			h.agent.recaptureGap = func(uid types.UID) {
				want = c.gap(t, h, pn)
				addsAfterGap = h.zt.addCount("u1")
			}
			err := h.agent.Recapture(ctx, p, true)
			if addsAfterGap < 0 {
				t.Fatal("Recapture never reached its gap")
			}
			if n := h.zt.addCount("u1"); n != addsAfterGap {
				t.Errorf("ztunnel got %d Add(s) from Recapture after the pod moved on; want none", n-addsAfterGap)
			}
			if !errors.Is(err, ErrNotHeld) {
				t.Errorf("Recapture = %v; want ErrNotHeld", err)
			}
			got, held := h.agent.Pod("u1")
			switch {
			case want == nil && held:
				t.Errorf("the agent holds the pod again, in netns %s (inode %d); want it let go", got.Netns, got.NetnsID)
			case want != nil && !held:
				t.Errorf("the agent lost the pod; want it held in %s", want.Path())
			case want != nil && got.Netns != want.Path():
				t.Errorf("the agent holds the pod in %s (inode %d); want %s", got.Netns, got.NetnsID, want.Path())
			}
			// An unenroll drops the record once the annotation is cleared.
			h.annotations(t, "u1")
			if recs := h.recorded(t); want == nil && len(recs) != 0 {
				t.Errorf("capture records %v; want none", recs)
			}
		})
	}
}

// A repair while the pod's status lags its sandbox (the new sandbox's ADD
// came, kubelet's status update did not: an ordinary recreation, or an
// API-server outage that froze the status) re-captures the pod with the
// IPs of the namespace the agent holds, which the ADD gave: the status's
// stale IPs neither replace them in the agent's state nor take the pod's
// entry out of the host probe set.
func TestRecaptureKeepsTheHeldSandboxIPs(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	ctx := context.Background()
	stale := pod("shop", "web", "u1", nil)
	stale.Status.PodIPs = []corev1.PodIP{{IP: "10.9.0.5"}} // the old sandbox's
	h.kube.SetPod(stale)
	poll.Until(t, "the pod in the cache", func() bool {
		_, err := h.kube.Cache.Pod("shop", "web")
		return err == nil
	})
	add := info("shop/web", "u1", "sb2")
	add.IPs = []netip.Addr{netip.MustParseAddr("10.9.0.7")} // the new sandbox's
	if _, err := h.add(ctx, add, pn); err != nil {
		t.Fatal(err)
	}
	if !h.probe.has("10.9.0.7") {
		t.Fatal("the ADD's IP is not in the probe set")
	}
	p, _ := h.kube.Cache.Pod("shop", "web")
	if err := h.agent.Recapture(ctx, p, true); err != nil {
		t.Fatal(err)
	}
	e, _ := h.agent.Pod("u1")
	if !h.probe.has("10.9.0.7") || !slices.Equal(e.IPs, add.IPs) {
		t.Fatalf("after a repair with the stale status: probe set has 10.9.0.7 %v (10.9.0.5 %v), the agent holds IPs %v; want the ADD's %v",
			h.probe.has("10.9.0.7"), h.probe.has("10.9.0.5"), e.IPs, add.IPs)
	}
}

// A repair that cannot complete leaves the pod exactly as it was: its
// rules apply fails, and ztunnel still serves the pod (it was not told to
// drop it first, as a repair of lost listeners asks), the probe set still
// has its IP, its annotation and its state are unchanged.
func TestFailedRecaptureLeavesThePodAsItWas(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	ctx := context.Background()
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	before := h.annotations(t, "u1")
	was, _ := h.agent.Pod("u1")
	p, _ := h.kube.Cache.Pod("shop", "web")
	h.rules.setApplyErr(errors.New("xtables lock held"))
	if err := h.agent.Recapture(ctx, p, true); err == nil {
		t.Fatal("Recapture succeeded with the rules failing")
	}
	h.rules.setApplyErr(nil)
	if dels := h.zt.delLog(); dels != "" {
		t.Errorf("ztunnel was told to drop the pod (%q) by a repair that failed", dels)
	}
	if !h.probe.has("10.9.0.5") {
		t.Error("the probe set lost the pod's IP")
	}
	if got := h.annotations(t, "u1"); got != before {
		t.Errorf("annotation writes %q, want %q as before", got, before)
	}
	now, ok := h.agent.Pod("u1")
	if !ok || now.State != was.State || now.NetnsID != was.NetnsID || !slices.Equal(now.IPs, was.IPs) {
		t.Errorf("the agent holds %+v (%v), want %+v", now, ok, was)
	}
	if in, _ := h.agent.Inspect("u1"); len(in.Drift) > 0 || in.VerifyError != "" {
		t.Errorf("rules after the failed repair: %+v", in)
	}
}
