//go:build realnode

package realnode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// A helm upgrade that renames the agent's DaemonSet, under traffic.
// istioCompat.names=true (docs/migrating-from-istio-cni.md sets it after
// the switch) renames the DaemonSet to istio-cni-node: helm creates it,
// then deletes ambient-cni and its RBAC, so two agents run on the node for
// a moment and the old one sees its own DaemonSet deleted. That is an
// upgrade, not an uninstall: no pod loses its rules, ztunnel gets no Del,
// the uninstall marker is never written, the plugin stays chained, and no
// connection breaks. The rename back is a `helm rollback` to the revision
// before (docs/upgrade.md's way back from a bad upgrade): the same rename
// the other way, with the old revision's values, and it leaves the node as
// the subtests after this one expect.

// renameStep is one renaming upgrade or rollback: what it does (a value
// set with --reuse-values, or "rollback" to the previous revision) and
// the DaemonSet it leaves.
type renameStep struct{ set, daemonSet string }

// rollbackStep is the renameStep that runs helm rollback.
const rollbackStep = "rollback"

// samplePause is the pause between two samples of one pod's rules or of
// the node's state.
const samplePause = 100 * time.Millisecond

func (l *life) testRenameUnderTraffic(t *testing.T) {
	t.Cleanup(func() {
		// A failed step leaves the node renamed: later subtests expect
		// the DaemonSet ambient-cni.
		if !t.Failed() {
			return
		}
		if err := l.upgradeReusing(context.Background(), "istioCompat.names=false"); err != nil {
			t.Errorf("rename back: %v", err)
		}
	})
	steps := []renameStep{
		{"istioCompat.names=true", "istio-cni-node"},
		{rollbackStep, "ambient-cni"},
	}
	for i, s := range steps {
		// The new agent's first proofs spread over the verifier's
		// period (a minute): awaited after the last step only.
		if !l.renameUnderTraffic(t, s, i == len(steps)-1) {
			return
		}
	}
}

// upgradeReusing runs helm upgrade as an operator does to change one
// value (--reuse-values --set set) and waits until the chart's one
// DaemonSet has rolled out.
func (l *life) upgradeReusing(ctx context.Context, set string) error {
	chart, err := l.n.verifiedChart(ctx, ImageTag)
	if err != nil {
		return err
	}
	if _, err := l.n.Helm(ctx, "upgrade", Release, chart, "--plain-http",
		"--namespace", ReleaseNamespace, "--reuse-values", "--set", set, "--wait", "--timeout", "5m"); err != nil {
		return err
	}
	return l.n.waitRollout(ctx)
}

// rollbackPrevious runs helm rollback to the revision before the current
// one, as docs/upgrade.md says, and waits until the chart's one DaemonSet
// has rolled out.
func (l *life) rollbackPrevious(ctx context.Context) error {
	if _, err := l.n.Helm(ctx, "rollback", Release, "--namespace", ReleaseNamespace, "--wait", "--timeout", "5m"); err != nil {
		return err
	}
	return l.n.waitRollout(ctx)
}

// renameUnderTraffic runs one renaming upgrade and checks it, and with
// prove that the new agent proves every pod without finding drift; false
// when the node is not left renamed (the next step cannot run).
func (l *life) renameUnderTraffic(t *testing.T, s renameStep, prove bool) bool {
	t.Helper()
	ctx := context.Background()
	fig := "rename-to-" + s.daemonSet
	old := l.oneAgent(t)
	pods := l.watchedPods(t)
	msgs, err := l.n.StandInMessages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	a2 := l.pod(t, "a2")
	loopRecs := len(l.records(t, a2.UID, ambient.ZtunnelOutboundPort, l.sink))
	tr := l.traffic.Counts()
	begin := time.Now()
	smp := l.sampleUninstall(pods)
	how := "helm upgrade --reuse-values --set " + s.set
	if s.set == rollbackStep {
		how = "helm rollback"
		err = l.rollbackPrevious(ctx)
	} else {
		err = l.upgradeReusing(ctx, s.set)
	}
	if err == nil {
		err = l.waitAgentOf(ctx, old.Name, s.daemonSet)
	}
	res := smp.stop()
	took := time.Since(begin)
	if err != nil {
		t.Errorf("%s: %v", how, err)
		return false
	}
	d := l.traffic.Counts().Sub(tr)
	dels := l.delsSince(t, len(msgs), pods)
	figure(t, fig+"-seconds", took.Round(100*time.Millisecond).Seconds())
	figure(t, fig+"-samples", fmt.Sprintf("%d rule samples of %d pods, %d node samples", res.ruleSamples, len(pods), res.nodeSamples))
	figure(t, fig+"-pods-seen-uncaptured", len(res.uncaptured))
	figure(t, fig+"-ztunnel-dels", len(dels))
	figure(t, fig+"-marker-seen", len(res.marker))
	figure(t, fig+"-connections-reset", d.Broken)
	figure(t, fig+"-requests-failed", d.LoopFailed)
	if res.ruleSamples < 3*len(pods) || res.nodeSamples < 3 {
		t.Errorf("%s: too few samples to tell (%d of the rules, %d of the node)", s.set, res.ruleSamples, res.nodeSamples)
	}
	report := func(what string, lines []string) {
		if len(lines) > 0 {
			t.Errorf("%s: %s at %d samples:\n%s", s.set, what, len(lines), strings.Join(firstLines(lines, 20), "\n"))
		}
	}
	report("a pod without its capture rules", res.uncaptured)
	report("a pod's rules changed", res.changed)
	report("the uninstall marker present", res.marker)
	report("the plugin unchained", res.unchained)
	report("a pod not served by the stand-in", res.unserved)
	report("a pod's address missing from the host probe set", res.unprobed)
	if len(dels) > 0 {
		t.Errorf("%s: ztunnel got %d Dels:\n%s", s.set, len(dels), strings.Join(dels, "\n"))
	}
	if _, err := os.Lstat(l.n.Layout().Uninstalling()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s: the uninstall marker %s is left behind (%v)", s.set, l.n.Layout().Uninstalling(), err)
	}
	if d.Broken > 0 || d.LoopFailed > 0 {
		t.Errorf("%s: %d held connections broke, %d requests failed: %v\n%s", s.set, d.Broken, d.LoopFailed, d.Listed(), l.n.StandInOf(context.Background(), d))
	}
	// Every request of the loop during the rename went through the
	// stand-in: none left the pod uncaptured.
	if err := l.n.Poll(ctx, "the loop's requests in the stand-in's records", func(context.Context) (bool, error) {
		got := len(l.records(t, a2.UID, ambient.ZtunnelOutboundPort, l.sink)) - loopRecs
		if got < d.LoopOK {
			return false, fmt.Errorf("the stand-in proxied %d of the %d requests a2 made to the sink", got, d.LoopOK)
		}
		return true, nil
	}); err != nil {
		t.Error(err)
	}
	// The new agent proves every pod, and finds nothing to repair.
	for _, p := range pods {
		l.mustCaptured(t, p)
		if !prove {
			continue
		}
		var drift string
		if err := l.n.Poll(ctx, p.Name+" proven by the new agent", func(ctx context.Context) (bool, error) {
			r, err := l.explainIn(ctx, p.Namespace, p.Name)
			if err != nil {
				return false, err
			}
			if r.Captured == nil || r.Captured.Verification == nil {
				return false, fmt.Errorf("explain shows no verification: %s", r.Verdict)
			}
			v := r.Captured.Verification
			if len(v.Found) > 0 || (v.LastDriftAt != nil && v.LastDriftAt.After(begin)) {
				drift = fmt.Sprintf("found %v; last drift %v at %v", v.Found, v.LastDrift, v.LastDriftAt)
				return true, nil
			}
			if !v.At.After(begin) || !v.Proven {
				return false, fmt.Errorf("last proof %+v", *v)
			}
			return true, nil
		}); err != nil {
			t.Error(err)
		}
		if drift != "" {
			t.Errorf("%s: the new agent found %s drifted: %s", s.set, p.Name, drift)
		}
	}
	// The new agent serves the plugin: a pod created now starts captured.
	name := "renamed-" + randHex(4)
	created := l.start(t, lifeNS, name, AppOptions{Hello: l.sinkURL("/hello-" + name)})
	l.mustCaptured(t, created)
	if err := l.n.Poll(ctx, name+"'s hello", func(ctx context.Context) (bool, error) {
		c, err := l.hellos(ctx, "/hello-"+name)
		return c > 0, err
	}); err != nil {
		t.Error(err)
	} else if !l.startedCaptured(t, created) {
		t.Errorf("%s: %s, created after the rename, started uncaptured", s.set, name)
	}
	return true
}

// firstLines is at most n of lines, saying how many were left out.
func firstLines(lines []string, n int) []string {
	if len(lines) <= n {
		return lines
	}
	return append(slices.Clone(lines[:n]), fmt.Sprintf("... and %d more", len(lines)-n))
}

// watchedPods returns the running ambient pods, each captured now.
func (l *life) watchedPods(t *testing.T) []*corev1.Pod {
	t.Helper()
	var pods []*corev1.Pod
	for _, p := range l.livePods(t) {
		l.mustCaptured(t, &p)
		pods = append(pods, &p)
	}
	if len(pods) < 3 {
		t.Fatalf("%d captured pods, want at least 3", len(pods))
	}
	slices.SortFunc(pods, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return pods
}

// waitAgentOf waits until the node's one agent pod is not old, belongs to
// DaemonSet ds and is Ready: the old agent is gone.
func (l *life) waitAgentOf(ctx context.Context, old, ds string) error {
	return l.n.Poll(ctx, "the agent of "+ds+" alone on the node", func(ctx context.Context) (bool, error) {
		pods, err := l.n.AgentPods(ctx)
		if err != nil || len(pods) != 1 {
			return false, fmt.Errorf("%d agent pods (%v)", len(pods), err)
		}
		p := pods[0]
		owner := ""
		if refs := p.OwnerReferences; len(refs) > 0 {
			owner = refs[0].Name
		}
		if p.Name == old || owner != ds || !isReady(&p) {
			return false, fmt.Errorf("agent %s of %q ready=%v", p.Name, owner, isReady(&p))
		}
		return true, nil
	})
}

// delsSince returns a line per Del of one of pods the stand-in received
// after its first from messages.
func (l *life) delsSince(t *testing.T, from int, pods []*corev1.Pod) []string {
	t.Helper()
	msgs, err := l.n.StandInMessages(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var dels []string
	for _, m := range msgs[min(from, len(msgs)):] {
		if m.Kind != ztunnel.KindDel {
			continue
		}
		for _, p := range pods {
			if m.UID == string(p.UID) {
				dels = append(dels, fmt.Sprintf("Del of %s (connection %d)", p.Name, m.Conn))
			}
		}
	}
	return dels
}

// uninstallSamples is what sampleUninstall saw: a line per sample that
// showed part of an uninstall.
type uninstallSamples struct {
	ruleSamples, nodeSamples int
	// uncaptured: a pod's netns without capture rules; changed: its rules
	// other than before; marker: the uninstall marker present; unchained:
	// the plugin not in the CNI config; unserved: a pod the stand-in does
	// not serve with its three listeners; unprobed: a pod's address
	// missing from the host probe set.
	uncaptured, changed, marker, unchained, unserved, unprobed []string
}

// uninstallSampler samples until stop.
type uninstallSampler struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	s      uninstallSamples
}

// sampleUninstall samples, every samplePause until stop, what an
// uninstall undoes: each pod's rules in its netns (one sampler per pod,
// compared with the rules now), and on the node the uninstall marker, the
// plugin's place in the CNI config, the stand-in's workloads and the host
// probe set.
func (l *life) sampleUninstall(pods []*corev1.Pod) *uninstallSampler {
	ctx, cancel := context.WithCancel(context.Background())
	u := &uninstallSampler{cancel: cancel}
	add := func(list *[]string, format string, a ...any) {
		u.mu.Lock()
		*list = append(*list, time.Now().Format("15:04:05.000")+" "+fmt.Sprintf(format, a...))
		u.mu.Unlock()
	}
	for _, p := range pods {
		path, err := l.n.PodNetns(ctx, p.Namespace, p.Name)
		var before []string
		if err == nil {
			var rules string
			rules, err = NetnsRules(ctx, path)
			before = normalizeRules(rules)
		}
		if err != nil {
			add(&u.s.uncaptured, "%s: %v", p.Name, err)
			continue
		}
		u.wg.Add(1)
		go func() { // owner: u; stop cancels and waits
			defer u.wg.Done()
			for pause(ctx, samplePause) {
				rules, err := NetnsRules(ctx, path)
				if ctx.Err() != nil {
					return
				}
				u.mu.Lock()
				u.s.ruleSamples++
				u.mu.Unlock()
				switch {
				case err != nil:
					add(&u.s.uncaptured, "%s: %v", p.Name, err)
				case !HasCaptureRules(rules):
					add(&u.s.uncaptured, "%s: no capture rules in its netns", p.Name)
				case !slices.Equal(normalizeRules(rules), before):
					add(&u.s.changed, "%s: rules other than before:\n%s", p.Name, rules)
				}
			}
		}()
	}
	marker := l.n.Layout().Uninstalling()
	u.wg.Add(1)
	go func() { // owner: u; stop cancels and waits
		defer u.wg.Done()
		for pause(ctx, samplePause) {
			if _, err := os.Lstat(marker); !errors.Is(err, os.ErrNotExist) {
				add(&u.s.marker, "%s present (%v)", marker, err)
			}
			if err := pluginInstalled(l.n); err != nil {
				add(&u.s.unchained, "%v", err)
			}
			wls, err := l.n.StandInWorkloads(ctx)
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				add(&u.s.unserved, "stand-in: %v", err)
			}
			members, _, err := hostProbeSet()
			if err != nil {
				add(&u.s.unprobed, "%v", err)
			}
			for _, p := range pods {
				i := slices.IndexFunc(wls, func(w ztunnel.Workload) bool { return w.UID == string(p.UID) })
				if i < 0 {
					add(&u.s.unserved, "%s: not served", p.Name)
				} else if ports := wls[i].Ports; !slices.Contains(ports, ambient.ZtunnelOutboundPort) ||
					!slices.Contains(ports, ambient.ZtunnelInboundPlaintextPort) || !slices.Contains(ports, ambient.ZtunnelInboundHBONEPort) {
					add(&u.s.unserved, "%s: listeners %v", p.Name, ports)
				}
				if err == nil && !slices.Contains(members, p.Status.PodIP) {
					add(&u.s.unprobed, "%s: %s not in %v", p.Name, p.Status.PodIP, members)
				}
			}
			u.mu.Lock()
			u.s.nodeSamples++
			u.mu.Unlock()
		}
	}()
	return u
}

// stop ends the sampling and returns what it saw.
func (u *uninstallSampler) stop() uninstallSamples {
	u.cancel()
	u.wg.Wait()
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.s
}

// pause waits d, false when ctx ends first.
func pause(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
