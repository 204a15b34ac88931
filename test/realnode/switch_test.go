//go:build realnode

package realnode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/kubectlplugin"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The switch from Istio's real istio-cni to ambient-cni and back, on the
// real node with istiod and traffic, following
// docs/migrating-from-istio-cni.md step by step, in both of istio-cni's
// rule modes. Figures are printed as "FIGURE name value" lines (the
// migration page collects them).
func TestRealNodeSwitch(t *testing.T) {
	for _, mode := range []struct {
		name       string
		nft, owned bool
	}{
		{"iptables", false, false},
		{"nativeNftables", true, false},
		// istio-cni's istioOwnedCNIConfig (Istio's own answer to the
		// reboot race): the runtime loads istio-cni's copy of the
		// primary's config, which the takeover must not keep.
		{"istioOwnedCNIConfig", false, true},
	} {
		t.Run(mode.name, func(t *testing.T) { testSwitch(t, mode.nft, mode.owned) })
	}
}

// preSwitch are the ambient pods running before the switch.
var preSwitch = []string{"srv", "a1", "a2"}

type switchTest struct {
	*life
	ic  *IstioCNI
	ist *Istiod
	nft bool
	// owned: istio-cni runs with istioOwnedCNIConfig.
	owned bool
	// hostBefore is what of istio-cni's the host held before the node.
	hostBefore IstioHostState
	// page runs the migration page's blocks.
	page *pageRunner
}

func testSwitch(t *testing.T, nft, owned bool) {
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
	n, err := Up(ctx, Options{Out: out, Images: testImages})
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
	values := n.IstioCNIValues(ic, nft)
	if owned {
		values["istioOwnedCNIConfig"] = true
	}
	if err := n.InstallIstioCNI(ctx, ic, values); err != nil {
		t.Fatalf("helm install of Istio's istio-cni: %v", err)
	}
	if owned {
		if err := n.Poll(ctx, "istio-cni's own conflist is the runtime's choice", func(context.Context) (bool, error) {
			p, err := runtimeConf(n)
			return filepath.Base(p) == istioOwnedConfName, err
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.StartStandIn(ctx); err != nil {
		t.Fatalf("ztunnel stand-in: %v", err)
	}
	s := &switchTest{life: &life{e2e: e2e{n: n, out: out, standIn: true}}, ic: ic, ist: ist, nft: nft, owned: owned, hostBefore: hostBefore}
	s.namespace(t, sinkNS, false)
	s.namespace(t, lifeNS, true)
	s.namespace(t, optNS, false)
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

	s.page = s.pageRunner(t)
	if !t.Run("switch", s.testSwitchToOurs) {
		return
	}
	// One mode only, as the broken agent below: a node joining and
	// switching on its own does not depend on istio-cni's rule mode.
	if !nft && !owned && !t.Run("a second node joins during the switch", s.testSecondNode) {
		return
	}
	if !t.Run("rollback of the node", s.testRollback) {
		return
	}
	// One mode only: the broken agent's path does not depend on
	// istio-cni's rule mode, and each step costs CI minutes.
	if !nft && !owned && !t.Run("rollback from a broken ambient-cni", s.testBrokenRollback) {
		return
	}
	t.Run("switch again, istio-cni removed", s.testSwitchAgain)
	t.Run("nothing was sent off the machine", testNoEgress(n))
}

// mode names the rule mode in figures, and istio-cni's own conflist.
func (s *switchTest) mode() string {
	switch {
	case s.nft:
		return "nftables"
	case s.owned:
		return "iptables-istio-owned-config"
	}
	return "iptables"
}

// istioOwnedConfName is istio-cni's own conflist under
// istioOwnedCNIConfig (its chart's istioOwnedCNIConfigFileName default).
const istioOwnedConfName = "02-istio-cni.conflist"

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

// loaded returns the config the runtime loads (runtimeConf) and its bytes.
func (s *switchTest) loaded() (string, []byte, error) {
	p, err := runtimeConf(s.n)
	if err != nil {
		return "", nil, err
	}
	b, err := os.ReadFile(p)
	return p, b, err
}

// chainSampler records every distinct plugin chain the config the runtime
// loads holds (the primary's conflist, or istio-cni's own), as loaded
// reads it, every 20 ms until stop.
func chainSampler(loaded func() (string, []byte, error)) (stop func() []string) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var seen []string
	go func() { // owner: stop, which cancels and waits
		defer close(done)
		last := ""
		for ctx.Err() == nil {
			if p, b, err := loaded(); err == nil {
				if l, err := libcni.ConfListFromBytes(b); err == nil {
					var types []string
					for _, p := range l.Plugins {
						types = append(types, p.Network.Type)
					}
					if c := strings.Join(types, ","); c != last {
						seen = append(seen, time.Now().Format("15:04:05.000")+" "+c+" ("+filepath.Base(p)+")")
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
		line = line[i+1:]
	}
	if i := strings.IndexByte(line, ' '); i >= 0 {
		line = line[:i]
	}
	return line
}

// switchToOurs is the switch as the migration page says it, its blocks
// run as written: block 1 (istio-cni fails closed) is done at istio-cni's
// install, whose values have the retry on (preflight would not print it);
// blocks 2 to 4 here, block 5 once the node went back and forth.
func (s *switchTest) switchToOurs(ctx context.Context, t *testing.T, mark func(string)) error {
	r := s.page
	if !strings.Contains(r.switchBlk[0], "enableAmbientDetectionRetry=true") {
		return fmt.Errorf("the page's first block is not istio-cni's retry:\n%s", r.switchBlk[0])
	}
	mark("label")
	if err := r.run(ctx, t, r.switchBlk[1]); err != nil {
		return err
	}
	mark("istio-cni on labelled nodes")
	if err := r.run(ctx, t, r.switchBlk[2]); err != nil {
		return err
	}
	if err := s.waitStandingBy(ctx, s.n.Name); err != nil {
		return err
	}
	mark("ours standing by")
	return s.switchNode(ctx, t, mark)
}

// switchNode runs the page's node block and waits until ambient-cni's
// agent chained itself in istio-cni's place and holds the pods istio-cni
// captured.
func (s *switchTest) switchNode(ctx context.Context, t *testing.T, mark func(string)) error {
	return s.switchNodeOf(ctx, t, mark, "", s.loaded, holds(s.n.AgentState, lifeNS, preSwitch...))
}

// switchNodeOf is switchNode for node (the first node when empty), whose
// chain loaded reads and whose agent adopted finds holding the pods.
func (s *switchTest) switchNodeOf(ctx context.Context, t *testing.T, mark func(string), node string, loaded func() (string, []byte, error), adopted func(context.Context) (bool, error)) error {
	mark("node switch")
	if err := s.page.runFor(ctx, t, node, s.page.switchBlk[3]); err != nil {
		return err
	}
	mark("istio-cni gone")
	if err := s.waitChainIn(ctx, loaded, "ambient-cni", "istio-cni"); err != nil {
		return err
	}
	mark("ours chained")
	if err := s.n.Poll(ctx, "the agent holds the pods istio-cni captured", adopted); err != nil {
		return err
	}
	mark("adopted")
	return nil
}

// holds is a poll condition: the agent whose pods state lists holds the
// named pods of namespace, enrolled.
func holds(state func(context.Context) ([]AgentPod, error), namespace string, names ...string) func(context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) {
		st, err := state(ctx)
		if err != nil {
			return false, err
		}
		for _, name := range names {
			if !slices.ContainsFunc(st, func(p AgentPod) bool {
				return p.Namespace == namespace && p.Name == name && p.State == ambient.RedirectionEnabled
			}) {
				return false, fmt.Errorf("the agent does not hold %s yet: %+v", name, st)
			}
		}
		return true, nil
	}
}

// waitChain waits until the primary config holds plugin in and not out.
func (s *switchTest) waitChain(ctx context.Context, in, out string) error {
	return s.waitChainIn(ctx, s.loaded, in, out)
}

// waitChainIn is waitChain for the config loaded reads.
func (s *switchTest) waitChainIn(ctx context.Context, loaded func() (string, []byte, error), in, out string) error {
	return s.n.Poll(ctx, in+" chained in "+out+"'s place", func(ctx context.Context) (bool, error) {
		_, b, err := loaded()
		if err != nil {
			return false, err
		}
		if strings.Contains(string(b), fmt.Sprintf("%q", in)) && !strings.Contains(string(b), fmt.Sprintf("%q", out)) {
			return true, nil
		}
		return false, fmt.Errorf("the chain:\n%s", b)
	})
}

// marker records when each step was reached.
type marker struct {
	mu    sync.Mutex
	at    map[string]time.Time
	begin time.Time
}

func newMarker() *marker { return &marker{at: map[string]time.Time{}, begin: time.Now()} }

func (m *marker) mark(what string) {
	m.mu.Lock()
	m.at[what] = time.Now()
	m.mu.Unlock()
}

// span prints the time from one step to another as a figure.
func (m *marker) span(t *testing.T, name, from, to string) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	figure(t, name, m.at[to].Sub(m.at[from]).Round(100*time.Millisecond).Seconds())
}

// checkChains asserts the primary config's chain ended in exactly one of
// istio-cni and ambient-cni at every sample, or in neither when neither
// is allowed, and returns the order of what ended it. With inert, ours
// followed by istio-cni's counts as istio-cni's: the state a give-back
// leaves until the agent standing by withdraws our entry (with no agent
// of ours answering, our plugin passes every pod on to istio-cni's once
// that one is chained and its agent answers).
func checkChains(t *testing.T, what string, chains []string, neither, inert bool) []string {
	t.Helper()
	t.Logf("the primary config's chains during the %s:\n%s", what, strings.Join(chains, "\n"))
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
		switch {
		case mesh == 0 && neither:
			last = "neither"
		case inert && mesh == 2 && last == "istio-cni" && types[len(types)-2] == "ambient-cni":
		case mesh != 1 || (last != "istio-cni" && last != "ambient-cni"):
			t.Errorf("%s: the primary config held the chain %s: want exactly one of istio-cni and ambient-cni, last", what, c)
			continue
		}
		if len(order) == 0 || order[len(order)-1] != last {
			order = append(order, last)
		}
	}
	return order
}

// checkCalm asserts a step with no window: no ambient pod seen
// uncaptured, no held connection reset, no request failed.
func (s *switchTest) checkCalm(t *testing.T, what string, samples, sandboxes int, bad []string, d TrafficCounts, zdsFrom int) {
	t.Helper()
	figure(t, what+"-capture-samples", samples)
	figure(t, what+"-sandboxes-sampled", sandboxes)
	figure(t, what+"-window-uncaptured-samples", len(bad))
	if len(bad) > 0 {
		t.Errorf("%s: ambient pods seen uncaptured:\n%s", what, strings.Join(bad, "\n"))
	}
	figure(t, what+"-connections-reset", d.Broken)
	figure(t, what+"-requests-failed", d.LoopFailed)
	if d.Broken > 0 || d.LoopFailed > 0 {
		t.Errorf("%s: %d held connections broke, %d requests failed: %s\n%s\n%s\n%s", what, d.Broken, d.LoopFailed, d.Listed(), s.n.StandInOf(context.Background(), d), s.zdsSince(zdsFrom), s.n.AgentLogTail(context.Background(), 80))
	}
}

// settled waits until the traffic has settled after a step (Settle) and
// returns what broke during the step, since tr: a connection broken by
// the step's last moments is counted in it, not in the next step.
func (s *switchTest) settled(t *testing.T, tr TrafficCounts) TrafficCounts {
	t.Helper()
	if err := s.traffic.Settle(context.Background(), time.Now(), time.Minute); err != nil {
		t.Error(err)
	}
	return s.traffic.Counts().Sub(tr)
}

// zdsMark is the number of ZDS requests the stand-in has received: a
// step's start, for zdsSince.
func (s *switchTest) zdsMark(t *testing.T) int {
	t.Helper()
	m, err := s.n.StandInMessages(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return len(m)
}

// releasedSince returns the uids the stand-in was told to drop (a Del)
// from the from-th ZDS request on: in a rollback, the pods ours released.
func (s *switchTest) releasedSince(t *testing.T, from int) map[string]bool {
	t.Helper()
	m, err := s.n.StandInMessages(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, x := range m[min(from, len(m)):] {
		if x.Kind == ztunnel.KindDel {
			out[x.UID] = true
		}
	}
	return out
}

// zdsSince lists the ZDS requests the stand-in received from the from-th
// on, each with its pod's name: what told ztunnel to drop or replace a
// pod whose connections broke.
func (s *switchTest) zdsSince(from int) string {
	ctx := context.Background()
	m, err := s.n.StandInMessages(ctx)
	if err != nil {
		return fmt.Sprintf("(the stand-in's ZDS requests: %v)", err)
	}
	names := map[string]string{}
	for _, ns := range []string{lifeNS, optNS} {
		if l, err := s.n.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err == nil {
			for _, p := range l.Items {
				names[string(p.UID)] = p.Namespace + "/" + p.Name
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "the stand-in's ZDS requests since the step began (%d before):", from)
	for _, x := range m[min(from, len(m)):] {
		fmt.Fprintf(&b, "\n  conn %d %s %s (%s) netns %v ack %q torn down %v", x.Conn, x.Kind, x.UID, names[x.UID], x.Netns, x.AckError, x.TornDown)
	}
	return b.String()
}

func (s *switchTest) testSwitchToOurs(t *testing.T) {
	ctx := context.Background()
	m := s.mode()
	zdsFrom := s.zdsMark(t)
	tr := s.traffic.Counts()
	stopAnn := s.watchAnnotations(t)
	stopSample := s.sampleCaptureIn(lifeNS, optNS)
	stopChain := chainSampler(s.loaded)
	mk := newMarker()
	pods, err := s.createKindsDuring(t, s.onFirst(), podKinds, "switch", func() error { return s.switchToOurs(ctx, t, mk.mark) })
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	changes := stopAnn()
	d := s.settled(t, tr)
	if err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	mk.span(t, m+"-switch-istio-cni-on-labelled-nodes-seconds", "label", "istio-cni on labelled nodes")
	mk.span(t, m+"-switch-ours-standing-by-seconds", "istio-cni on labelled nodes", "ours standing by")
	mk.span(t, m+"-switch-node-label-to-istio-cni-gone-seconds", "node switch", "istio-cni gone")
	mk.span(t, m+"-switch-node-label-to-ours-chained-seconds", "node switch", "ours chained")
	mk.span(t, m+"-switch-node-label-to-pods-adopted-seconds", "node switch", "adopted")
	figure(t, m+"-switch-seconds", time.Since(mk.begin).Round(100*time.Millisecond).Seconds())

	if order := checkChains(t, "switch", chains, false, false); strings.Join(order, ",") != "istio-cni,ambient-cni" {
		t.Errorf("the chain ended in %v during the switch, want istio-cni's then ours", order)
	}
	s.checkCalm(t, m+"-switch", samples, sandboxes, bad, d, zdsFrom)
	// Every kind of pod created on the node throughout: the ambient ones
	// captured from their first packet (or they waited), the others
	// started.
	s.checkKinds(t, s.onFirst(), podKinds, m+"-switch", pods)
	s.deleteKinds(pods)

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

// Rollback of the node, as the page says it: labelled back, istio-cni's
// pod is scheduled onto the node, ambient-cni's agent gives the node back
// (the pods handed over captured, its plugin left chained) and stands by,
// istio-cni's agent starts and adopts the running pods by their annotation
// and rules (its snapshot to ztunnel names them), istio-cni chains itself
// after our entry, and the agent standing by withdraws our entry. A calm
// step, asserted: no ambient pod ever seen uncaptured, no held connection
// broken, no request failed, no running pod released (no Del to ztunnel);
// the chain never holds neither plugin, and no ambient pod created
// meanwhile starts uncaptured. The end state is asserted: every pod
// captured by istio-cni with its rules only, ztunnel holding exactly the
// live pods, istiod seeing them HBONE.
func (s *switchTest) testRollback(t *testing.T) {
	ctx := context.Background()
	m := s.mode()
	zdsFrom := s.zdsMark(t)
	tr := s.traffic.Counts()
	stopSample := s.sampleCaptureIn(lifeNS, optNS)
	stopChain := chainSampler(s.loaded)
	mk := newMarker()
	pods, err := s.createKindsDuring(t, s.onFirst(), podKinds, "rollback", func() error {
		mk.mark("label")
		if err := s.page.run(ctx, t, s.page.rollBlk[0]); err != nil {
			return err
		}
		if err := s.waitAdopted(ctx, zdsFrom); err != nil {
			return err
		}
		mk.mark("adopted")
		if err := s.waitStandingBy(ctx, s.n.Name); err != nil {
			return err
		}
		mk.mark("ours standing by")
		if err := s.waitChain(ctx, "istio-cni", "ambient-cni"); err != nil {
			return err
		}
		mk.mark("ours withdrawn")
		return nil
	})
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	d := s.settled(t, tr)
	if err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	if order := checkChains(t, "rollback", chains, false, true); len(order) == 0 || order[len(order)-1] != "istio-cni" {
		t.Errorf("the chain ended in %v during the rollback, want istio-cni's last", order)
	}
	figure(t, m+"-rollback-seconds", time.Since(mk.begin).Round(100*time.Millisecond).Seconds())
	mk.span(t, m+"-rollback-label-to-pods-adopted-seconds", "label", "adopted")
	mk.span(t, m+"-rollback-label-to-ours-standing-by-seconds", "label", "ours standing by")
	mk.span(t, m+"-rollback-label-to-ours-withdrawn-seconds", "label", "ours withdrawn")
	s.checkCalm(t, m+"-rollback", samples, sandboxes, bad, d, zdsFrom)
	if rel := s.releasedSince(t, zdsFrom); len(rel) > 0 {
		var running []string
		for _, name := range preSwitch {
			if p, err := s.n.Client.CoreV1().Pods(lifeNS).Get(ctx, name, metav1.GetOptions{}); err == nil && rel[string(p.UID)] {
				running = append(running, name)
			}
		}
		if len(running) > 0 {
			t.Errorf("the rollback released running pods (ztunnel told to drop them): %v", running)
		}
	}
	s.checkKinds(t, s.onFirst(), podKinds, m+"-rollback", pods)
	s.deleteKinds(pods)

	// Nothing of ours left in the pods: each holds exactly the rules of a
	// pod istio-cni captured at its start.
	s.mustCaptured(t, s.startAmbient(t, "ref-istio"))
	ref := s.normalizedRules(t, "ref-istio")
	for _, name := range preSwitch {
		s.sameRules(t, name, "ref-istio", ref)
	}
	s.finalView(t)
}

// waitAdopted waits until istio-cni's agent holds ztunnel: a snapshot
// after the from-th ZDS request (ours serves none once it gave the node
// back) whose connection named every running pod of the switch.
func (s *switchTest) waitAdopted(ctx context.Context, from int) error {
	want := map[string]string{}
	for _, name := range preSwitch {
		p, err := s.n.Client.CoreV1().Pods(lifeNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		want[string(p.UID)] = name
	}
	return s.n.Poll(ctx, "istio-cni's snapshot naming the running pods", func(ctx context.Context) (bool, error) {
		msgs, err := s.n.StandInMessages(ctx)
		if err != nil {
			return false, err
		}
		named := map[int]map[string]bool{}
		why := errors.New("no snapshot since the step began")
		for _, x := range msgs[min(from, len(msgs)):] {
			if named[x.Conn] == nil {
				named[x.Conn] = map[string]bool{}
			}
			switch x.Kind {
			case ztunnel.KindAdd, ztunnel.KindKeep:
				named[x.Conn][x.UID] = true
			case ztunnel.KindSnapshotSent:
				var missing []string
				for uid, name := range want {
					if !named[x.Conn][uid] {
						missing = append(missing, name)
					}
				}
				if len(missing) == 0 {
					return true, nil
				}
				why = fmt.Errorf("the snapshot on connection %d did not name %v", x.Conn, missing)
			}
		}
		return false, why
	})
}

// testSwitchAgain switches the node again (the page's node block) and
// ends the switch (its last block: istio-cni's release uninstalled, the
// takeover off, the labels gone), under traffic, with every kind of pod
// created throughout.
func (s *switchTest) testSwitchAgain(t *testing.T) {
	ctx := context.Background()
	m := s.mode()
	zdsFrom := s.zdsMark(t)
	tr := s.traffic.Counts()
	stopSample := s.sampleCaptureIn(lifeNS, optNS)
	stopChain := chainSampler(s.loaded)
	mk := newMarker()
	pods, err := s.createKindsDuring(t, s.onFirst(), podKinds, "again", func() error {
		if err := s.switchNode(ctx, t, mk.mark); err != nil {
			return err
		}
		mk.mark("last block")
		if err := s.page.run(ctx, t, s.page.switchBlk[4]); err != nil {
			return err
		}
		mk.mark("done")
		return nil
	})
	chains := stopChain()
	samples, sandboxes, bad := stopSample()
	d := s.settled(t, tr)
	if err != nil {
		t.Fatalf("%v\n%s", err, s.n.AgentLogTail(ctx, 40))
	}
	mk.span(t, m+"-again-node-label-to-ours-chained-seconds", "node switch", "ours chained")
	mk.span(t, m+"-again-last-block-seconds", "last block", "done")
	if order := checkChains(t, "switch again", chains, false, false); strings.Join(order, ",") != "istio-cni,ambient-cni" {
		t.Errorf("the chain ended in %v, want istio-cni's then ours", order)
	}
	s.checkCalm(t, m+"-again", samples, sandboxes, bad, d, zdsFrom)
	s.checkKinds(t, s.onFirst(), podKinds, m+"-again", pods)
	s.deleteKinds(pods)

	// Nothing of istio-cni's release, nor of the switch, is left: its
	// DaemonSet, the node's label; ours runs without the takeover.
	if _, err := s.n.Client.AppsV1().DaemonSets(ReleaseNamespace).Get(ctx, IstioCNIDaemonSet, metav1.GetOptions{}); err == nil {
		t.Errorf("istio-cni's DaemonSet is still there")
	}
	node, err := s.n.Client.CoreV1().Nodes().Get(ctx, s.n.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := node.Labels[kubectlplugin.SwitchLabel]; ok {
		t.Errorf("the node still has %s=%s", kubectlplugin.SwitchLabel, v)
	}
	// The runtime loads the primary's own config with ours, no copy of
	// istio-cni's (which the takeover removed) nor any other.
	if p, err := runtimeConf(s.n); err != nil || p != s.n.CNIConfFile {
		t.Errorf("the runtime loads %s (%v), want the primary's %s", p, err, s.n.CNIConfFile)
	}
	if _, err := os.Stat(filepath.Join(s.n.CNIConfDir, istioOwnedConfName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("istio-cni's own conflist %s is still there (%v)", istioOwnedConfName, err)
	}
	agents, err := s.n.AgentPods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range agents {
		for _, e := range p.Spec.Containers[0].Env {
			if e.Name == "AMBIENT_ISTIO_CNI_RUN_DIR" {
				t.Errorf("agent %s still runs with the takeover on", p.Name)
			}
		}
	}
	s.mustCaptured(t, s.startAmbient(t, "ref-ours-again"))
	ref := s.normalizedRules(t, "ref-ours-again")
	for _, name := range preSwitch {
		s.sameRules(t, name, "ref-ours-again", ref)
	}
	s.finalView(t)
	left, err := IstioHost()
	if err != nil {
		t.Fatal(err)
	}
	figure(t, m+"-switch-istio-cni-host-leftovers", fmt.Sprintf("%q", left.Sub(s.hostBefore).String()))
}

// waitRunningCaptured waits until every running pod of the ambient
// namespaces (lifeNS, and optNS's opted-in ones) is captured.
func (s *switchTest) waitRunningCaptured(ctx context.Context, what string) error {
	return s.n.Poll(ctx, what, func(ctx context.Context) (bool, error) {
		for _, ns := range []string{lifeNS, optNS} {
			pods, err := s.n.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
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
		}
		return true, nil
	})
}
