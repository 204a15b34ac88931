package nodeagent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestServerNetnsCheckedOnlyForCapture: a netns path outside the allowed
// roots (a wrong netnsDirs setting) fails only pods that will be captured;
// pods that stay outside the mesh start, and their CHECK passes.
func TestServerNetnsCheckedOnlyForCapture(t *testing.T) {
	s := newServer(t, []string{t.TempDir()}, nil)
	pn := testnet.NewNS(t) // under the runtime's dir, not under the root
	s.kube.SetPod(pod("plain", "web", "u1", nil))
	s.kube.SetPod(pod("shop", "web", "u2", nil))
	out := addEvent(pn.Path())
	out.PodNamespace = "plain"
	if resp, err := s.send(t, out); err != nil || resp.Verdict != ambient.VerdictNotEnrolled {
		t.Errorf("ADD of a pod outside the mesh = %+v, %v; want not-enrolled", resp, err)
	}
	out.Command = ambient.CommandCheck
	if resp, err := s.send(t, out); err != nil || resp.Verdict != ambient.VerdictOK {
		t.Errorf("CHECK of a pod outside the mesh = %+v, %v", resp, err)
	}
	in := addEvent(pn.Path())
	in.PodUID = "u2"
	if resp, err := s.send(t, in); err != nil || resp.Error == "" || resp.Retryable || !strings.Contains(resp.Error, "not under an allowed root") {
		t.Errorf("ADD of a pod to capture = %+v, %v; want the netns refused", resp, err)
	}
}

// TestServerControlPlaneWithoutAPIServer: with the API server down, an ADD
// of a pod the agent's cache does not hold yet starts it uncaptured when
// its namespace is a control-plane one the cache does not show enabled,
// recorded to be decided again (its CHECK agrees); any other such pod,
// and one the API server says does not exist, waits (retryable). Once the
// cache holds the pod, the re-check decides it: captured, as its labels
// say.
func TestServerControlPlaneWithoutAPIServer(t *testing.T) {
	s := newServer(t, nil, func(c *ServerConfig) { c.ControlPlaneNamespaces = []string{"istio-system", "openshift-*", "mesh-cp"} })
	s.kube.SetNamespace(namespace("istio-system", false))
	s.kube.SetNamespace(namespace("mesh-cp", true))
	s.kube.Client.PrependReactor("get", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if name := a.(k8stesting.GetAction).GetName(); name == "gone" {
			return true, nil, apierrors.NewNotFound(corev1.Resource("pods"), name)
		}
		return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
	})
	pn := testnet.NewNS(t)
	ev := func(ns, name, uid string) *ambient.PodEvent {
		return &ambient.PodEvent{Command: ambient.CommandAdd, PodName: name, PodNamespace: ns, PodUID: uid, SandboxID: "sb-" + uid, Netns: pn.Path(), IPs: []string{"10.9.0.5"}}
	}
	for _, c := range []struct {
		ev    *ambient.PodEvent
		start bool
	}{
		{ev("istio-system", "istiod", "u1"), true},
		{ev("openshift-dns", "dns", "u2"), true}, // its namespace not in the cache either
		{ev("mesh-cp", "web", "u3"), false},      // the cache shows the namespace enabled
		{ev("plain", "web", "u4"), false},
		{ev("istio-system", "gone", "u5"), false}, // the API server answered: no such pod
	} {
		resp, err := s.send(t, c.ev)
		name := c.ev.PodNamespace + "/" + c.ev.PodName
		switch {
		case err != nil:
			t.Errorf("ADD %s: %v", name, err)
		case c.start && resp.Verdict != ambient.VerdictNotEnrolled:
			t.Errorf("ADD %s = %+v; want it started uncaptured", name, resp)
		case !c.start && (resp.Error == "" || !resp.Retryable):
			t.Errorf("ADD %s = %+v; want it to wait (retryable)", name, resp)
		}
		check := *c.ev
		check.Command = ambient.CommandCheck
		if resp, err := s.send(t, &check); err != nil || (resp.Error == "") != c.start {
			t.Errorf("CHECK %s = %+v, %v; want it to agree with ADD", name, resp, err)
		}
	}
	entries, err := nodefiles.ListAdds(s.layout.AddSpool())
	var uids []string
	for _, e := range entries {
		uids = append(uids, e.Event.PodUID)
	}
	slices.Sort(uids)
	if err != nil || !slices.Equal(uids, []string{"u1", "u2"}) {
		t.Fatalf("ADD spool holds %v, %v; want the two pods started", uids, err)
	}
	if n := len(s.agent.Pods()); n != 0 {
		t.Fatalf("%d pods captured while their labels were unknown", n)
	}
	// The watch catches up: istiod turns out labelled ambient.
	s.kube.SetPod(pod("istio-system", "istiod", "u1", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}))
	if _, err := s.srv.RecheckPassedThrough(t.Context()); err != nil {
		t.Fatal(err)
	}
	if pods := s.agent.Pods(); len(pods) != 1 || pods[0].UID != "u1" {
		t.Errorf("captured after the re-check: %+v; want istio-system/istiod", pods)
	}
}

// TestCaptureRefusesAnotherLivePodsNetns: an ADD naming the namespace a
// different enrolled pod holds, by its path or a symlink to it, is refused
// as invalid; once that pod is gone (no live holder) the namespace is no
// one's.
func TestCaptureRefusesAnotherLivePodsNetns(t *testing.T) {
	s := newServer(t, nil, nil)
	pn := testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "web", "u1", nil))
	s.kube.SetPod(pod("shop", "evil", "u2", nil))
	if resp, err := s.send(t, addEvent(pn.Path())); err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Fatalf("ADD = %+v, %v", resp, err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(pn.Path(), link); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{pn.Path(), link} {
		ev := &ambient.PodEvent{Command: ambient.CommandAdd, PodName: "evil", PodNamespace: "shop", PodUID: "u2", SandboxID: "sb2", Netns: path, IPs: []string{"10.9.0.6"}}
		resp, err := s.send(t, ev)
		if err != nil || resp.Error == "" || resp.Retryable || !strings.Contains(resp.Error, "live pod shop/web") {
			t.Errorf("ADD of another pod in %s = %+v, %v; want refused", path, resp, err)
		}
	}
	if got := s.zt.addCount("u2"); got != 0 {
		t.Errorf("ztunnel got the second pod %d times", got)
	}
	if resp, err := s.send(t, &ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "sb1", PodUID: "u1", PodName: "web", PodNamespace: "shop"}); err != nil || resp.Error != "" {
		t.Fatalf("DEL = %+v, %v", resp, err)
	}
	ev := &ambient.PodEvent{Command: ambient.CommandAdd, PodName: "evil", PodNamespace: "shop", PodUID: "u2", SandboxID: "sb2", Netns: pn.Path(), IPs: []string{"10.9.0.6"}}
	if resp, err := s.send(t, ev); err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Errorf("ADD once no live pod holds the netns = %+v, %v", resp, err)
	}
}

// TestRecheckPassedThrough: a serving agent refreshes its heartbeat, and
// re-checks the pods the plugin let through while it was gone: it captures
// those that should be, and forgets those decided out or gone.
func TestRecheckPassedThrough(t *testing.T) {
	s := newServer(t, nil, nil)
	hb := s.layout.Heartbeat()
	poll.Until(t, "heartbeat written", func() bool { _, err := nodefiles.LastAlive(hb); return err == nil })

	in, out := testnet.NewNS(t), testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "late", "u1", nil))
	s.kube.SetPod(pod("plain", "web", "u2", nil))
	dir := s.layout.AddSpool()
	for _, ev := range []ambient.PodEvent{
		{Command: ambient.CommandAdd, PodName: "late", PodNamespace: "shop", PodUID: "u1", SandboxID: "sb1", Netns: in.Path(), IPs: []string{"10.9.0.5"}},
		{Command: ambient.CommandAdd, PodName: "web", PodNamespace: "plain", PodUID: "u2", SandboxID: "sb2", Netns: out.Path(), IPs: []string{"10.9.0.6"}},
		{Command: ambient.CommandAdd, PodName: "gone", PodNamespace: "shop", PodUID: "u3", SandboxID: "sb3", Netns: "/var/run/netns/none-such", IPs: []string{"10.9.0.7"}},
	} {
		if err := nodefiles.Spool(dir, ev); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.srv.RecheckPassedThrough(t.Context()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "ADD spool drained", func() bool { e, _ := nodefiles.ListAdds(dir); return len(e) == 0 })
	pods := s.agent.Pods()
	if len(pods) != 1 || pods[0].UID != "u1" || pods[0].SandboxID != "sb1" {
		t.Errorf("enrolled after re-check: %+v; want only shop/late", pods)
	}
}

// TestGCOnlyItsNetwork: a GC for one CNI network forgets only the stale
// sandboxes attached through it: a pod attached through another conflist
// (as with Multus), or of no known network, stays; a GC naming no network
// (an older plugin) considers all.
func TestGCOnlyItsNetwork(t *testing.T) {
	s := newServer(t, nil, nil)
	for _, p := range []struct{ name, uid, network string }{{"a", "ua", "net-a"}, {"b", "ub", "net-b"}, {"c", "uc", ""}} {
		s.kube.SetPod(pod("shop", p.name, p.uid, nil))
		ev := &ambient.PodEvent{Command: ambient.CommandAdd, PodName: p.name, PodNamespace: "shop", PodUID: p.uid, SandboxID: "sb-" + p.name,
			Netns: testnet.NewNS(t).Path(), IPs: []string{"10.9.0.5"}, Network: p.network}
		if resp, err := s.send(t, ev); err != nil || resp.Verdict != ambient.VerdictEnrolled {
			t.Fatalf("ADD %s = %+v, %v", p.name, resp, err)
		}
	}
	gc := func(network string) {
		t.Helper()
		resp, err := (&ambient.Client{Socket: s.sock}).GC(t.Context(), &ambient.GCRequest{ValidSandboxIDs: []string{}, Network: network})
		if err != nil || resp.Verdict != ambient.VerdictOK {
			t.Fatalf("GC %q = %+v, %v", network, resp, err)
		}
	}
	names := func() string {
		var out []string
		for _, p := range s.agent.Pods() {
			out = append(out, p.Name+"@"+p.Network)
		}
		slices.Sort(out)
		return strings.Join(out, ",")
	}
	gc("net-b")
	if got := names(); got != "a@net-a,c@" {
		t.Errorf("after GC of net-b: %s; want a and c kept", got)
	}
	s.restart(t) // the network survives in the capture record
	if err := s.agent.LoadRecords(); err != nil {
		t.Fatal(err)
	}
	for _, r := range s.agent.records.all() {
		if r.Name == "a" && r.Network != "net-a" {
			t.Errorf("record of a names network %q", r.Network)
		}
	}
}

// eventLog records events (the agent's EventRecorder).
type eventLog struct {
	mu  sync.Mutex
	got []string
}

func (l *eventLog) Eventf(_ runtime.Object, eventtype, reason, format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, eventtype+" "+reason+": "+fmt.Sprintf(format, args...))
}

// TestCaptureReportsInvalidAnnotation: a boolean annotation that does not
// parse is ignored (the default applies) and said so in a Warning event.
func TestCaptureReportsInvalidAnnotation(t *testing.T) {
	h := newHarness(t)
	events := &eventLog{}
	cfg := h.config()
	cfg.Events, cfg.DNSCapture = events, true
	cfg.Layout = nodefiles.InDir(t.TempDir())
	a, err := NewAgent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close(); requireNoInvalidTransitions(t, a) })
	p := pod("shop", "typo", "u-typo", nil)
	p.Annotations = map[string]string{ambient.DNSCaptureAnnotation: "maybe"}
	if err := a.Capture(t.Context(), p, openNS(t, testnet.NewNS(t)), &Sandbox{ID: "sb-typo"}); err != nil {
		t.Fatal(err)
	}
	if pods := a.Pods(); len(pods) != 1 || !pods[0].Rules.DNSCapture {
		t.Errorf("captured %+v; want DNS capture by default", pods)
	}
	events.mu.Lock()
	defer events.mu.Unlock()
	if len(events.got) != 1 || !strings.Contains(events.got[0], `Warning AmbientInvalidAnnotation: annotation ambient.istio.io/dns-capture="maybe" is not a boolean`) {
		t.Errorf("events %q", events.got)
	}
}
