package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	cnitypes "github.com/containernetworking/cni/pkg/types"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// errCrashed is what a faulty dependency returns once "the agent crashed"
// at its step: the agent cannot get past it, and the test then stops the
// daemon as a kill would leave things (nothing more is undone).
var errCrashed = errors.New("injected fault: the agent stops here")

// faults makes chosen side effects of the agent fail, to stop it at a
// step of its work. Install with nodeOptions.AgentHook = f.hook.
type faults struct {
	mu   sync.Mutex
	on   map[string]bool
	hits map[string]int
}

const (
	faultRemove   = "rules remove"
	faultAnnotate = "annotate"
)

func newFaults() *faults { return &faults{on: map[string]bool{}, hits: map[string]int{}} }

func (f *faults) set(kind string, on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.on[kind] = on
}

// trip reports whether kind fails now, counting the hit.
func (f *faults) trip(kind string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.on[kind] {
		f.hits[kind]++
		return true
	}
	return false
}

func (f *faults) hit(kind string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hits[kind]
}

func (f *faults) hook(c *nodeagent.Config) {
	c.Rules = faultyRules{Applier: c.Rules, f: f}
	c.Annotator = faultyAnnotator{Annotator: c.Annotator, f: f}
}

type faultyRules struct {
	ruleset.Applier
	f *faults
}

func (r faultyRules) Remove(netns string) error {
	if r.f.trip(faultRemove) {
		return errCrashed
	}
	return r.Applier.Remove(netns)
}

type faultyAnnotator struct {
	nodeagent.Annotator
	f *faults
}

func (a faultyAnnotator) SetRedirection(ctx context.Context, namespace, name string, uid types.UID, value string) error {
	if a.f.trip(faultAnnotate) {
		return errCrashed
	}
	return a.Annotator.SetRedirection(ctx, namespace, name, uid, value)
}

// recordDir is where the daemon keeps its capture records.
func (n *node) recordDir() string { return n.cfg.Layout().Records() }

// rt is the runtime configuration the simulated kubelet uses for p's
// sandbox, for CNI calls the test makes itself.
func rt(p *kubesim.Pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: p.SandboxID, NetNS: p.NS.Path(), IfName: "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", p.Obj.Namespace}, {"K8S_POD_NAME", p.Obj.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", p.SandboxID}, {"K8S_POD_UID", string(p.Obj.UID)},
		},
	}
}

// TestUnenrollCrashPointsRepaired (issue 12.5): the agent dies in the
// middle of unenrolling a pod, at each step in turn; the next agent
// finishes the job, so the pod ends with no rules, no annotation, no
// ztunnel workload, no probe-set entry and no record, never blackholed
// (rules left without a ztunnel workload).
func TestUnenrollCrashPointsRepaired(t *testing.T) {
	f := newFaults()
	n := newNode(t, nodeOptions{Upgrade: true, AgentHook: f.hook})
	plain := n.namespace("plain", nil)
	for _, point := range []string{faultRemove, faultAnnotate} {
		p := n.runPod(podSpec(plain, "p", ambientLabel, nil))
		n.waitEnrolled(waitLong, p)
		f.set(point, true)
		n.setPodMode(p, "") // the controller unenrolls it
		poll.Within(t, waitLong, "the agent reaching "+point, func() bool { return f.hit(point) > 0 })
		n.stopDaemon()
		f.set(point, false)
		t.Logf("agent stopped at %q: annotation %q, rules %v", point, n.annotation(p), n.hasRules(p))
		n.startDaemon()
		n.waitUnenrolled(p)
		if des, _ := os.ReadDir(n.recordDir()); len(des) != 0 {
			t.Errorf("crash at %q: capture records left: %d", point, len(des))
		}
		if err := n.kube.Delete(context.Background(), p); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPendingPodOfPreviousAgentEnabled (issue 12.4): a pod captured while
// no ztunnel answered is left pending by its agent; the next agent
// restores it, and once a ztunnel acks it in its snapshot the pod is
// annotated enabled (istiod only treats enabled pods as HBONE-capable).
func TestPendingPodOfPreviousAgentEnabled(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true, ZtunnelWait: time.Second, NoStandIn: true})
	shop := n.namespace("shop", nil)
	p := n.runPod(podSpec(shop, "p", nil, nil))
	n.setNamespaceMode(shop, ambient.DataplaneModeAmbient)
	poll.Within(t, waitLong, "the pod annotated pending", func() bool { return n.annotation(p) == ambient.RedirectionPending })
	if !n.hasRules(p) {
		t.Fatal("a pending pod has no rules")
	}
	n.stopDaemon()
	n.startDaemon()
	n.startStandIn(ztunnel.Faults{})
	n.waitEnrolled(waitLong, p)
}

// TestFailedAddConvergesOnSnapshot (issue 12.3): an ADD that failed
// because no ztunnel acked leaves the pod captured and pending while its
// sandbox lives; when a ztunnel connects, its snapshot's ack makes the pod
// enabled, without another ADD. (When the runtime tears the failed sandbox
// down instead, its DEL takes everything of the agent's away:
// TestZtunnelHandoff.)
func TestFailedAddConvergesOnSnapshot(t *testing.T) {
	n := newNode(t, nodeOptions{ZtunnelWait: time.Second, NoStandIn: true})
	shop := n.namespace("shop", ambientLabel)
	ctx := context.Background()
	obj, err := n.kube.Create(ctx, podSpec(shop, "p", nil, nil))
	if err != nil {
		t.Fatal(err)
	}
	p := &kubesim.Pod{Obj: obj, NS: testnet.NewNS(t), SandboxID: testnet.RandName("", 64)}
	conf := rt(p)
	t.Cleanup(func() { _ = n.kube.CNI.DelNetworkList(context.Background(), n.kube.Conf, conf) })
	_, err = n.kube.CNI.AddNetworkList(ctx, n.kube.Conf, conf)
	var cerr *cnitypes.Error
	if !errors.As(err, &cerr) || cerr.Code != 11 {
		t.Fatalf("ADD with no ztunnel: %v; want CNI error 11", err)
	}
	if !n.hasRules(p) {
		t.Fatal("the pending pod has no rules")
	}
	n.startStandIn(ztunnel.Faults{})
	poll.Within(t, waitLong, "the pod served and annotated enabled", func() bool {
		_, served := n.zt.Workload(string(obj.UID))
		return served && n.annotation(p) == ambient.RedirectionEnabled
	})
	for _, e := range n.d.Agent().Pods() {
		if e.UID == obj.UID && e.State != nodeagent.StateEnabled {
			t.Errorf("agent state %q", e.State)
		}
	}
}

// TestReplayedDelCleansPodNotRestored (issue 12.7): a pod deleted while
// no agent ran is not restored; its DEL, spooled by the plugin and
// replayed by the next agent, removes our rules from its namespace, which
// the runtime has not removed. Also for a pod an older agent captured
// (no capture record): the spooled DEL's netns path is enough.
func TestReplayedDelCleansPodNotRestored(t *testing.T) {
	for _, tc := range []struct {
		name       string
		dropRecord bool
	}{{"with record", false}, {"older agent without record", true}} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, nodeOptions{Upgrade: true})
			shop := n.namespace("shop", ambientLabel)
			p := n.runPod(podSpec(shop, "p", nil, nil))
			n.waitEnrolled(waitLong, p)
			ctx := context.Background()

			n.stopDaemon()
			zero := int64(0)
			if err := n.env.Client.CoreV1().Pods(shop).Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
				t.Fatal(err)
			}
			if err := n.kube.CNI.DelNetworkList(ctx, n.kube.Conf, rt(p)); err != nil {
				t.Fatalf("DEL while the agent is down: %v", err)
			}
			if spooled, _ := nodefiles.List(n.cfg.Layout().DelSpool()); len(spooled) != 1 {
				t.Fatalf("spooled DELs: %+v", spooled)
			}
			if tc.dropRecord {
				if err := os.RemoveAll(n.recordDir()); err != nil {
					t.Fatal(err)
				}
			}
			if !n.hasRules(p) {
				t.Fatal("the rules went before the agent came back")
			}
			n.startDaemon()
			if ipt, nft := n.ourRules(p.NS.Path()); ipt || nft {
				t.Errorf("rules left in the namespace of the pod deleted while the agent was down:\n%s", n.rulesDump(p))
			}
			if n.inProbeSet(p) {
				t.Error("its IP is still in the host probe set")
			}
			if _, ok := n.d.Agent().EnrolledUID(shop, "p"); ok {
				t.Error("the agent still knows the pod")
			}
			if des, _ := os.ReadDir(n.recordDir()); len(des) != 0 {
				t.Errorf("capture records left: %d", len(des))
			}
		})
	}
}

// TestDelOfControllerEnrolledPod (issue 10.2): a pod the controller
// enrolled (no sandbox id) is forgotten by the CNI DEL of its sandbox,
// found by the netns the DEL names; a DEL of another sandbox of the pod
// leaves its enrollment alone. The DEL writes no annotation: the pod
// object lives on (its sandbox is gone; a new one's ADD follows).
func TestDelOfControllerEnrolledPod(t *testing.T) {
	n := newNode(t, nodeOptions{})
	plain := n.namespace("plain", nil)
	p := n.runPod(podSpec(plain, "p", nil, nil))
	n.setNamespaceMode(plain, ambient.DataplaneModeAmbient)
	n.waitEnrolled(waitLong, p)
	ctx := context.Background()

	// A DEL for an older sandbox of the pod (its namespace still there).
	older := &kubesim.Pod{Obj: p.Obj, NS: testnet.NewNS(t), SandboxID: testnet.RandName("", 64)}
	if err := n.kube.CNI.DelNetworkList(ctx, n.kube.Conf, rt(older)); err != nil {
		t.Fatalf("DEL of an older sandbox: %v", err)
	}
	if _, ok := n.d.Agent().EnrolledUID(plain, "p"); !ok {
		t.Fatal("a DEL of an older sandbox released the pod's current enrollment")
	}
	if _, ok := n.zt.Workload(string(p.Obj.UID)); !ok {
		t.Fatal("the stand-in lost the pod after a DEL of an older sandbox")
	}

	uid := string(p.Obj.UID)
	if err := n.kube.Teardown(ctx, p); err != nil {
		t.Fatal(err)
	}
	// Right when the DEL returned: out of the state, ztunnel told.
	if _, ok := n.d.Agent().EnrolledUID(plain, "p"); ok {
		t.Fatal("the pod is still in the agent's state after its sandbox's DEL")
	}
	n.waitStandIn(func() bool { _, ok := n.zt.Workload(uid); return !ok }, "the stand-in to drop the pod")
	if n.inProbeSet(p) {
		t.Error("the pod's IP is still in the host probe set")
	}
	if des, _ := os.ReadDir(n.recordDir()); len(des) != 0 {
		t.Errorf("capture records left: %d", len(des))
	}
	if got := n.annotation(p); got != ambient.RedirectionEnabled {
		t.Errorf("annotation %q: the DEL must not write it", got)
	}
}

// TestAnnotationRepairedAfterCrash (issue 10.1): the annotation is written
// after the ADD returned; an agent that dies before writing it leaves the
// pod to the next agent, which restores it from its capture record and
// annotates it enabled once ztunnel acks it.
func TestAnnotationRepairedAfterCrash(t *testing.T) {
	f := newFaults()
	n := newNode(t, nodeOptions{Upgrade: true, AgentHook: f.hook})
	shop := n.namespace("shop", ambientLabel)
	f.set(faultAnnotate, true)
	p := n.runPod(podSpec(shop, "p", nil, nil)) // the ADD succeeds without the API
	if _, ok := n.zt.Workload(string(p.Obj.UID)); !ok || !n.hasRules(p) {
		t.Fatal("the pod is not captured when its ADD returned")
	}
	poll.Within(t, waitLong, "an annotation write tried", func() bool { return f.hit(faultAnnotate) > 0 })
	n.stopDaemon()
	if got := n.annotation(p); got != "" {
		t.Fatalf("annotation %q written despite the fault", got)
	}
	f.set(faultAnnotate, false)
	n.startDaemon()
	n.waitEnrolled(waitLong, p)
	obj, err := n.env.Client.CoreV1().Pods(shop).Get(context.Background(), "p", metav1.GetOptions{})
	if err != nil || obj.Annotations[ambient.RedirectionAnnotation] != ambient.RedirectionEnabled {
		t.Fatalf("pod %v, %v", obj, err)
	}
	if _, err := os.Stat(filepath.Join(n.recordDir(), string(p.Obj.UID)+".json")); err != nil {
		t.Errorf("the restored pod's record: %v", err)
	}
}
