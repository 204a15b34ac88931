//go:build realnode

package realnode

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The switch from Istio's real istio-cni to ambient-cni and back, on the
// real node with istiod and traffic, following
// docs/migrating-from-istio-cni.md step by step, in both of istio-cni's
// rule modes. Figures are printed as "FIGURE name value" lines (the
// migration page collects them).
func TestRealNodeSwitch(t *testing.T) {
	for _, mode := range []struct {
		name string
		nft  bool
	}{{"iptables", false}, {"nativeNftables", true}} {
		t.Run(mode.name, func(t *testing.T) { testSwitch(t, mode.nft) })
	}
}

// switchMark is the nodeSelector label the migration page moves
// istio-cni's DaemonSet off the nodes with: no node has it.
const switchMark = "ambient-cni.io/istio-cni"

// preSwitch are the ambient pods running before the switch.
var preSwitch = []string{"srv", "a1", "a2"}

type switchTest struct {
	*life
	ic  *IstioCNI
	ist *Istiod
	nft bool
	// hostBefore is what of istio-cni's the host held before the node.
	hostBefore IstioHostState
}

func testSwitch(t *testing.T, nft bool) {
	ctx, out, tools := startNodeTest(t)
	if _, _, err := IstioCNIDirs(tools.Repo); err != nil {
		testnet.Missing(t, err.Error())
	}
	if _, err := IstiodDir(tools.Repo); err != nil {
		testnet.Missing(t, err.Error())
	}
	hostBefore, err := IstioHost()
	if err != nil {
		t.Fatal(err)
	}
	// Runs after Down (cleanups run last first): istio-cni's host rules,
	// which its upgrade-mode shutdown leaves, are not the node's to
	// remove.
	t.Cleanup(func() {
		for _, err := range RemoveIstioHost(hostBefore) {
			t.Errorf("istio-cni's host leftovers: %v", err)
		}
	})
	n, err := Up(ctx, Options{Out: out})
	if err != nil {
		t.Fatalf("node up: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Down(); err != nil {
			t.Errorf("down: %v", err)
		}
	})
	ist, err := n.StartIstiod(ctx, IstiodOptions{})
	if err != nil {
		t.Fatalf("istiod: %v", err)
	}
	t.Cleanup(func() { _ = ist.Stop() })
	ic, err := n.ImportIstioCNI(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.InstallIstioCNI(ctx, ic, n.IstioCNIValues(ic, nft)); err != nil {
		t.Fatalf("helm install of Istio's istio-cni: %v", err)
	}
	if err := n.StartStandIn(ctx); err != nil {
		t.Fatalf("ztunnel stand-in: %v", err)
	}
	s := &switchTest{life: &life{e2e: e2e{n: n, out: out, standIn: true}}, ic: ic, ist: ist, nft: nft, hostBefore: hostBefore}
	s.namespace(t, sinkNS, false)
	s.namespace(t, lifeNS, true)
	s.startSink(t)
	for _, name := range preSwitch {
		s.mustCaptured(t, s.startAmbient(t, name))
	}
	if rules, err := n.PodRules(ctx, lifeNS, "a1"); err == nil {
		t.Logf("istio-cni's rules in a1:\n%s", rules)
	}
	for _, name := range preSwitch {
		waitIstiod(t, n, ist, s.pod(t, name), true)
	}
	s.startTraffic(t)
	t.Cleanup(func() {
		if s.traffic != nil {
			s.traffic.Stop()
		}
	})

	if !t.Run("switch", s.testSwitchToOurs) {
		return
	}
	t.Run("rollback", s.testRollback)
	t.Run("nothing was sent off the machine", testNoEgress(n))
}

// mode names the rule mode in figures.
func (s *switchTest) mode() string {
	if s.nft {
		return "nftables"
	}
	return "iptables"
}

// ourValues are the istio-cni values an Istio user carries over to
// ambient-cni as they are (the migration page's values table).
func (s *switchTest) ourValues(t *testing.T) string {
	t.Helper()
	p, err := s.n.writeValues("istio-values-for-ours.yaml", map[string]any{
		"profile": "ambient",
		"global":  map[string]any{"nativeNftables": s.nft},
		"ambient": map[string]any{"shareHostNetworkNamespace": true, "enableAmbientDetectionRetry": true},
	})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// chainSampler records every distinct plugin chain the primary conflist
// holds, reading it every 20 ms until stop.
func (s *switchTest) chainSampler() (stop func() []string) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var seen []string
	go func() { // owner: stop, which cancels and waits
		defer close(done)
		last := ""
		for ctx.Err() == nil {
			if b, err := os.ReadFile(s.n.CNIConfFile); err == nil {
				if l, err := libcni.ConfListFromBytes(b); err == nil {
					var types []string
					for _, p := range l.Plugins {
						types = append(types, p.Network.Type)
					}
					if c := strings.Join(types, ","); c != last {
						seen = append(seen, time.Now().Format("15:04:05.000")+" "+c)
						last = c
					}
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return func() []string {
		cancel()
		<-done
		return seen
	}
}

// chainOf returns the plugin types of a sampled chain line.
func chainOf(line string) string {
	if i := strings.IndexByte(line, ' '); i >= 0 {
		return line[i+1:]
	}
	return line
}

// switchToOurs is the switch as the migration page says it.
func (s *switchTest) switchToOurs(ctx context.Context, ourValues string, marks map[string]time.Time, mu *sync.Mutex) error {
	mark := func(what string) {
		mu.Lock()
		marks[what] = time.Now()
		mu.Unlock()
	}
	// Step 2: istio-cni's DaemonSet off the node with a nodeSelector
	// (kubectl -n istio-system patch daemonset istio-cni-node -p ...).
	patch := fmt.Sprintf(`{"spec":{"template":{"spec":{"nodeSelector":{%q:"off"}}}}}`, switchMark)
	mark("patch")
	if _, err := s.n.Client.AppsV1().DaemonSets(ReleaseNamespace).Patch(ctx, IstioCNIDaemonSet, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("move istio-cni off the node: %w", err)
	}
	if err := s.n.Poll(ctx, "istio-cni's pod gone from the node", func(ctx context.Context) (bool, error) {
		pods, err := s.n.IstioCNIPods(ctx)
		if err != nil || len(pods) > 0 {
			return false, fmt.Errorf("istio-cni pods %v (%v)", pods, err)
		}
		return true, nil
	}); err != nil {
		return err
	}
	mark("istio-cni gone")
	// Step 3: ambient-cni with the istio-cni values and the takeover.
	if err := s.n.InstallAgent(ctx, "install", ImageTag, "-f", ourValues,
		"--set", "migration.fromIstioCNI.enabled=true", "--set", "migration.fromIstioCNI.runDir="+s.ic.RunDir); err != nil {
		return fmt.Errorf("helm install ambient-cni: %w", err)
	}
	mark("ours ready")
	// Step 4: every pod istio-cni captured is ours.
	if err := s.n.Poll(ctx, "the agent holds the pods istio-cni captured", func(ctx context.Context) (bool, error) {
		st, err := s.n.AgentState(ctx)
		if err != nil {
			return false, err
		}
		for _, name := range preSwitch {
			if !slices.ContainsFunc(st, func(p AgentPod) bool {
				return p.Namespace == lifeNS && p.Name == name && p.State == ambient.RedirectionEnabled
			}) {
				return false, fmt.Errorf("the agent does not hold %s yet: %+v", name, st)
			}
		}
		return true, nil
	}); err != nil {
		return err
	}
	mark("adopted")
	// Step 5: istio-cni's release goes.
	if err := s.n.UninstallIstioCNI(ctx); err != nil {
		return err
	}
	mark("istio-cni uninstalled")
	return nil
}

func (s *switchTest) testSwitchToOurs(t *testing.T) {
	ctx := context.Background()
	m := s.mode()
	tr := s.traffic.Counts()
	stopAnn := s.watchAnnotations(t)
	stopSample := s.sampleCapture()
	stopChain := s.chainSampler()
	marks := map[string]time.Time{}
	var mu sync.Mutex
	values := s.ourValues(t)
	begin := time.Now()
	pods, err := s.createDuring(t, "switch", func() error { return s.switchToOurs(ctx, values, marks, &mu) })
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	changes := stopAnn()
	d := s.traffic.Counts().Sub(tr)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"patch", "istio-cni gone", "ours ready", "adopted", "istio-cni uninstalled"} {
		t.Logf("switch step %q at +%v", w, marks[w].Sub(begin).Round(10*time.Millisecond))
	}
	figure(t, m+"-switch-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())
	figure(t, m+"-switch-istio-cni-gone-to-ours-ready-seconds", marks["ours ready"].Sub(marks["istio-cni gone"]).Round(100*time.Millisecond).Seconds())

	// The chain: istio-cni's, then ours, never both nor neither.
	t.Logf("the primary config's chains during the switch:\n%s", strings.Join(chains, "\n"))
	var order []string
	for _, c := range chains {
		types := strings.Split(chainOf(c), ",")
		last := types[len(types)-1]
		mesh := 0
		for _, ty := range types {
			if ty == "istio-cni" || ty == "ambient-cni" {
				mesh++
			}
		}
		if mesh != 1 || (last != "istio-cni" && last != "ambient-cni") {
			t.Errorf("the primary config held the chain %s: want exactly one of istio-cni and ambient-cni, last", c)
			continue
		}
		if len(order) == 0 || order[len(order)-1] != last {
			order = append(order, last)
		}
	}
	if strings.Join(order, ",") != "istio-cni,ambient-cni" {
		t.Errorf("the chain ended in %v during the switch, want istio-cni's then ours", order)
	}

	// The window: no ready ambient sandbox without capture rules.
	figure(t, m+"-switch-capture-samples", samples)
	figure(t, m+"-switch-sandboxes-sampled", sandboxes)
	figure(t, m+"-switch-window-uncaptured-samples", len(bad))
	if len(bad) > 0 {
		t.Errorf("ambient pods seen uncaptured during the switch:\n%s", strings.Join(bad, "\n"))
	}
	figure(t, m+"-switch-connections-reset", d.Broken)
	figure(t, m+"-switch-requests-failed", d.LoopFailed)
	if d.Broken > 0 {
		t.Errorf("switch: %d held connections broke: %v", d.Broken, d.Failures)
	}
	// Pods created during the switch were captured from their first
	// packet (their hello at start went through the stand-in) or waited.
	s.checkRollPods(t, m+"-switch", pods)

	// istiod saw no pod leave the mesh: the running pods' redirection
	// annotation never changed.
	for _, c := range changes {
		if f := strings.Fields(c); len(f) > 1 && slices.Contains(preSwitch, strings.TrimSuffix(f[1], ":")) {
			t.Errorf("the redirection annotation of a running pod changed during the switch: %s", c)
		}
	}

	// istio-cni's in-pod rules are replaced by ours, nothing left over:
	// each pod istio-cni captured holds exactly the rules of a pod ours
	// captured at its start.
	s.mustCaptured(t, s.startAmbient(t, "ref-ours"))
	ref := s.normalizedRules(t, "ref-ours")
	for _, name := range preSwitch {
		s.sameRules(t, name, "ref-ours", ref)
	}
	s.finalView(t)

	left, err := IstioHost()
	if err != nil {
		t.Fatal(err)
	}
	figure(t, m+"-switch-istio-cni-host-leftovers", fmt.Sprintf("%q", left.Sub(s.hostBefore).String()))
}

// emptyTableLine matches what an iptables-save dump shows of a table
// with no rule and no chain of its own: its name, its built-in chains at
// policy ACCEPT, COMMIT. Such a table is no rule; a legacy one, once any
// program looked at it in a namespace, stays registered there (istio-cni's
// nftables mode leaves the three legacy tables so).
var emptyTableLine = regexp.MustCompile(`^(\*\w+|COMMIT|:(PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) ACCEPT \[\])$`)

// normalizedRules are a pod's in-pod rules without counters and without
// the lines that say nothing but that a table exists.
func (s *switchTest) normalizedRules(t *testing.T, name string) []string {
	t.Helper()
	rules, err := s.n.PodRules(context.Background(), lifeNS, name)
	if err != nil {
		t.Fatal(err)
	}
	return slices.DeleteFunc(normalizeRules(rules), emptyTableLine.MatchString)
}

// sameRules fails unless pod name holds exactly ref (the rules of pod
// refName).
func (s *switchTest) sameRules(t *testing.T, name, refName string, ref []string) {
	t.Helper()
	got := s.normalizedRules(t, name)
	var extra, missing []string
	for _, l := range got {
		if !slices.Contains(ref, l) {
			extra = append(extra, l)
		}
	}
	for _, l := range ref {
		if !slices.Contains(got, l) {
			missing = append(missing, l)
		}
	}
	if len(extra) > 0 || len(missing) > 0 {
		t.Errorf("%s's rules differ from %s's:\nleft over:\n%s\nmissing:\n%s", name, refName, strings.Join(extra, "\n"), strings.Join(missing, "\n"))
	}
}

// finalView checks that the stand-in serves exactly the live ambient
// pods and that istiod sees every one of them as HBONE.
func (s *switchTest) finalView(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	live := s.livePods(t)
	if err := s.n.Poll(ctx, "the stand-in serves exactly the live pods", func(ctx context.Context) (bool, error) {
		err := s.standInViewIsLive(ctx, live)
		return err == nil, err
	}); err != nil {
		t.Error(err)
	}
	for _, p := range live {
		waitIstiod(t, s.n, s.ist, &p, true)
	}
}

// Rollback: ambient-cni's uninstall releases every pod, and istio-cni,
// installed again, enrolls them; nothing chains istio-cni in one write
// with our entry leaving, so the window (and the connections it resets)
// is measured, not asserted zero. The end state is asserted: every pod
// captured by istio-cni with its rules only, ztunnel holding exactly the
// live pods, istiod seeing them HBONE.
func (s *switchTest) testRollback(t *testing.T) {
	ctx := context.Background()
	m := s.mode()
	tr := s.traffic.Counts()
	stopSample := s.sampleCapture()
	stopChain := s.chainSampler()
	begin := time.Now()
	var uninstalled, reinstalled time.Time
	pods, err := s.createDuring(t, "rollback", func() error {
		if err := s.n.UninstallAgent(ctx); err != nil {
			return err
		}
		uninstalled = time.Now()
		if err := s.n.InstallIstioCNI(ctx, s.ic, s.n.IstioCNIValues(s.ic, s.nft)); err != nil {
			return err
		}
		reinstalled = time.Now()
		// istio-cni enrolls the running ambient pods again.
		return s.n.Poll(ctx, "istio-cni captured the running pods", func(ctx context.Context) (bool, error) {
			pods, err := s.n.Client.CoreV1().Pods(lifeNS).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			for _, p := range pods.Items {
				if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
					continue
				}
				if ok, err := s.n.captured(ctx, &p); !ok {
					return false, fmt.Errorf("%s: %v", p.Name, err)
				}
			}
			return true, nil
		})
	})
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	d := s.traffic.Counts().Sub(tr)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("rollback: ours uninstalled at +%v, istio-cni ready at +%v, every pod captured at +%v",
		uninstalled.Sub(begin).Round(10*time.Millisecond), reinstalled.Sub(begin).Round(10*time.Millisecond), time.Since(begin).Round(10*time.Millisecond))
	t.Logf("the primary config's chains during the rollback:\n%s", strings.Join(chains, "\n"))
	figure(t, m+"-rollback-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())
	figure(t, m+"-rollback-capture-samples", samples)
	figure(t, m+"-rollback-sandboxes-sampled", sandboxes)
	figure(t, m+"-rollback-window-uncaptured-samples", len(bad))
	window := uncapturedSpan(bad)
	figure(t, m+"-rollback-window-seconds", window.Round(100*time.Millisecond).Seconds())
	if len(bad) > 0 {
		t.Logf("ambient pods seen uncaptured during the rollback (the measured window):\n%s", strings.Join(bad, "\n"))
	}
	// Measured, not asserted: releasing a pod takes it from ztunnel,
	// which ends the connections it proxies for it.
	figure(t, m+"-rollback-connections-reset", d.Broken)
	figure(t, m+"-rollback-requests-failed", d.LoopFailed)
	if d.Broken > 0 {
		t.Logf("rollback: %d held connections broke (redialled): %v", d.Broken, d.Failures)
	}
	startedOut := 0
	var longest time.Duration
	for _, rp := range pods {
		if rp.err != nil {
			t.Errorf("%s: %v", rp.name, rp.err)
			continue
		}
		longest = max(longest, rp.waited)
		p := s.pod(t, rp.name)
		s.mustCaptured(t, p)
		if !s.startedCaptured(t, p) {
			startedOut++
		}
	}
	figure(t, m+"-rollback-pods-created", len(pods))
	figure(t, m+"-rollback-pods-started-uncaptured", startedOut)
	figure(t, m+"-rollback-longest-pod-wait-seconds", longest.Round(100*time.Millisecond).Seconds())

	// Nothing of ours left in the pods: each holds exactly the rules of a
	// pod istio-cni captured at its start.
	s.mustCaptured(t, s.startAmbient(t, "ref-istio"))
	ref := s.normalizedRules(t, "ref-istio")
	for _, name := range preSwitch {
		s.sameRules(t, name, "ref-istio", ref)
	}
	s.finalView(t)
}

// uncapturedSpan is the time from the first to the last uncaptured
// sample (each line starts with its time).
func uncapturedSpan(bad []string) time.Duration {
	var first, last time.Time
	seen := false
	for _, b := range bad {
		ts, err := time.Parse("15:04:05.000", strings.Fields(b)[0])
		if err != nil {
			continue
		}
		if !seen || ts.Before(first) {
			first = ts
		}
		if !seen || ts.After(last) {
			last = ts
		}
		seen = true
	}
	return last.Sub(first)
}
