package nodeagent

import (
	"context"
	"errors"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// enrollThree enrolls three pods, two through the CNI path and one through
// the controller.
func enrollThree(t *testing.T, h *harness) {
	t.Helper()
	ctx := context.Background()
	for _, n := range []string{"a", "b"} {
		h.kube.SetPod(pod("shop", n, "u-"+n, nil))
		if _, err := h.add(ctx, info("shop/"+n, "u-"+n, "sb-"+n), testnet.NewNS(t)); err != nil {
			t.Fatal(err)
		}
	}
	c := pod("shop", "c", "u-c", nil)
	h.kube.SetPod(c)
	if err := h.agent.Capture(ctx, c, openNS(t, testnet.NewNS(t)), nil); err != nil {
		t.Fatal(err)
	}
	if h.rules.count() != 3 {
		t.Fatalf("%d pods with rules, want 3", h.rules.count())
	}
	// The annotations are written off the capture path; an uninstall
	// releases pods once the writer has stopped, so let it finish first.
	for _, uid := range []types.UID{"u-a", "u-b", "u-c"} {
		if got := h.annotations(t, uid); got != "enabled" {
			t.Fatalf("%s annotations %q", uid, got)
		}
	}
}

// An uninstall releases every pod: annotation cleared, rules removed,
// ztunnel told, state empty.
func TestReleaseAll(t *testing.T) {
	h := newHarness(t)
	enrollThree(t, h)
	if err := h.agent.ReleaseAll(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := h.rules.count(); n != 0 {
		t.Errorf("%d pods keep their rules", n)
	}
	if n := len(h.agent.Pods()); n != 0 {
		t.Errorf("the agent still holds %d pods", n)
	}
	for _, uid := range []string{"u-a", "u-b", "u-c"} {
		if got := h.ann.history(types.UID(uid)); got != "enabled," {
			t.Errorf("%s annotations %q: want it set, then cleared", uid, got)
		}
	}
	if len(h.zt.dels) != 3 {
		t.Errorf("ztunnel got %d Dels, want 3", len(h.zt.dels))
	}
	if err := h.agent.ReleaseAll(context.Background()); err != nil {
		t.Errorf("a second release (nothing left): %v", err)
	}
}

// Without RBAC (helm deleted it before the agent stopped) the annotations
// cannot be cleared, but the rules still go: no pod stays redirected.
func TestReleaseAllWithoutRBACStillRemovesRules(t *testing.T) {
	h := newHarness(t)
	enrollThree(t, h)
	h.ann.setErr(apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "x", errors.New("no RBAC")))
	err := h.agent.ReleaseAll(context.Background())
	if err == nil || strings.Count(err.Error(), "no RBAC") != 3 {
		t.Errorf("want the three annotation errors reported, got %v", err)
	}
	if n := h.rules.count(); n != 0 {
		t.Errorf("%d pods keep their rules after a release without RBAC", n)
	}
	if n := len(h.agent.Pods()); n != 0 {
		t.Errorf("the agent still holds %d pods", n)
	}
}

// A rule removal that fails is reported; the other pods are still released.
func TestReleaseAllReportsRuleErrors(t *testing.T) {
	h := newHarness(t)
	enrollThree(t, h)
	h.rules.removeErr = errors.New("iptables-restore: boom")
	err := h.agent.ReleaseAll(context.Background())
	if err == nil || strings.Count(err.Error(), "boom") != 3 {
		t.Errorf("want three rule errors, got %v", err)
	}
	if n := len(h.agent.Pods()); n != 0 {
		t.Errorf("the agent still holds %d pods", n)
	}
}

// A pod known only by its capture record (a restart did not restore it)
// is released too: our rules go from its recorded namespace, its
// annotation is cleared and its record removed.
func TestReleaseAllReleasesRecordOnlyPods(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.FlushAnnotations(ctx); err != nil {
		t.Fatal(err)
	}
	h.restart(t) // nothing restored: known only by its record
	if !h.rules.populated(pn.Path()) || len(h.agent.Pods()) != 0 {
		t.Fatal("want the pod's rules in place and the pod not held")
	}
	if err := h.agent.ReleaseAll(ctx); err != nil {
		t.Fatal(err)
	}
	if h.rules.populated(pn.Path()) {
		t.Error("the record-only pod keeps its rules after the release")
	}
	if got := h.ann.history("u1"); got != "enabled," {
		t.Errorf("annotations %q: want it set, then cleared", got)
	}
	if got := h.recorded(t); len(got) != 0 {
		t.Errorf("records left: %v", got)
	}
}
