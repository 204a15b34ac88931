package nodeagent

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

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
