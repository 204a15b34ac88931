package explain

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
)

// The end-to-end suite (test/integration TestExplain) explains real pods; these
// cover the verdicts that are hard to stage there.

type fakePods struct {
	pods map[string]*corev1.Pod
	nss  map[string]*corev1.Namespace
}

func notFound(name string) error {
	return apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, name)
}

func (f *fakePods) Pod(ns, name string) (*corev1.Pod, error) {
	if p, ok := f.pods[ns+"/"+name]; ok {
		return p, nil
	}
	return nil, notFound(name)
}

func (f *fakePods) Pods() ([]*corev1.Pod, error) {
	var out []*corev1.Pod
	for _, p := range f.pods {
		out = append(out, p)
	}
	return out, nil
}

func (f *fakePods) Namespace(name string) (*corev1.Namespace, error) {
	if n, ok := f.nss[name]; ok {
		return n, nil
	}
	return nil, notFound(name)
}

func (f *fakePods) DecideCached(p *corev1.Pod) enablement.Decision {
	ns, _ := f.Namespace(p.Namespace)
	return enablement.DefaultPolicy().Decide(p, ns)
}

type fakeAgent struct {
	held     map[types.UID]nodeagent.Inspection
	released map[types.UID]bool
}

func (a *fakeAgent) EnrolledUID(ns, name string) (types.UID, bool) {
	for uid, in := range a.held {
		if in.Namespace == ns && in.Name == name {
			return uid, true
		}
	}
	return "", false
}

func (a *fakeAgent) Inspect(uid types.UID) (nodeagent.Inspection, bool) {
	in, ok := a.held[uid]
	return in, ok
}

func (a *fakeAgent) SandboxReleased(uid types.UID) bool { return a.released[uid] }

func (a *fakeAgent) Pods() []nodeagent.EnrolledPod {
	var out []nodeagent.EnrolledPod
	for _, in := range a.held {
		out = append(out, in.EnrolledPod)
	}
	return out
}

type fakeFinder struct{ asked []types.UID }

func (f *fakeFinder) Find(pods map[types.UID][]netip.Addr) (map[types.UID]*netns.Handle, error) {
	for uid := range pods {
		f.asked = append(f.asked, uid)
	}
	return nil, errors.New("no such process")
}

func mkPod(ns, name, uid, ip string, mods ...func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), Annotations: map[string]string{}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	if ip != "" {
		p.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	}
	for _, m := range mods {
		m(p)
	}
	return p
}

func held(p *corev1.Pod, state nodeagent.PodState) nodeagent.Inspection {
	return nodeagent.Inspection{EnrolledPod: nodeagent.EnrolledPod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, State: state,
		Netns: "/proc/1/ns/net", Since: time.Now()}}
}

func TestVerdicts(t *testing.T) {
	now := metav1.Now()
	terminating := func(p *corev1.Pod) { p.DeletionTimestamp = &now }
	annotated := func(p *corev1.Pod) { p.Annotations[ambient.RedirectionAnnotation] = ambient.RedirectionEnabled }
	on := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}}
	off := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "plain"}}

	leaving := mkPod("shop", "leaving", "u-leaving", "10.0.0.1", terminating, annotated)
	starting := mkPod("shop", "starting", "u-starting", "")
	unwanted := mkPod("plain", "unwanted", "u-unwanted", "10.0.0.3", annotated)
	stale := mkPod("plain", "stale", "u-stale", "10.0.0.4", annotated)
	draining := mkPod("shop", "draining", "u-draining", "10.0.0.5", terminating, annotated)
	lost := mkPod("shop", "lost", "u-lost", "10.0.0.6", annotated)
	typo := mkPod("plain", "typo", "u-typo", "10.0.0.7", func(p *corev1.Pod) { p.Annotations[ambient.DNSCaptureAnnotation] = "maybe" })
	// Injected for istio-cni's sidecar mode: not captured, and told why it
	// will not start.
	validating := mkPod("shop", "validating", "u-validating", "10.0.0.8", func(p *corev1.Pod) {
		p.Annotations[ambient.SidecarStatusAnnotation] = ""
		p.Spec.InitContainers = []corev1.Container{{Name: ambient.IstioValidationInitContainer}}
	})
	pods := &fakePods{pods: map[string]*corev1.Pod{}, nss: map[string]*corev1.Namespace{"shop": on, "plain": off}}
	for _, p := range []*corev1.Pod{leaving, starting, unwanted, stale, draining, lost, typo, validating} {
		pods.pods[p.Namespace+"/"+p.Name] = p
	}
	// Restored without its netns after a restart (unresolved: its netns not found).
	unresolved := held(lost, nodeagent.StateEnabled)
	unresolved.Unresolved, unresolved.Netns = true, "/var/run/netns/cni-lost"
	unresolved.VerifyError = "the pod's network namespace has not been found since the agent restarted (ztunnel keeps serving it)"
	gone := nodeagent.Inspection{EnrolledPod: nodeagent.EnrolledPod{UID: "u-gone", Namespace: "shop", Name: "gone", State: nodeagent.StateEnabled}}
	agent := &fakeAgent{
		held: map[types.UID]nodeagent.Inspection{
			unwanted.UID: held(unwanted, nodeagent.StateEnabled),
			draining.UID: held(draining, nodeagent.StateEnabled),
			lost.UID:     unresolved,
			gone.UID:     gone,
		},
		released: map[types.UID]bool{leaving.UID: true},
	}
	finder := &fakeFinder{}
	e := &Explainer{Pods: pods, Agent: agent, Finder: finder, Backend: "nftables"}

	for _, c := range []struct {
		ns, name string
		ok       bool
		verdict  string
		problem  string
	}{
		{"shop", "leaving", true, "not captured: terminating, and its sandbox was torn down", ""},
		{"shop", "starting", true, "not captured yet: to be captured", ""},
		{"plain", "unwanted", false, "captured, but should not be (neither pod nor namespace labelled ambient)", "held by the agent"},
		{"plain", "stale", false, "not captured: neither pod nor namespace labelled ambient", "stale annotation"},
		{"shop", "draining", true, "captured (namespace labelled ambient); terminating: stays captured", ""},
		{"shop", "gone", false, "captured, but its pod object is gone", "object is gone"},
		{"shop", "lost", false, "captured (namespace labelled ambient)", "has not been found since the agent restarted"},
		{"plain", "typo", false, "not captured", `ambient.istio.io/dns-capture="maybe" is not a boolean`},
		{"shop", "validating", false, "not captured: sidecar-injected pod", "injected for istio-cni's sidecar mode"},
	} {
		r, err := e.Explain(context.Background(), c.ns, c.name)
		if err != nil {
			t.Fatalf("%s/%s: %v", c.ns, c.name, err)
		}
		if r.OK != c.ok || !strings.HasPrefix(r.Verdict, c.verdict) || (c.problem != "" && !strings.Contains(strings.Join(r.Problems, "\n"), c.problem)) {
			t.Errorf("%s/%s: ok %v, verdict %q, problems %q; want ok %v, verdict %q..., a problem with %q", c.ns, c.name, r.OK, r.Verdict, r.Problems, c.ok, c.verdict, c.problem)
		}
	}
	if r, err := e.Explain(context.Background(), "shop", "lost"); err != nil || r.Netns.Found || !strings.Contains(r.Netns.How, "not found since the agent restarted") || r.Netns.Path != "/var/run/netns/cni-lost" {
		t.Errorf("netns of a pod restored without it: %+v, %v", r.Netns, err)
	}
	if _, err := e.Explain(context.Background(), "shop", "nobody"); !errors.Is(err, health.ErrNoSuchPod) {
		t.Errorf("unknown pod: %v", err)
	}
	if len(finder.asked) != 0 {
		t.Errorf("scanned /proc for %v: none of these pods needs a scan", finder.asked)
	}
	all := e.ExplainAll(context.Background())
	if all.Pods != 9 || all.Captured != 4 || all.WithProblems != 6 || all.RulesBackend != "nftables" {
		t.Errorf("node report: %d pods, %d captured, %d with problems, backend %q", all.Pods, all.Captured, all.WithProblems, all.RulesBackend)
	}
}

// A tenant's pod labelled as ztunnel is decided like any other, and the
// explain view says why the label did not exempt it.
func TestExplainDataPlaneLabelOutsideItsNamespaces(t *testing.T) {
	on := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}}
	fake := mkPod("shop", "fake-zt", "u-fake", "", func(p *corev1.Pod) { p.Labels = map[string]string{"app": enablement.ZtunnelAppLabelValue} })
	real := mkPod(enablement.DefaultDataPlaneNamespace, "ztunnel-x", "u-zt", "", func(p *corev1.Pod) { p.Labels = map[string]string{"app": enablement.ZtunnelAppLabelValue} })
	pods := &fakePods{pods: map[string]*corev1.Pod{"shop/fake-zt": fake, real.Namespace + "/ztunnel-x": real}, nss: map[string]*corev1.Namespace{"shop": on}}
	e := &Explainer{Pods: pods, Agent: &fakeAgent{}, Finder: &fakeFinder{}, Policy: enablement.DefaultPolicy()}
	r, err := e.Explain(context.Background(), "shop", "fake-zt")
	if err != nil {
		t.Fatal(err)
	}
	if !r.Policy.Capture || !strings.Contains(r.Policy.Note, "data-plane namespaces [istio-system]") {
		t.Errorf("tenant pod labelled ztunnel: capture %v, note %q; want captured, with a note naming the data-plane namespaces", r.Policy.Capture, r.Policy.Note)
	}
	r, err = e.Explain(context.Background(), real.Namespace, "ztunnel-x")
	if err != nil {
		t.Fatal(err)
	}
	if r.Policy.Capture || r.Policy.Reason != string(enablement.ReasonDataPlanePod) || r.Policy.Note != "" {
		t.Errorf("ztunnel in its namespace: %+v; want exempt, no note", r.Policy)
	}
}

// A captured pod's report carries the verifier's last proof; a failed one
// is a problem that names what is wrong.
func TestVerification(t *testing.T) {
	on := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}}
	ok := mkPod("shop", "ok", "u-ok", "10.0.0.1", func(p *corev1.Pod) { p.Annotations[ambient.RedirectionAnnotation] = ambient.RedirectionEnabled })
	bad := mkPod("shop", "bad", "u-bad", "10.0.0.2", func(p *corev1.Pod) { p.Annotations[ambient.RedirectionAnnotation] = ambient.RedirectionEnabled })
	pods := &fakePods{pods: map[string]*corev1.Pod{"shop/ok": ok, "shop/bad": bad}, nss: map[string]*corev1.Namespace{"shop": on}}
	okIn, badIn := held(ok, nodeagent.StateEnabled), held(bad, nodeagent.StateEnabled)
	agent := &fakeAgent{held: map[types.UID]nodeagent.Inspection{ok.UID: okIn, bad.UID: badIn}}
	at := time.Unix(1700000000, 0)
	proofs := map[types.UID]explainwire.Verification{
		ok.UID:  {At: at, Proven: true, LastDriftAt: &at, LastDrift: []string{"rules: flushed"}},
		bad.UID: {At: at, Problem: "repair failed: xtables lock"},
	}
	e := &Explainer{Pods: pods, Agent: agent, Finder: &fakeFinder{}, Backend: "nftables",
		Verified: func(uid types.UID) (explainwire.Verification, bool) { v, ok := proofs[uid]; return v, ok }}
	r, err := e.Explain(context.Background(), "shop", "ok")
	if err != nil || r.Captured == nil || r.Captured.Verification == nil || !r.Captured.Verification.Proven || !r.OK {
		t.Fatalf("proven pod: %+v, %v", r, err)
	}
	r, err = e.Explain(context.Background(), "shop", "bad")
	if err != nil || r.OK || !strings.Contains(strings.Join(r.Problems, "\n"), "xtables lock") {
		t.Fatalf("unproven pod: %+v, %v", r, err)
	}
}
