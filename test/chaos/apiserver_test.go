package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/scrape"
)

// apiPending are the API-outage checks waiting for fixes being made on
// other branches (see judge): none. (Known pods starting during the outage
// waited for the annotation writer off the ADD path, issue 12 item 4.)
var apiPending = pending{}

// outage is how long the API server stays away (issue 12: 30 s).
const outage = 30 * time.Second

// outageVerifyPeriod is the agent's verify period in the outage test.
const outageVerifyPeriod = time.Second

// Leak tolerances after an outage, against the same agent's figures before
// it: what a long-lived process may legitimately vary by (an HTTP/2
// connection redialled, a timer goroutine), far below what one leaked
// goroutine or descriptor per pod or per retry would add.
const (
	outageFDSlack        = 4
	outageGoroutineSlack = 10
)

// TestAPIServerOutage is issue 12's third fault: the API server stops for
// 30 s while pods start and stop. The agent reaches it through a proxy that
// is cut a moment before the API server stops, so pods created in that
// moment are unknown to the agent's cache. During the outage, pods whose
// enablement the cache knows must keep starting (captured or not, as
// their namespace says), sandboxes must be deleted and recreated, and
// unknown pods in an ambient namespace must fail closed with a retryable
// error (CNI code 11), then start once the API server is back. The
// redirection annotations the ADDs of the outage could not write are owed,
// and written once the API server is back. The agent must neither exit nor
// leak. Then the agent is restarted while the API
// server is away again: it must wait for it, not crash-loop.
func TestAPIServerOutage(t *testing.T) {
	requireLong(t)
	env := kubeenv.Start(t) // its own: this test stops it
	proxy := newAPIProxy(t, env.Config.Host)
	// Every pod proven every second: the verifier looks at each sandbox
	// recreated during the outage while the pod's status, frozen by it,
	// still shows the old sandbox's IPs (that window lasts until kubelet's
	// status write after the outage), whatever the machine's load.
	n := newNode(t, nodeOptions{env: env, apiHost: proxy.URL(), subnet: netip.MustParsePrefix("10.121.0.0/16"), verifyPeriod: outageVerifyPeriod})
	w := newWorld(n)
	amb := w.namespace("amb", ambient.DataplaneModeAmbient)
	plain := w.namespace("plain", "")
	ctx := runContext(t)
	rng := rand.New(rand.NewPCG(1, 2)) // back-off jitter only

	var up []*kubesim.Pod
	for i := range 6 {
		ns := amb
		if i >= 4 {
			ns = plain
		}
		p, err := w.run(ctx, rng, podObject(ns, fmt.Sprintf("up-%d", i), ""))
		if err != nil {
			t.Fatal(err)
		}
		up = append(up, p)
	}
	// Pods the agent's cache knows, not started yet.
	var known []*corev1.Pod
	for i := range 6 {
		ns := amb
		if i >= 4 {
			ns = plain
		}
		obj, err := n.kube.Create(ctx, podObject(ns, fmt.Sprintf("known-%d", i), ""))
		if err != nil {
			t.Fatal(err)
		}
		known = append(known, obj)
	}
	n.waitCacheHas(ctx, plain)
	n.idle(time.Minute)
	base, err := n.usage()
	if err != nil {
		t.Fatal(err)
	}
	agent := n.sim.Agent()

	// The agent loses the API server; pods created now are unknown to it.
	proxy.Cut()
	var unknown []*corev1.Pod
	for i := range 3 {
		obj, err := n.kube.Create(ctx, podObject(amb, fmt.Sprintf("unknown-%d", i), ""))
		if err != nil {
			t.Fatal(err)
		}
		unknown = append(unknown, obj)
	}
	env.StopAPIServer()
	began := time.Now()
	t.Logf("API server stopped (agent %s)", base)

	type outcome struct {
		p      *kubesim.Pod
		failed []error
		err    error
		at     time.Time
	}
	// Every pod is retried as kubelet does until it starts: known pods
	// must start during the outage, unknown ones only after it.
	var wg sync.WaitGroup
	knownOut := make([]outcome, len(known))
	for i, obj := range known {
		wg.Go(func() {
			p, failed, err := w.startSandbox(ctx, rng, obj)
			knownOut[i] = outcome{p: p, failed: failed, err: err, at: time.Now()}
		})
	}
	// Sandboxes of running pods go away and come back (DEL, then ADD).
	recreated := make([]outcome, 2)
	for i, p := range []*kubesim.Pod{up[0], up[4]} {
		wg.Go(func() {
			if err := n.kube.Teardown(ctx, p); err != nil {
				recreated[i] = outcome{err: fmt.Errorf("DEL during the outage: %w", err)}
				return
			}
			w.tornDown(p)
			np, failed, err := w.startSandbox(ctx, rng, p.Obj)
			recreated[i] = outcome{p: np, failed: failed, err: err, at: time.Now()}
		})
	}
	unknownOut := make([]outcome, len(unknown))
	for i, obj := range unknown {
		wg.Go(func() {
			p, failed, err := w.startSandbox(ctx, rng, obj)
			unknownOut[i] = outcome{p: p, failed: failed, err: err, at: time.Now()}
		})
	}
	time.Sleep(time.Until(began.Add(outage))) // the outage lasts what it lasts
	if agent.Exited() || n.sim.Agent() != agent {
		t.Fatalf("the agent exited during the outage: %v; log tail:\n%s", agent.Err(), n.logTail(30, false))
	}
	if err := env.StartAPIServer(ctx, 2*time.Minute); err != nil {
		t.Fatal(err)
	}
	proxy.Resume()
	back := time.Now()
	t.Logf("API server back after %v", back.Sub(began).Round(time.Second))

	wg.Wait()
	problems := results{}
	// The ambient pods started during the outage could not be annotated
	// then: the agent owes the writes and makes them now, before any
	// status update (kubelet's, below) brings the pods back to it.
	var owed []*corev1.Pod
	for i, o := range knownOut {
		if o.p != nil && w.shouldCapture(known[i]) {
			owed = append(owed, known[i])
		}
	}
	if recreated[0].p != nil {
		owed = append(owed, up[0].Obj)
	}
	if len(owed) == 0 {
		problems.add(checkOutageAnnotated, "no ambient pod started during the outage")
	}
	problems[checkOutageAnnotated] = append(problems[checkOutageAnnotated], n.waitAnnotated(ctx, owed, 2*time.Minute)...)
	names := append(append([]*corev1.Pod{}, known...), up[0].Obj, up[4].Obj)
	for i, o := range append(append([]outcome{}, knownOut...), recreated...) {
		nm := names[i].Namespace + "/" + names[i].Name
		switch {
		case o.err != nil:
			problems.add(checkOutageKnownStart, "%s: %v", nm, o.err)
		case o.at.After(back):
			problems.add(checkOutageKnownStart, "%s started only after the outage: %d ADDs failed, the first: %v", nm, len(o.failed), o.failed[0])
		default:
			// A handoff ztunnel did not ack in time (the stand-in starved
			// on a busy machine) fails an ADD retryably whatever the API
			// server does: not the outage's failure, only logged.
			var outage []error
			for _, err := range o.failed {
				if strings.Contains(err.Error(), " to ztunnel: ") {
					t.Logf("%s: an ADD failed on ztunnel's handoff, not on the outage: %v", nm, err)
					continue
				}
				outage = append(outage, err)
			}
			if len(outage) > 0 {
				problems.add(checkOutageKnownStart, "%s started during the outage after %d failed ADDs (first: %v)", nm, len(outage), outage[0])
			}
		}
	}
	for i, o := range unknownOut {
		nm := unknown[i].Namespace + "/" + unknown[i].Name
		switch {
		case o.err != nil:
			problems.add(checkOutageUnknown, "%s never started: %v", nm, o.err)
		case len(o.failed) == 0 || o.at.Before(back):
			problems.add(checkOutageUnknown, "%s started during the outage (its enablement was unknown)", nm)
		}
		for _, err := range o.failed {
			if code := cniCode(err); code != cnitypes.ErrTryAgainLater {
				problems.add(checkOutageUnknown, "%s: ADD failed with CNI code %d, not %d (try again later): %v", nm, code, cnitypes.ErrTryAgainLater, err)
				break
			}
		}
	}
	// Kubelet catches up with the status of what it started meanwhile.
	for _, o := range append(append(knownOut, recreated...), unknownOut...) {
		if o.p != nil {
			if err := w.writeStatus(ctx, o.p); err != nil {
				t.Fatal(err)
			}
		}
	}
	n.waitReady(waitReadyTimeout)
	r := w.settle(ctx, 90*time.Second, apiPending)
	for c, v := range problems {
		r[c] = append(r[c], v...)
	}
	// up-0's new sandbox, captured by its ADD, was proven every second
	// while its status still showed the old sandbox's IPs: a status the
	// outage froze is not drift.
	if m, err := scrape.Values(n.metricsURL(), sandboxDrift); err != nil {
		r.add(checkOutageVerifier, "read the drift counter: %v", err)
	} else if v, ok := m[sandboxDrift]; !ok || v != 0 {
		r.add(checkOutageVerifier, "%s is %v (present %v), want 0", sandboxDrift, v, ok)
	}
	t.Logf("%s", w.summary())

	// The same agent, idle again: nothing leaked.
	n.idle(time.Minute)
	after, err := n.usage()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent before the outage: %s; after: %s", base, after)
	switch {
	case n.sim.Agent() != agent || agent.Exited():
		r.add(checkOutageLeak, "the agent was replaced or exited: %v", n.crashes())
	case after.fds-after.netns > base.fds-base.netns+outageFDSlack:
		r.add(checkOutageLeak, "descriptors other than pods' netns: %d before, %d after", base.fds-base.netns, after.fds-after.netns)
	case after.goroutines > base.goroutines+outageGoroutineSlack:
		r.add(checkOutageLeak, "goroutines: %d before, %d after", base.goroutines, after.goroutines)
	}
	judge(t, r, apiPending)
	for _, c := range []string{checkOutageKnownStart, checkOutageAnnotated, checkOutageUnknown, checkOutageVerifier, checkOutageLeak} {
		judgeOne(t, c, r[c], apiPending)
	}
	if t.Failed() {
		return
	}

	t.Run("agent restarted while the API server is away", func(t *testing.T) {
		proxy.Cut()
		late, err := n.kube.Create(ctx, podObject(amb, "late", ""))
		if err != nil {
			t.Fatal(err)
		}
		env.StopAPIServer()
		began := time.Now()
		n.killAgent()
		n.startAgent()
		restarted := n.sim.Agent()
		var lateOut outcome
		var lwg sync.WaitGroup
		lwg.Go(func() {
			p, failed, err := w.startSandbox(ctx, rng, late)
			lateOut = outcome{p: p, failed: failed, err: err, at: time.Now()}
		})
		time.Sleep(time.Until(began.Add(outage))) // the whole outage: an agent that gives up on the API server would exit within it
		if restarted.Exited() {
			t.Fatalf("the agent started during the outage exited: %v; log tail:\n%s", restarted.Err(), n.logTail(30, false))
		}
		if n.ready() {
			t.Error("the agent reports ready without having seen the API server")
		}
		if err := env.StartAPIServer(ctx, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		proxy.Resume()
		back := time.Now()
		n.waitReady(waitReadyTimeout)
		lwg.Wait()
		r := results{}
		switch {
		case lateOut.err != nil:
			r.add(checkOutageUnknown, "late never started: %v", lateOut.err)
		case len(lateOut.failed) == 0 || lateOut.at.Before(back):
			r.add(checkOutageUnknown, "late started while the restarted agent could not know it")
		default:
			if err := w.writeStatus(ctx, lateOut.p); err != nil {
				t.Fatal(err)
			}
		}
		for _, err := range lateOut.failed {
			if code := cniCode(err); code != cnitypes.ErrTryAgainLater {
				r.add(checkOutageUnknown, "late: ADD failed with CNI code %d: %v", code, err)
				break
			}
		}
		settled := w.settle(ctx, 90*time.Second, apiPending)
		for c, v := range r {
			settled[c] = append(settled[c], v...)
		}
		if c := n.crashes(); len(c) > 0 || n.sim.Agent() != restarted {
			settled.add(checkOutageLeak, "the restarted agent exited: %s", strings.Join(c, "\n"))
		}
		judge(t, settled, apiPending)
		for _, c := range []string{checkOutageUnknown, checkOutageLeak} {
			judgeOne(t, c, settled[c], apiPending)
		}
	})
}

// The outage's own checks, reported after world.verify's.
const (
	checkOutageKnownStart = "pods known from the cache start during the outage"
	checkOutageAnnotated  = "annotations owed from the outage are written once it ends"
	checkOutageUnknown    = "unknown pods fail closed (retryable) and start after it"
	checkOutageVerifier   = "the verifier finds no sandbox drift in a status the outage froze"
	checkOutageLeak       = "the agent neither exits nor leaks"
)

// sandboxDrift is the verifier's counter of recreated sandboxes it found.
const sandboxDrift = `ambient_cni_verify_drift_total{kind="sandbox"}`

// tornDown records that a pod's sandbox is gone while its object stays.
func (w *world) tornDown(p *kubesim.Pod) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.running, p.Obj.UID)
}

// waitCacheHas waits until the agent's pod cache has seen every pod
// created in the API so far: it creates a pod labelled ambient in ns (a
// namespace not labelled), which turns pod-level enablement on in the
// plugin's snapshot file once the agent's cache has it; pod events come in
// order, so every pod created before it is in the cache too.
func (n *node) waitCacheHas(ctx context.Context, ns string) {
	n.t.Helper()
	if _, err := n.kube.Create(ctx, podObject(ns, "cache-marker", ambient.DataplaneModeAmbient)); err != nil {
		n.t.Fatal(err)
	}
	var s *nodefiles.EnablementSnapshot
	var err error
	if poll.Wait(ctx, time.Minute, func() bool {
		s, err = nodefiles.ReadSnapshot(n.cfg.Layout().Snapshot())
		return err == nil && s.PodLevelEnablement
	}) != nil {
		n.t.Fatalf("the agent's cache did not show the marker pod within a minute (snapshot %+v, %v)", s, err)
	}
}

// waitAnnotated waits until every pod carries the redirection annotation
// enabled, and returns a violation for each that does not within d.
func (n *node) waitAnnotated(ctx context.Context, pods []*corev1.Pod, d time.Duration) []string {
	var missing []string
	_ = poll.Wait(ctx, d, func() bool {
		missing = nil
		for _, p := range pods {
			o, err := n.env.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
			switch {
			case err != nil:
				missing = append(missing, fmt.Sprintf("%s/%s: %v", p.Namespace, p.Name, err))
			case o.Annotations[ambient.RedirectionAnnotation] != ambient.RedirectionEnabled:
				missing = append(missing, fmt.Sprintf("%s/%s: annotation %q %v after the API server came back",
					p.Namespace, p.Name, o.Annotations[ambient.RedirectionAnnotation], d))
			}
		}
		return len(missing) == 0
	})
	return missing
}
