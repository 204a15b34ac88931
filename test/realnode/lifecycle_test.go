//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
	"github.com/ambient-cni/ambient-cni/test/realnode/podapp"
)

// A node's life with traffic running (issue 19): runtime restarts, an
// agent upgrade and rollout restart, a ztunnel restart, the primary CNI
// rewriting its config, and a reboot without drain, on a node of its own;
// then reboots during which the agent, or the agent and the API server,
// cannot answer the plugin (rebootdown_test.go, rebootnoapi_test.go).
// Promises are asserted; the figures are printed as "FIGURE name value"
// lines (docs/reliability.md collects them).

const (
	lifeNS = "life"
	sinkNS = "life-sinks"
	// heldConns is the number of long-lived connections kept open.
	heldConns = 20
)

type life struct {
	e2e
	// sink is a host-network app at the pod network's gateway: an
	// address that survives a reboot, so a pod's hello at start (in its
	// spec) still reaches it after one.
	sink netip.AddrPort
	// traffic runs from the ambient pods through the stand-in.
	traffic *Traffic
	seq     int
}

func figure(t *testing.T, name string, v any) {
	t.Helper()
	t.Logf("FIGURE %s %v", name, v)
}

// startAgentNode brings up a node of the test's own with the chart
// installed with its defaults (and helm's extra arguments) and the
// ztunnel stand-in running, torn down when the test ends.
func startAgentNode(t *testing.T, extra ...string) e2e {
	t.Helper()
	return startAgentNodeWith(t, Options{}, extra...)
}

// startAgentNodeWith is startAgentNode with node options (Out is set).
func startAgentNodeWith(t *testing.T, o Options, extra ...string) e2e {
	t.Helper()
	ctx, out, _ := startNodeTest(t)
	o.Out, o.Images = out, testImages
	n, err := Up(ctx, o)
	if err != nil {
		t.Fatalf("node up: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Down(); err != nil {
			t.Errorf("down: %v", err)
		}
	})
	if err := n.InstallAgent(ctx, "install", ImageTag, extra...); err != nil {
		t.Fatalf("helm install: %v", err)
	}
	if err := n.StartStandIn(ctx); err != nil {
		t.Fatalf("ztunnel stand-in: %v", err)
	}
	return e2e{n: n, out: out, standIn: true}
}

func TestRealNodeLifecycle(t *testing.T) {
	e := startAgentNode(t)
	l := &life{e2e: e}
	l.namespace(t, sinkNS, false)
	l.namespace(t, lifeNS, true)
	l.startSink(t)
	for _, name := range []string{"srv", "a1", "a2"} {
		l.mustCaptured(t, l.startAmbient(t, name))
	}
	l.startTraffic(t)
	t.Cleanup(func() {
		if l.traffic != nil {
			l.traffic.Stop()
		}
	})

	t.Run("containerd and kubelet restarts re-enroll nothing", l.testRuntimeRestarts)
	t.Run("agent upgrade and rollout restart under traffic", l.testAgentRollUnderTraffic)
	t.Run("helm upgrade renaming the DaemonSet under traffic", l.testRenameUnderTraffic)
	t.Run("ztunnel restart under traffic", l.testZtunnelRestart)
	t.Run("the primary CNI rewrites its config", l.testPrimaryRewritesConfig)
	t.Run("reboot without drain", l.testReboot)
	t.Run("image unpullable after a reboot", l.testImageUnpullableAfterReboot)
	t.Run("DaemonSet left the node while down", l.testDaemonSetLeftWhileDown)
	t.Run("namespace labelled while down and API server unreachable at boot", l.testLabelledWhileDownNoAPI)
}

// startSink starts the host-network sink on a free port.
func (l *life) startSink(t *testing.T) {
	t.Helper()
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	l.sink = netip.AddrPortFrom(netip.MustParseAddr(l.n.Gateway), uint16(ports[0]))
	pod := l.n.AppPod(sinkNS, "sink", AppOptions{Args: []string{"serve", "-listen", fmt.Sprintf(":%d", ports[0])}})
	pod.Spec.HostNetwork = true
	c := &pod.Spec.Containers[0]
	c.Ports = nil
	c.ReadinessProbe = nil
	c.LivenessProbe = nil
	if _, err := l.n.Client.CoreV1().Pods(sinkNS).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.n.WaitPodReady(context.Background(), sinkNS, "sink"); err != nil {
		t.Fatal(err)
	}
}

// sinkURL is a URL of the sink.
func (l *life) sinkURL(path string) string { return "http://" + l.sink.String() + path }

// hellos returns how many requests for path reached the sink.
func (l *life) hellos(ctx context.Context, path string) (int, error) {
	b, err := httpGet(ctx, l.sinkURL("/log"))
	if err != nil {
		return 0, err
	}
	var entries []podapp.Entry
	if err := json.Unmarshal(b, &entries); err != nil {
		return 0, err
	}
	c := 0
	for _, e := range entries {
		if e.Path == path {
			c++
		}
	}
	return c, nil
}

// startAmbient creates an ambient pod that says hello to the sink at
// start (through the stand-in when it started captured).
func (l *life) startAmbient(t *testing.T, name string) *corev1.Pod {
	t.Helper()
	return l.start(t, lifeNS, name, AppOptions{Hello: l.sinkURL("/hello-" + name)})
}

// flow is traffic from pod from to pod to's app port.
func (l *life) flow(t *testing.T, from, to *corev1.Pod) Flow {
	t.Helper()
	ns, err := l.n.PodNetns(context.Background(), from.Namespace, from.Name)
	if err != nil {
		t.Fatal(err)
	}
	return Flow{Name: from.Name + "→" + to.Name, Netns: ns, Dst: podAddr(to)}
}

func (l *life) pod(t *testing.T, name string) *corev1.Pod {
	t.Helper()
	p, err := l.n.Client.CoreV1().Pods(lifeNS).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// startTraffic opens heldConns connections from a1 and a2 to srv and a
// request loop from a2 to the sink, and proves they run through the
// stand-in.
func (l *life) startTraffic(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	srv, a1, a2 := l.pod(t, "srv"), l.pod(t, "a1"), l.pod(t, "a2")
	before := len(l.records(t, a1.UID, ambient.ZtunnelOutboundPort, podAddr(srv))) + len(l.records(t, a2.UID, ambient.ZtunnelOutboundPort, podAddr(srv)))
	var held []Flow
	for i := range heldConns {
		from := a1
		if i%2 == 1 {
			from = a2
		}
		held = append(held, l.flow(t, from, srv))
	}
	a2ns, err := l.n.PodNetns(ctx, a2.Namespace, a2.Name)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := StartTraffic(ctx, held, Flow{Name: "a2→sink", Netns: a2ns, Dst: l.sink})
	if err != nil {
		t.Fatal(err)
	}
	l.traffic = tr
	err = l.n.Poll(ctx, "held connections in the stand-in's records", func(ctx context.Context) (bool, error) {
		got := len(l.records(t, a1.UID, ambient.ZtunnelOutboundPort, podAddr(srv))) + len(l.records(t, a2.UID, ambient.ZtunnelOutboundPort, podAddr(srv)))
		if got-before < heldConns {
			return false, fmt.Errorf("the stand-in proxied %d of the %d held connections", got-before, heldConns)
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// enrolled is what a captured pod's enrollment looks like from outside:
// compared before and after a runtime restart.
type enrolled struct {
	annotation, sandbox string
	rules               []string
	adds                int
}

func (l *life) enrollment(t *testing.T) map[string]enrolled {
	t.Helper()
	ctx := context.Background()
	pods, err := l.n.Client.CoreV1().Pods(lifeNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := l.n.StandInMessages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]enrolled{}
	for _, p := range pods.Items {
		id, err := l.n.SandboxID(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		rules, err := l.n.PodRules(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		adds := 0
		for _, m := range msgs {
			if m.Kind == ztunnel.KindAdd && m.UID == string(p.UID) {
				adds++
			}
		}
		out[p.Name] = enrolled{annotation: p.Annotations[ambient.RedirectionAnnotation], sandbox: id, rules: normalizeRules(rules), adds: adds}
	}
	return out
}

// watchAnnotations records every change of the ambient pods' redirection
// annotation until stop is called.
func (l *life) watchAnnotations(t *testing.T) (stop func() []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pods, err := l.n.Client.CoreV1().Pods(lifeNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	last := map[string]string{}
	for _, p := range pods.Items {
		last[p.Name] = p.Annotations[ambient.RedirectionAnnotation]
	}
	w, err := l.n.Client.CoreV1().Pods(lifeNS).Watch(ctx, metav1.ListOptions{ResourceVersion: pods.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	var changes []string
	done := make(chan struct{})
	go func() { // owner: stop, which cancels the watch and waits
		defer close(done)
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type == watch.Bookmark {
				continue
			}
			v := p.Annotations[ambient.RedirectionAnnotation]
			if old, seen := last[p.Name]; !seen || old != v {
				changes = append(changes, fmt.Sprintf("%s %s: %q → %q", ev.Type, p.Name, old, v))
				last[p.Name] = v
			}
		}
	}()
	return func() []string {
		w.Stop()
		cancel()
		<-done
		return changes
	}
}

// Item 5: containerd alone, then kubelet alone, restarted under traffic:
// the running pods keep their sandbox, rules, annotation and stand-in
// enrollment, and no connection breaks.
func (l *life) testRuntimeRestarts(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name    string
		restart func(context.Context) error
	}{{"containerd", l.n.RestartContainerd}, {"kubelet", l.n.RestartKubelet}} {
		before := l.enrollment(t)
		tr := l.traffic.Counts()
		stop := l.watchAnnotations(t)
		begin := time.Now()
		if err := c.restart(ctx); err != nil {
			stop()
			t.Fatalf("restart %s: %v", c.name, err)
		}
		// Compared once kubelet works with the runtime again: it probed
		// every pod after the restart.
		restarted := time.Now()
		for name := range before {
			p := l.pod(t, name)
			if err := l.n.Poll(ctx, "kubelet probes "+name+" again", func(ctx context.Context) (bool, error) {
				entries, err := appLog(ctx, p)
				if err != nil {
					return false, err
				}
				return slices.ContainsFunc(entries, func(e podapp.Entry) bool { return e.Path == "/ready" && e.Time.After(restarted) }), nil
			}); err != nil {
				t.Error(err)
			}
		}
		figure(t, c.name+"-restart-until-probed-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())
		changes := stop()
		after := l.enrollment(t)
		d := l.traffic.Counts().Sub(tr)
		figure(t, c.name+"-restart-connections-broken", d.Broken)
		figure(t, c.name+"-restart-requests-failed", d.LoopFailed)
		if len(changes) > 0 {
			t.Errorf("%s restart: the redirection annotation changed: %v", c.name, changes)
		}
		if d.Broken > 0 || d.LoopFailed > 0 {
			t.Errorf("%s restart: %d held connections broke, %d requests failed: %v\n%s", c.name, d.Broken, d.LoopFailed, d.Listed(), l.n.StandInOf(ctx, d))
		}
		for name, b := range before {
			a := after[name]
			if a.annotation != ambient.RedirectionEnabled || a.annotation != b.annotation {
				t.Errorf("%s restart: %s annotation %q, was %q", c.name, name, a.annotation, b.annotation)
			}
			if a.sandbox != b.sandbox {
				t.Errorf("%s restart: %s got a new sandbox %s (was %s)", c.name, name, a.sandbox, b.sandbox)
			}
			if a.adds != b.adds {
				t.Errorf("%s restart: %s was sent to ztunnel again (%d adds, %d before)", c.name, name, a.adds, b.adds)
			}
			if !slices.Equal(a.rules, b.rules) {
				t.Errorf("%s restart: the rules in %s changed:\nbefore:\n%s\nafter:\n%s", c.name, name, strings.Join(b.rules, "\n"), strings.Join(a.rules, "\n"))
			}
		}
	}
}

// rollPod is a pod created while the agent rolls.
type rollPod struct {
	name   string
	waited time.Duration
	err    error
}

// createDuring creates an ambient pod every interval while roll runs (at
// least one after it returns) and waits for each to be Ready.
func (l *life) createDuring(t *testing.T, prefix string, roll func() error) ([]rollPod, error) {
	t.Helper()
	ctx := context.Background()
	rolled := make(chan error, 1)
	go func() { rolled <- roll() }() // owner: this function, which waits for it
	var (
		mu   sync.Mutex
		pods []rollPod
		wg   sync.WaitGroup
	)
	create := func() {
		l.seq++
		name := fmt.Sprintf("%s-%d", prefix, l.seq)
		begin := time.Now()
		_, err := l.n.Client.CoreV1().Pods(lifeNS).Create(ctx, l.n.AppPod(lifeNS, name, AppOptions{Hello: l.sinkURL("/hello-" + name)}), metav1.CreateOptions{})
		wg.Add(1)
		go func() { // owner: createDuring, which waits on wg
			defer wg.Done()
			if err == nil {
				_, err = l.n.WaitPodReady(ctx, lifeNS, name)
			}
			mu.Lock()
			pods = append(pods, rollPod{name: name, waited: time.Since(begin), err: err})
			mu.Unlock()
		}()
	}
	var rollErr error
	for done := false; !done; {
		create()
		select {
		case rollErr = <-rolled:
			done = true
		case <-time.After(2 * time.Second): // spread the pods over the roll; not a wait for anything
		}
	}
	wg.Wait()
	return pods, rollErr
}

// checkRollPods asserts every pod created during a roll is Ready,
// captured, and started captured (its hello at start went through the
// stand-in), and prints how long it waited.
func (l *life) checkRollPods(t *testing.T, what string, pods []rollPod) {
	t.Helper()
	uncaptured := 0
	var longest time.Duration
	for _, rp := range pods {
		if rp.err != nil {
			t.Errorf("%s: %v", rp.name, rp.err)
			continue
		}
		longest = max(longest, rp.waited)
		t.Logf("%s: %s created during the %s, Ready after %v", what, rp.name, what, rp.waited.Round(100*time.Millisecond))
		p := l.pod(t, rp.name)
		l.mustCaptured(t, p)
		if !l.startedCaptured(t, p) {
			uncaptured++
		}
	}
	figure(t, what+"-pods-created", len(pods))
	figure(t, what+"-pods-started-uncaptured", uncaptured)
	figure(t, what+"-longest-pod-wait-seconds", longest.Round(100*time.Millisecond).Seconds())
	if uncaptured > 0 {
		t.Errorf("%s: %d pods started uncaptured", what, uncaptured)
	}
}

// startedCaptured reports whether every hello a pod made to the sink went
// through the stand-in.
func (l *life) startedCaptured(t *testing.T, p *corev1.Pod) bool {
	return l.startedCapturedIn(t, l.n.StandInRecords, p)
}

// startedCapturedIn is startedCaptured with the records of the stand-in
// of the pod's node.
func (l *life) startedCapturedIn(t *testing.T, records func(context.Context) ([]ztunnel.Record, error), p *corev1.Pod) bool {
	t.Helper()
	ctx := context.Background()
	hellos, err := l.hellos(ctx, "/hello-"+p.Name)
	if err != nil {
		t.Fatal(err)
	}
	all, err := records(ctx)
	if err != nil {
		t.Fatal(err)
	}
	proxied := 0
	for _, r := range recordsOf(all, p.UID) {
		if r.Port == ambient.ZtunnelOutboundPort && r.OrigDst == l.sink && r.Err == "" {
			proxied++
		}
	}
	if hellos == 0 || proxied < hellos {
		t.Logf("%s: %d hellos reached the sink, the stand-in proxied %d", p.Name, hellos, proxied)
		return false
	}
	return true
}

// waitAgentRolled waits until the one agent pod is not old, runs image
// tag and is Ready.
func (l *life) waitAgentRolled(ctx context.Context, old, tag string) error {
	return l.n.Poll(ctx, "agent rolled", func(ctx context.Context) (bool, error) {
		pods, err := l.n.AgentPods(ctx)
		if err != nil || len(pods) != 1 {
			return false, fmt.Errorf("%d agent pods (%v)", len(pods), err)
		}
		p := pods[0]
		if p.Name == old || p.Spec.Containers[0].Image != l.n.AgentImage(tag) || !isReady(&p) {
			return false, fmt.Errorf("agent %s on %s ready=%v", p.Name, p.Spec.Containers[0].Image, isReady(&p))
		}
		return true, nil
	})
}

// Item 3: helm upgrade to a new image tag, then a rollout restart (the
// template annotation kubectl sets), with the held connections and the
// request loop running and pods created during each roll.
func (l *life) testAgentRollUnderTraffic(t *testing.T) {
	ctx := context.Background()
	const tag = "life2"
	if _, err := l.n.PushAgentTag(ctx, tag); err != nil {
		t.Fatal(err)
	}
	old := l.oneAgent(t)
	tr := l.traffic.Counts()
	pods, err := l.createDuring(t, "upgrade", func() error {
		if err := l.n.InstallAgent(ctx, "upgrade", tag); err != nil {
			return err
		}
		return l.waitAgentRolled(ctx, old.Name, tag)
	})
	if err != nil {
		t.Fatal(err)
	}
	d := l.traffic.Counts().Sub(tr)
	figure(t, "helm-upgrade-connections-reset", d.Broken)
	figure(t, "helm-upgrade-requests-failed", d.LoopFailed)
	if d.Broken > 0 {
		t.Errorf("helm upgrade: %d held connections broke: %v", d.Broken, d.Listed())
	}
	l.checkRollPods(t, "helm-upgrade", pods)

	old = l.oneAgent(t)
	tr = l.traffic.Counts()
	pods, err = l.createDuring(t, "restart", func() error {
		ds, err := l.n.Client.AppsV1().DaemonSets(ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ambient-cni"})
		if err != nil || len(ds.Items) != 1 {
			return fmt.Errorf("the agent's DaemonSet: %d found (%v)", len(ds.Items), err)
		}
		// What kubectl rollout restart patches.
		patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339))
		if _, err := l.n.Client.AppsV1().DaemonSets(ReleaseNamespace).Patch(ctx, ds.Items[0].Name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			return err
		}
		return l.waitAgentRolled(ctx, old.Name, tag)
	})
	if err != nil {
		t.Fatal(err)
	}
	d = l.traffic.Counts().Sub(tr)
	figure(t, "rollout-restart-connections-reset", d.Broken)
	figure(t, "rollout-restart-requests-failed", d.LoopFailed)
	if d.Broken > 0 {
		t.Errorf("rollout restart: %d held connections broke: %v", d.Broken, d.Listed())
	}
	l.checkRollPods(t, "rollout-restart", pods)
}

// livePods returns the Running ambient pods by UID.
func (l *life) livePods(t *testing.T) map[string]corev1.Pod {
	t.Helper()
	pods, err := l.n.Client.CoreV1().Pods(lifeNS).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]corev1.Pod{}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
			out[string(p.UID)] = p
		}
	}
	return out
}

// netnsID is the stand-in's identity of a netns file.
func netnsID(path string) (ztunnel.NetnsID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return ztunnel.NetnsID{}, fmt.Errorf("stat %s: %w", path, err)
	}
	return ztunnel.NetnsID{Dev: uint64(st.Dev), Ino: st.Ino}, nil
}

// standInViewIsLive is nil when the stand-in serves exactly the live
// ambient pods, each in its current netns, with one listener per port.
func (l *life) standInViewIsLive(ctx context.Context, live map[string]corev1.Pod) error {
	wls, err := l.n.StandInWorkloads(ctx)
	if err != nil {
		return err
	}
	served := map[string]bool{}
	for _, w := range wls {
		p, ok := live[w.UID]
		if !ok {
			return fmt.Errorf("the stand-in serves %s/%s (%s), not a live ambient pod", w.Info.Namespace, w.Info.Name, w.UID)
		}
		path, err := l.n.PodNetns(ctx, p.Namespace, p.Name)
		if err != nil {
			return err
		}
		id, err := netnsID(path)
		if err != nil {
			return err
		}
		if w.Netns != id {
			return fmt.Errorf("the stand-in serves %s in netns %v, its sandbox's is %v", p.Name, w.Netns, id)
		}
		served[w.UID] = true
	}
	for uid, p := range live {
		if !served[uid] {
			return fmt.Errorf("the stand-in does not serve %s", p.Name)
		}
		path, err := l.n.PodNetns(ctx, p.Namespace, p.Name)
		if err != nil {
			return err
		}
		out, err := exec.CommandContext(ctx, "nsenter", "--net="+path, "ss", "-Htln").CombinedOutput()
		if err != nil {
			return fmt.Errorf("ss in %s: %v: %s", p.Name, err, out)
		}
		for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
			want := 0
			for _, w := range wls {
				if w.UID == uid {
					want = countOf(w.Ports, port)
				}
			}
			if c := strings.Count(string(out), fmt.Sprintf(":%d ", port)); c != want {
				return fmt.Errorf("%s has %d listeners on %d, the stand-in %d (an old ztunnel's left?):\n%s", p.Name, c, port, want, out)
			}
		}
	}
	return nil
}

func countOf(s []int, v int) int {
	c := 0
	for _, x := range s {
		if x == v {
			c++
		}
	}
	return c
}

// Item 4: the stand-in's pod is deleted and created again (a ztunnel
// rollout) with traffic running: how long until the agent's snapshot is
// acked, what failed meanwhile, and nothing of the old stand-in's view is
// left.
func (l *life) testZtunnelRestart(t *testing.T) {
	ctx := context.Background()
	tr := l.traffic.Counts()
	begin := time.Now()
	if err := l.n.Client.CoreV1().Pods(ReleaseNamespace).Delete(ctx, StandInName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := l.n.WaitPodGone(ctx, ReleaseNamespace, StandInName); err != nil {
		t.Fatal(err)
	}
	if err := l.n.StartStandIn(ctx); err != nil {
		t.Fatal(err)
	}
	err := l.n.Poll(ctx, "the agent's snapshot acked by the new stand-in", func(ctx context.Context) (bool, error) {
		msgs, err := l.n.StandInMessages(ctx)
		if err != nil {
			return false, err
		}
		for _, m := range msgs {
			if m.Kind == ztunnel.KindSnapshotSent && m.AckError == "" {
				return true, nil
			}
		}
		return false, fmt.Errorf("no snapshot in %d messages", len(msgs))
	})
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "ztunnel-restart-snapshot-acked-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())
	// The traffic recovers: a request of the loop succeeds again.
	err = l.n.Poll(ctx, "traffic through the new stand-in", func(context.Context) (bool, error) {
		return l.traffic.Counts().LoopOK > tr.LoopOK+1, nil
	})
	if err != nil {
		t.Error(err)
	}
	d := l.traffic.Counts().Sub(tr)
	figure(t, "ztunnel-restart-connections-broken", d.Broken)
	figure(t, "ztunnel-restart-requests-failed", d.LoopFailed)
	live := l.livePods(t)
	if err := l.n.Poll(ctx, "the stand-in serves exactly the live pods", func(ctx context.Context) (bool, error) {
		err := l.standInViewIsLive(ctx, live)
		return err == nil, err
	}); err != nil {
		t.Error(err)
	}
}

// Item 6: the primary CNI writes its conflist again without our entry,
// as Calico's and Cilium's agents do when they restart. The time until we
// are chained again is printed, and a pod created in that window is
// followed: what it gets is printed (docs/reliability.md).
func (l *life) testPrimaryRewritesConfig(t *testing.T) {
	ctx := context.Background()
	if err := pluginInstalled(l.n); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(l.n.CNIConfDir, ".primary-rewrite.tmp")
	if err := os.WriteFile(tmp, l.n.CNIConfOriginal, 0o644); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	if err := os.Rename(tmp, l.n.CNIConfFile); err != nil {
		t.Fatal(err)
	}
	l.seq++
	name := fmt.Sprintf("rewrite-%d", l.seq)
	if _, err := l.n.Client.CoreV1().Pods(lifeNS).Create(ctx, l.n.AppPod(lifeNS, name, AppOptions{Hello: l.sinkURL("/hello-" + name)}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var rechained time.Duration
	if err := l.n.Poll(ctx, "chained again", func(context.Context) (bool, error) {
		err := pluginInstalled(l.n)
		rechained = time.Since(begin)
		return err == nil, err
	}); err != nil {
		t.Fatal(err)
	}
	figure(t, "primary-rewrite-rechained-ms", rechained.Milliseconds())
	p, err := l.n.WaitPodReady(ctx, lifeNS, name)
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "primary-rewrite-window-pod-ready-ms", time.Since(begin).Milliseconds())
	figure(t, "primary-rewrite-window-pod-started-captured", l.startedCaptured(t, p))
	// Captured in the end either way: by the plugin, or by the agent's
	// controller for a pod the plugin never saw.
	l.mustCaptured(t, p)
	figure(t, "primary-rewrite-window-pod-captured-ms", time.Since(begin).Milliseconds())
}

// readySandbox is a ready pod sandbox: its id and pod (namespace/name).
type readySandbox struct{ id, pod string }

// readySandboxes lists the ready sandboxes of the pods of namespaces.
func (l *life) readySandboxes(ctx context.Context, namespaces []string) ([]readySandbox, error) {
	return readySandboxesVia(ctx, l.n.crictl, namespaces)
}

// readySandboxesVia is readySandboxes through a node's crictl.
func readySandboxesVia(ctx context.Context, crictl func(context.Context, ...string) (string, error), namespaces []string) ([]readySandbox, error) {
	// crictl's namespace filter is a pattern ("life" matches more) and
	// takes one: the namespaces are picked here.
	out, err := crictl(ctx, "pods", "--state", "ready", "-o", "json")
	if err != nil {
		return nil, err
	}
	var list struct {
		Items []struct {
			ID       string
			Metadata struct{ Name, Namespace string }
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		return nil, err
	}
	var sbs []readySandbox
	for _, it := range list.Items {
		if slices.Contains(namespaces, it.Metadata.Namespace) {
			sbs = append(sbs, readySandbox{id: it.ID, pod: it.Metadata.Namespace + "/" + it.Metadata.Name})
		}
	}
	return sbs, nil
}

// sandboxRules returns the rules in a sandbox's netns.
func (l *life) sandboxRules(ctx context.Context, id string) (string, error) {
	out, err := l.n.crictl(ctx, "inspectp", "-o", "json", id)
	if err != nil {
		return "", err
	}
	var info struct {
		Info struct {
			RuntimeSpec struct {
				Linux struct{ Namespaces []struct{ Type, Path string } }
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		return "", err
	}
	for _, ns := range info.Info.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" && ns.Path != "" {
			return NetnsRules(ctx, ns.Path)
		}
	}
	return "", fmt.Errorf("sandbox %s has no netns", id)
}

// sampleCapture checks, until stop, that every ready sandbox of an
// ambient pod has capture rules; it returns the number of checks, of
// distinct sandboxes checked, and what it saw uncaptured.
func (l *life) sampleCapture() (stop func() (samples, sandboxes int, uncaptured []string)) {
	return l.sampleCaptureIn(lifeNS)
}

// sampleCaptureIn is sampleCapture for the pods of namespaces.
func (l *life) sampleCaptureIn(namespaces ...string) (stop func() (samples, sandboxes int, uncaptured []string)) {
	return sampleCaptureVia(func(ctx context.Context) ([]readySandbox, error) { return l.readySandboxes(ctx, namespaces) }, l.sandboxRules)
}

// sampleCaptureVia is sampleCapture over the sandboxes list returns, each
// one's rules as rules reads them (called from several goroutines at
// once): any node's.
func sampleCaptureVia(list func(context.Context) ([]readySandbox, error), rules func(context.Context, string) (string, error)) (stop func() (samples, sandboxes int, uncaptured []string)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	samples := 0
	seen := map[string]bool{}
	var bad []string
	go func() { // owner: stop, which cancels and waits
		defer close(done)
		for ctx.Err() == nil {
			sbs, err := list(ctx)
			if err == nil {
				// Each sandbox looked at at once: a round takes the slowest
				// look, not their sum, on a node busy with a switch.
				var (
					mu sync.Mutex
					wg sync.WaitGroup
				)
				for _, sb := range sbs {
					wg.Add(1)
					go func() { // owner: this round, which waits on wg
						defer wg.Done()
						rules, err := rules(ctx, sb.id)
						if err != nil {
							return // gone between the listing and the look
						}
						mu.Lock()
						defer mu.Unlock()
						samples++
						seen[sb.id] = true
						if !HasCaptureRules(rules) {
							bad = append(bad, fmt.Sprintf("%s %s sandbox %s ready without capture rules", time.Now().Format("15:04:05.000"), sb.pod, sb.id))
						}
					}()
				}
				wg.Wait()
			}
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	return func() (int, int, []string) {
		cancel()
		<-done
		return samples, len(seen), bad
	}
}

// waitRestarted waits until a pod runs a container other than old (the
// one before a reboot) and is Ready.
func (l *life) waitRestarted(ctx context.Context, ns, name, old string) error {
	return l.n.Poll(ctx, ns+"/"+name+" back after the reboot", func(ctx context.Context) (bool, error) {
		p, err := l.n.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].ContainerID == old || !isReady(p) {
			return false, fmt.Errorf("not back yet: %s", podSummary(p))
		}
		return true, nil
	})
}

// Item 2: a reboot without drain. Every ambient pod comes back captured
// in a new sandbox and netns, its probes direct, its hello at start
// through the stand-in; the stand-in serves exactly the live pods; the
// agent holds no record of a dead netns; and no ready sandbox of an
// ambient pod was ever seen without its rules.
func (l *life) testReboot(t *testing.T) {
	ctx := context.Background()
	if l.traffic != nil {
		l.traffic.Stop()
		l.traffic = nil
	}
	type was struct{ sandbox, netns, container string }
	before := map[string]was{}
	for _, p := range l.livePods(t) {
		id, err := l.n.SandboxID(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		ns, err := l.n.PodNetns(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		before[p.Name] = was{id, ns, p.Status.ContainerStatuses[0].ContainerID}
	}
	sink, err := l.n.Client.CoreV1().Pods(sinkNS).Get(ctx, "sink", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	oldSink := sink.Status.ContainerStatuses[0].ContainerID
	standIn, err := l.n.Client.CoreV1().Pods(ReleaseNamespace).Get(ctx, StandInName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	oldStandIn := standIn.Status.ContainerStatuses[0].ContainerID
	// Sampled from when the node is down: every sandbox seen is new.
	var stopSampling func() (int, int, []string)
	begin := time.Now()
	if err := l.n.Reboot(ctx, func() { stopSampling = l.sampleCapture() }); err != nil {
		if stopSampling != nil {
			stopSampling()
		}
		t.Fatal(err)
	}
	var ready []string
	for name, b := range before {
		if err := l.waitRestarted(ctx, lifeNS, name, b.container); err != nil {
			t.Error(err)
			continue
		}
		ready = append(ready, name)
	}
	if err := l.waitRestarted(ctx, ReleaseNamespace, StandInName, oldStandIn); err != nil {
		t.Error(err)
	}
	figure(t, "reboot-all-pods-ready-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())
	samples, sandboxes, uncaptured := stopSampling()
	figure(t, "reboot-capture-samples", samples)
	figure(t, "reboot-sandboxes-sampled", fmt.Sprintf("%d of %d pods", sandboxes, len(before)))
	figure(t, "reboot-pods-seen-uncaptured", len(uncaptured))
	if len(uncaptured) > 0 {
		t.Errorf("ambient pods ran uncaptured while the node came back:\n%s", strings.Join(uncaptured, "\n"))
	}
	if err := l.waitRestarted(ctx, sinkNS, "sink", oldSink); err != nil {
		t.Fatal(err)
	}
	live := l.livePods(t)
	for _, name := range ready {
		p := l.pod(t, name)
		id, err := l.n.SandboxID(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Error(err)
			continue
		}
		ns, err := l.n.PodNetns(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Error(err)
			continue
		}
		if b := before[name]; id == b.sandbox || ns == b.netns {
			t.Errorf("%s: sandbox %s netns %s, before the reboot %s %s: not new", name, id, ns, b.sandbox, b.netns)
		}
		l.mustCaptured(t, p)
		if err := l.n.Poll(ctx, "probes of "+name, func(ctx context.Context) (bool, error) {
			_, err := l.n.probedFromSNAT(ctx, p)
			return err == nil, err
		}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if err := l.n.Poll(ctx, name+"'s hello", func(ctx context.Context) (bool, error) {
			c, err := l.hellos(ctx, "/hello-"+name)
			return c > 0, err
		}); err != nil {
			t.Error(err)
		} else if !l.startedCaptured(t, p) {
			t.Errorf("%s came back uncaptured: its hello at start bypassed the stand-in", name)
		}
	}
	if err := l.n.Poll(ctx, "the stand-in serves exactly the live pods", func(ctx context.Context) (bool, error) {
		err := l.standInViewIsLive(ctx, live)
		return err == nil, err
	}); err != nil {
		t.Error(err)
	}
	if err := l.n.Poll(ctx, "the agent holds only live pods", func(ctx context.Context) (bool, error) {
		pods, err := l.n.AgentState(ctx)
		if err != nil {
			return false, err
		}
		for _, a := range pods {
			if a.Namespace != lifeNS {
				continue
			}
			p, ok := live[a.UID]
			if !ok {
				return false, fmt.Errorf("the agent holds %s/%s (%s), not a live pod", a.Namespace, a.Name, a.UID)
			}
			if !slices.Equal(a.IPs, []string{p.Status.PodIP}) {
				return false, fmt.Errorf("the agent holds %s with addresses %v, the pod has %s", a.Name, a.IPs, p.Status.PodIP)
			}
		}
		return true, nil
	}); err != nil {
		t.Error(err)
	}
	// Pods that lost their netns left no host probe address behind.
	members, _, err := hostProbeSet()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range members {
		found := false
		for _, p := range live {
			found = found || p.Status.PodIP == m
		}
		if !found {
			t.Errorf("the host probe set holds %s, no live ambient pod's address", m)
		}
	}
}
