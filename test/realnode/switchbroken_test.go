//go:build realnode

package realnode

import (
	"context"
	"fmt"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// unpullableDigest names an image no registry holds: the upgrade that
// breaks ambient-cni's agent.
const unpullableDigest = "sha256:" + "0000000000000000000000000000000000000000000000000000000000000000"

// testBrokenRollback: the node switched to ambient-cni, whose agent then
// breaks (an upgrade to an image that cannot be pulled: the agent left as
// in an upgrade, its entry chained, no agent of ours answering, ambient
// pods waiting). The page's rollback block gives the node back to
// istio-cni all the same: istio-cni chains itself after our entry, and
// our plugin passes every pod to it while istio-cni's agent answers. No
// pod created throughout is left waiting; the ambient ones end captured
// (by istio-cni), the others start. Mended (the page's helm rollback),
// ours stands by behind istio-cni and withdraws our entry, and the switch
// goes on as before.
func (s *switchTest) testBrokenRollback(t *testing.T) {
	ctx := context.Background()
	m := s.mode() + "-broken"
	mk := newMarker()
	if err := s.switchNode(ctx, t, mk.mark); err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	mk.mark("break")
	if err := s.page.run(ctx, t, "helm upgrade ambient-cni ./deploy/charts/ambient-cni -n istio-system --reuse-values --set image.digest="+unpullableDigest); err != nil {
		t.Fatal(err)
	}
	if err := s.n.Poll(ctx, "ambient-cni's agent broken, its entry chained", func(ctx context.Context) (bool, error) {
		pods, err := s.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		if len(pods) != 1 || isReady(&pods[0]) || !strings.Contains(podSummary(&pods[0]), "Pull") {
			var why []string
			for i := range pods {
				why = append(why, podSummary(&pods[i]))
			}
			return false, fmt.Errorf("agent pods: %v", why)
		}
		_, b, err := s.loaded()
		if err != nil || !strings.Contains(string(b), `"ambient-cni"`) {
			return false, fmt.Errorf("our entry is not chained (%v):\n%s", err, b)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	mk.mark("broken")

	tr := s.traffic.Counts()
	stopSample := s.sampleCaptureIn(lifeNS, optNS)
	stopChain := chainSampler(s.loaded)
	pods, err := s.createKindsDuring(t, s.onFirst(), podKinds, "broken", func() error {
		// An ambient pod created meanwhile waits for an agent: its
		// sandbox fails (the runtime retries) until istio-cni answers.
		if err := s.n.Poll(ctx, "an ambient pod waiting for the broken agent", func(ctx context.Context) (bool, error) {
			evs, err := s.n.Client.CoreV1().Events(lifeNS).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreatePodSandBox"})
			if err != nil {
				return false, err
			}
			for _, e := range evs.Items {
				if strings.HasPrefix(e.InvolvedObject.Name, "broken-") {
					t.Logf("waiting: %s: %s", e.InvolvedObject.Name, e.Message)
					return true, nil
				}
			}
			return false, fmt.Errorf("no ambient pod of this step failed its sandbox yet")
		}); err != nil {
			return err
		}
		mk.mark("label")
		if err := s.page.run(ctx, t, s.page.rollBlk[0]); err != nil {
			return err
		}
		if err := s.n.Poll(ctx, "istio-cni chained after our entry", func(ctx context.Context) (bool, error) {
			_, b, err := s.loaded()
			if err != nil {
				return false, err
			}
			if !strings.Contains(string(b), `"istio-cni"`) {
				return false, fmt.Errorf("the chain:\n%s", b)
			}
			return true, nil
		}); err != nil {
			return err
		}
		mk.mark("istio-cni chained")
		return s.waitRunningCaptured(ctx, "the running ambient pods captured")
	})
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	d := s.settled(t, tr)
	if err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	mk.mark("given back")
	t.Logf("the runtime's chains during the rollback from the broken agent:\n%s", strings.Join(chains, "\n"))
	mk.span(t, m+"-label-to-istio-cni-chained-seconds", "label", "istio-cni chained")
	mk.span(t, m+"-label-to-pods-captured-seconds", "label", "given back")
	figure(t, m+"-capture-samples", samples)
	figure(t, m+"-sandboxes-sampled", sandboxes)
	figure(t, m+"-window-uncaptured-samples", len(bad))
	if len(bad) > 0 {
		t.Logf("ambient pods seen uncaptured during the rollback from the broken agent:\n%s", strings.Join(bad, "\n"))
	}
	figure(t, m+"-connections-reset", d.Broken)
	figure(t, m+"-requests-failed", d.LoopFailed)
	// Every pod of every kind Ready: none left waiting for our agent, and
	// no ambient one started before istio-cni's plugin was in the chain
	// (istio-cni's agent answers before its installer chains it).
	s.checkKinds(t, s.onFirst(), podKinds, m, pods)
	s.deleteKinds(pods)

	// Mended by the page's block (the release's previous revision): the
	// agent back, standing by behind istio-cni.
	if err := s.page.run(ctx, t, s.page.rollBlk[1]); err != nil {
		t.Fatal(err)
	}
	if err := s.waitStandingBy(ctx, s.n.Name); err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	// Standing by behind istio-cni, whose agent answers, the agent
	// withdraws our entry: istio-cni's alone is left.
	if err := s.waitChain(ctx, "istio-cni", "ambient-cni"); err != nil {
		t.Errorf("after the mend: %v", err)
	}
	mk.span(t, m+"-seconds", "break", "given back")
}
