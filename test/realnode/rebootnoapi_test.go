//go:build realnode

package realnode

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// A reboot during which neither the agent nor the API server answers the
// plugin, and the namespace of a running plain pod is labelled ambient
// while the node is down: the snapshot on disk, written before, lists the
// pod as not captured, and must not be taken at its word.

// testLabelledWhileDownNoAPI: a plain pod runs; the node goes down
// (Node.Reboot); while it is down its namespace is labelled ambient, the
// agent is upgraded to an image the node cannot pull (it never serves
// after the boot) and the plugin's path to the API server goes. At boot
// kubelet recreates the pod's sandbox: the pod waits, refused by the
// plugin (code 11) for want of its labels, and no sample of its sandbox
// shows it ready without rules; a pod of istio-system starts meanwhile on
// the snapshot's word. Once the API path and the agent are back, the pod
// starts captured.
//
// Which path is cut. kubelet, the agent and the plugin's credential all
// reach the API server at 127.0.0.1 on this node, and kubelet must keep
// reaching it (it recreates the sandboxes and reports the refusals). On a
// cluster the agent and the plugin's credential use the kubernetes
// Service's address (or apiServer.host), which kube-proxy may not have
// programmed yet at boot, while kubelet has an address of its own. The
// test builds that: the chart's apiServer.port points the agent, hence the
// credential it writes, at a proxy of the test's to the API server, and
// stopping the proxy while the node is down is the Service address not
// answering at boot. kubelet's path is untouched; nothing matches
// processes (all of the node's run as root in one cgroup).
func (l *life) testLabelledWhileDownNoAPI(t *testing.T) {
	ctx := context.Background()
	l.stopTraffic()
	proxy, err := startLoopbackProxy(0, l.n.APIPort)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.stop() })
	port := proxy.port()
	viaProxy := []string{"--set", "apiServer.port=" + strconv.Itoa(port)}
	stopped := false
	apiBack := func() {
		if !stopped {
			return
		}
		p, err := startLoopbackProxy(port, l.n.APIPort)
		if err != nil {
			t.Errorf("the plugin's path to the API server back: %v", err)
			return
		}
		proxy, stopped = p, false
	}
	restore := l.restoreChartOnFailure(t, apiBack)
	if err := l.n.InstallAgent(ctx, "upgrade", ImageTag, viaProxy...); err != nil {
		t.Fatal(err)
	}
	if err := l.n.Poll(ctx, "the plugin's credential names the proxy", func(context.Context) (bool, error) {
		f, err := plugincred.Read(l.n.Layout().PluginCredential())
		if err != nil {
			return false, err
		}
		if !strings.HasSuffix(f.Server, ":"+strconv.Itoa(port)) {
			return false, fmt.Errorf("the credential's server is %s", f.Server)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}

	suffix := randHex(4)
	ns, name := "labelled-"+suffix, "plain-"+suffix
	l.namespace(t, ns, false)
	p := l.startsUncaptured(t, l.createHello(t, ns, name))
	oldContainer := p.Status.ContainerStatuses[0].ContainerID
	// The snapshot the reboot keeps lists the pod as not captured, and its
	// namespace as not enabled: the word the plugin must not take.
	if err := l.n.Poll(ctx, "the snapshot lists "+name+" as not captured", func(context.Context) (bool, error) {
		s, err := nodefiles.ReadSnapshot(l.n.Layout().StateSnapshot())
		if err != nil {
			return false, err
		}
		if captured, listed := s.Pods[string(p.UID)]; !listed || captured || slices.Contains(s.EnabledNamespaces, ns) {
			return false, fmt.Errorf("the snapshot of %s: pod listed %v, captured %v; enabled namespaces %v", s.Written, listed, captured, s.EnabledNamespaces)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}

	var stopSampling func() (int, int, []string)
	begin := time.Now()
	l.rebootAgentAway(t, func() error {
		// The namespace is labelled elsewhere while the node is down.
		patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
		if _, err := l.n.Client.CoreV1().Namespaces().Patch(ctx, ns, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			return err
		}
		proxy.stop()
		stopped = true
		stopSampling = l.sampleCaptureIn(ns, lifeNS)
		t.Cleanup(func() { stopSampling() })
		return l.n.UpgradeAgentNoWait(ctx, missingTag, viaProxy...)
	}, agentCannotPull)

	// The pod waits: the plugin refuses its sandbox, saying why. It must
	// not run meanwhile (started uncaptured).
	// The refusal names the proxy's address: the path cut is the
	// plugin's.
	proxyAddr := "127.0.0.1:" + strconv.Itoa(port)
	var started string
	err = l.n.Poll(ctx, name+" refused by the plugin", func(ctx context.Context) (bool, error) {
		s, err := l.runsAgain(ctx, ns, name, oldContainer)
		if s != "" || err != nil {
			started = s
			return s != "", err
		}
		msg, err := l.plainRefusal(ctx, p, proxyAddr)
		if msg != "" {
			t.Logf("%s/%s: %s", ns, name, msg)
		}
		return msg != "", err
	})
	if started != "" {
		t.Fatalf("%s/%s started uncaptured while neither the agent nor the API server could answer the plugin, its namespace labelled ambient while the node was down: %s", ns, name, started)
	}
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "labelled-while-down-refused-after-reboot-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())

	// The control plane starts on the snapshot's word.
	created := time.Now()
	cp := l.createHello(t, ReleaseNamespace, "cp-"+suffix)
	t.Cleanup(func() {
		_ = l.n.Client.CoreV1().Pods(ReleaseNamespace).Delete(context.Background(), cp.Name, metav1.DeleteOptions{})
	})
	l.startsUncaptured(t, cp)
	figure(t, "labelled-while-down-istio-system-pod-ready-seconds", time.Since(created).Round(100*time.Millisecond).Seconds())
	if started, err := l.runsAgain(ctx, ns, name, oldContainer); started != "" || err != nil {
		t.Fatalf("%s/%s while neither the agent nor the API server can answer: started %s (%v), want it waiting", ns, name, started, err)
	}

	// The API path, then the agent, come back: the pod starts captured.
	back := time.Now()
	if err := restore(); err != nil {
		t.Fatal(err)
	}
	if err := l.waitRestarted(ctx, ns, name, oldContainer); err != nil {
		l.logEvents(t, p)
		t.Fatal(err)
	}
	ready, err := l.n.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "labelled-while-down-ready-after-return-seconds", time.Since(back).Round(100*time.Millisecond).Seconds())
	l.mustCaptured(t, ready)
	// The reboot emptied the sink's log: every hello it holds is from
	// the new sandbox.
	if err := l.n.Poll(ctx, name+"'s hello", func(ctx context.Context) (bool, error) {
		c, err := l.hellos(ctx, "/hello-"+name)
		return c > 0, err
	}); err != nil {
		t.Error(err)
	} else if !l.startedCaptured(t, ready) {
		t.Errorf("%s/%s started uncaptured once the agent returned: its hello at start bypassed the stand-in", ns, name)
	}
	samples, sandboxes, uncaptured := stopSampling()
	figure(t, "labelled-while-down-capture-samples", samples)
	figure(t, "labelled-while-down-sandboxes-sampled", sandboxes)
	figure(t, "labelled-while-down-pods-seen-uncaptured", len(uncaptured))
	if len(uncaptured) > 0 {
		t.Errorf("pods ran uncaptured while the node came back:\n%s", strings.Join(uncaptured, "\n"))
	}
}

// runsAgain says how pod ns/name runs after the reboot ("" while it does
// not): a ready sandbox (the plugin let it through), or a container other
// than old (the one before the reboot) running. The pod's status may
// still show old running until kubelet reports again.
func (l *life) runsAgain(ctx context.Context, ns, name, old string) (string, error) {
	sbs, err := l.readySandboxes(ctx, []string{ns})
	if err != nil {
		return "", err
	}
	for _, sb := range sbs {
		if sb.pod != ns+"/"+name {
			continue
		}
		rules, err := l.sandboxRules(ctx, sb.id)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("sandbox %s ready, capture rules in its netns: %v", sb.id, HasCaptureRules(rules)), nil
	}
	cur, err := l.n.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	for _, cs := range cur.Status.ContainerStatuses {
		if cs.State.Running != nil && cs.ContainerID != old {
			return "container " + cs.ContainerID + " running: " + podSummary(cur), nil
		}
	}
	return "", nil
}

// plainRefusal returns the plugin's refusal of p's sandbox for want of
// its labels ("" if none yet): the agent cannot answer, the API server
// cannot be asked at addr, and the snapshot may predate a label.
func (l *life) plainRefusal(ctx context.Context, p *corev1.Pod, addr string) (string, error) {
	evs, err := l.n.PodEvents(ctx, p.Namespace, p.Name)
	if err != nil {
		return "", err
	}
	for _, ev := range evs {
		if ev.Reason == "FailedCreatePodSandBox" && strings.Contains(ev.Message, "ambient-cni:") &&
			strings.Contains(ev.Message, "the API server cannot be asked") && strings.Contains(ev.Message, addr) &&
			strings.Contains(ev.Message, "labels are unknown") {
			return ev.Message, nil
		}
	}
	return "", nil
}
