//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// The node's CNI STATUS from boot (docs/reliability.md "CNI STATUS from
// boot"): containerd's NetworkReady, what kubelet reads every 5 s, is
// false from the boot until the agent is first ready, and stays true
// across agent restarts on the same boot.

// gateSample is one look, every second, at containerd's NetworkReady (a
// CNI STATUS call made now) between two looks at the agent's boot-ready
// marker, and at the node's Ready condition.
type gateSample struct {
	at                        time.Time
	markedBefore, markedAfter bool
	ready                     bool
	msg                       string
	nodeReady                 corev1.ConditionStatus
	err                       error
}

// sampleNetworkReady samples every second until stop, which returns the
// samples.
func (e *e2e) sampleNetworkReady() (stop func() []gateSample) {
	ctx, cancel := context.WithCancel(context.Background())
	var (
		mu      sync.Mutex
		samples []gateSample
		wg      sync.WaitGroup
	)
	marker := e.n.Layout().BootReady()
	marked := func() bool { _, err := os.Lstat(marker); return err == nil }
	wg.Go(func() { // owner: stop, which cancels and waits
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for ctx.Err() == nil {
			s := gateSample{at: time.Now(), markedBefore: marked()}
			s.ready, s.msg, s.err = e.runtimeNetwork(ctx)
			s.markedAfter = marked()
			if c, err := e.nodeReady(ctx); err == nil {
				s.nodeReady = c.Status
			}
			mu.Lock()
			samples = append(samples, s)
			mu.Unlock()
			select {
			case <-ctx.Done():
			case <-t.C:
			}
		}
	})
	return func() []gateSample {
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return samples
	}
}

// checkBootGate: every answer containerd gave while the agent had not
// marked the boot ready (before and after the look) was "network not
// ready", naming our plugin; there was at least one; and no sandbox of an
// ambient pod was created between the reboot (at down) and the marker.
func (l *life) checkBootGate(t *testing.T, down time.Time, samples []gateSample) {
	t.Helper()
	ctx := context.Background()
	st, err := os.Stat(l.n.Layout().BootReady())
	if err != nil {
		t.Fatalf("the agent is back and ready, but its boot-ready marker: %v", err)
	}
	// The hold is bounded (statusBootHold, 1m by default) from its start.
	hs, err := os.Stat(l.n.Layout().BootHeld())
	if err != nil {
		t.Fatalf("no record of the hold's start: %v", err)
	}
	holdEnds := hs.ModTime().Add(ambient.DefaultStatusBootHold)
	figure(t, "reboot-agent-ready-after-hold-began-seconds", st.ModTime().Sub(hs.ModTime()).Round(100*time.Millisecond).Seconds())
	if st.ModTime().After(holdEnds) {
		t.Logf("the agent was ready only after the hold ended (%s): the node was let go before", holdEnds.Format("15:04:05.000"))
	}
	held, answered := 0, 0
	var first time.Time
	for _, s := range samples {
		if s.err != nil {
			continue // containerd not answering yet
		}
		answered++
		if first.IsZero() {
			first = s.at
		}
		if s.markedBefore || s.markedAfter || !s.at.Before(holdEnds.Add(-time.Second)) {
			continue
		}
		held++
		if s.ready || !strings.Contains(s.msg, "ambient-cni") {
			t.Errorf("%s: the agent not yet ready since the boot, containerd's network ready %v (%s)", s.at.Format("15:04:05.000"), s.ready, s.msg)
		}
	}
	figure(t, "reboot-network-samples", answered)
	figure(t, "reboot-network-held-samples", held)
	if held == 0 {
		t.Errorf("no sample of containerd's network before the agent was ready (of %d answered): the hold from boot was not seen", answered)
	}
	if !first.IsZero() {
		figure(t, "reboot-network-not-ready-seconds", st.ModTime().Sub(first).Round(100*time.Millisecond).Seconds())
	}
	notReady := slices.ContainsFunc(samples, func(s gateSample) bool { return s.nodeReady == corev1.ConditionFalse })
	figure(t, "reboot-node-seen-notready", notReady)

	out, err := l.n.crictl(ctx, "pods", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Items []struct {
			ID        string
			CreatedAt string
			Metadata  struct{ Name, Namespace string }
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, it := range list.Items {
		if it.Metadata.Namespace != lifeNS {
			continue
		}
		ns, err := strconv.ParseInt(it.CreatedAt, 10, 64)
		if err != nil {
			t.Errorf("sandbox %s: createdAt %q: %v", it.ID, it.CreatedAt, err)
			continue
		}
		created := time.Unix(0, ns)
		if created.Before(down) {
			continue // the sandbox before the reboot, in containerd's database on disk
		}
		checked++
		if created.Before(st.ModTime()) && created.Before(holdEnds) {
			t.Errorf("sandbox %s of %s/%s created at %s, before the agent was ready (%s)", it.ID, it.Metadata.Namespace, it.Metadata.Name,
				created.Format("15:04:05.000"), st.ModTime().Format("15:04:05.000"))
		}
	}
	figure(t, "reboot-sandboxes-after-ready", checked)
	// The agent's own measure of its start to the stand-in's first
	// acknowledged snapshot, on this boot.
	if err := l.n.Poll(ctx, "the agent's time to its first ztunnel", func(context.Context) (bool, error) {
		return l.metric(t, "ambient_cni_start_to_ztunnel_seconds_count") == 1, nil
	}); err != nil {
		t.Error(err)
	} else {
		figure(t, "reboot-agent-start-to-ztunnel-seconds", l.metric(t, "ambient_cni_start_to_ztunnel_seconds_sum"))
	}
	if err := l.n.Poll(ctx, "containerd's network ready once the agent is", func(ctx context.Context) (bool, error) {
		ready, msg, err := l.runtimeNetwork(ctx)
		if err == nil && !ready {
			err = fmt.Errorf("not ready: %s", msg)
		}
		return err == nil, err
	}); err != nil {
		t.Error(err)
	}
}

// testNodeReadyAcrossAgentRestarts: the agent's pod deleted (a restart)
// three times, then a helm upgrade that rolls it, on the boot it was
// ready on: sampled every second, containerd's network stays ready and
// the node Ready throughout.
func (l *life) testNodeReadyAcrossAgentRestarts(t *testing.T) {
	ctx := context.Background()
	if err := l.n.Poll(ctx, "the node Ready before the restarts", func(ctx context.Context) (bool, error) {
		c, err := l.nodeReady(ctx)
		return err == nil && c.Status == corev1.ConditionTrue, err
	}); err != nil {
		t.Fatal(err)
	}
	stop := l.sampleNetworkReady()
	const restarts = 3
	for i := range restarts {
		agents, err := l.n.AgentPods(ctx)
		if err != nil || len(agents) != 1 {
			stop()
			t.Fatalf("restart %d: agent pods %d, %v", i+1, len(agents), err)
		}
		old := agents[0].Name
		if err := l.n.Client.CoreV1().Pods(ReleaseNamespace).Delete(ctx, old, metav1.DeleteOptions{}); err != nil {
			stop()
			t.Fatal(err)
		}
		if err := l.waitNewAgentReady(ctx, old); err != nil {
			stop()
			t.Fatalf("restart %d: %v", i+1, err)
		}
	}
	if err := l.n.InstallAgent(ctx, "upgrade", ImageTag, "--set", "podAnnotations.ambient-cni-test/roll=boot-gate"); err != nil {
		stop()
		t.Fatal(err)
	}
	samples := stop()
	bad := 0
	for _, s := range samples {
		if s.err == nil && !s.ready || s.nodeReady != "" && s.nodeReady != corev1.ConditionTrue {
			bad++
			t.Errorf("%s: containerd's network ready %v (%s, %v), node Ready %q", s.at.Format("15:04:05.000"), s.ready, s.msg, s.err, s.nodeReady)
		}
	}
	figure(t, "agent-restarts-network-samples", len(samples))
	figure(t, "agent-restarts-not-ready-samples", bad)
	// The shipped values again, for the subtests after this one.
	if err := l.n.InstallAgent(ctx, "upgrade", ImageTag); err != nil {
		t.Fatal(err)
	}
}

// waitNewAgentReady waits for an agent pod other than old, Ready.
func (l *life) waitNewAgentReady(ctx context.Context, old string) error {
	return l.n.Poll(ctx, "a new agent ready", func(ctx context.Context) (bool, error) {
		pods, err := l.n.AgentPods(ctx)
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if p.Name != old && p.DeletionTimestamp == nil && isReady(&p) {
				return true, nil
			}
		}
		return false, fmt.Errorf("no new ready agent pod among %d", len(pods))
	})
}
