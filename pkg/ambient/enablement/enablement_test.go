package enablement

import (
	"slices"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

type podOpt func(*corev1.Pod)

func withLabel(k, v string) podOpt { return func(p *corev1.Pod) { p.Labels[k] = v } }
func withAnn(k, v string) podOpt   { return func(p *corev1.Pod) { p.Annotations[k] = v } }
func withPhase(ph corev1.PodPhase) podOpt {
	return func(p *corev1.Pod) { p.Status.Phase = ph }
}
func hostNet(p *corev1.Pod) { p.Spec.HostNetwork = true }
func deleting(p *corev1.Pod) {
	now := metav1.Now()
	p.DeletionTimestamp = &now
}

func pod(ns string, opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns, Labels: map[string]string{}, Annotations: map[string]string{}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func namespace(name string, enabled bool) *corev1.Namespace {
	n := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	if enabled {
		n.Labels[ambient.DataplaneModeLabel] = ambient.DataplaneModeAmbient
	}
	return n
}

func TestDecide(t *testing.T) {
	on, off := namespace("shop", true), namespace("shop", false)
	sys := namespace("kube-system", true)
	dp := namespace("istio-system", true)
	amb := withLabel(ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
	none := withLabel(ambient.DataplaneModeLabel, ambient.DataplaneModeNone)
	cases := []struct {
		name   string
		pod    *corev1.Pod
		ns     *corev1.Namespace
		enroll bool
		reason Reason
	}{
		{"namespace enabled", pod("shop"), on, true, ReasonNamespaceLabel},
		{"namespace not enabled", pod("shop"), off, false, ReasonNotEnabled},
		{"namespace unknown", pod("shop"), nil, false, ReasonNotEnabled},
		{"pod label in plain namespace", pod("shop", amb), off, true, ReasonPodLabel},
		{"pod label with unknown namespace", pod("shop", amb), nil, true, ReasonPodLabel},
		{"pod opt-out in enabled namespace", pod("shop", none), on, false, ReasonPodOptOut},
		{"other pod label value follows namespace", pod("shop", withLabel(ambient.DataplaneModeLabel, "sidecar")), on, true, ReasonNamespaceLabel},
		{"other namespace label value", pod("shop"), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{ambient.DataplaneModeLabel: "Ambient"}}}, false, ReasonNotEnabled},
		{"hostNetwork beats pod label", pod("shop", amb, hostNet), on, false, ReasonHostNetwork},
		{"sidecar beats namespace", pod("shop", withAnn(ambient.SidecarStatusAnnotation, "{}")), on, false, ReasonSidecar},
		{"sidecar beats pod label", pod("shop", amb, withAnn(ambient.SidecarStatusAnnotation, "")), on, false, ReasonSidecar},
		{"excluded namespace beats labels", pod("kube-system", amb), sys, false, ReasonExcludedNamespace},
		{"ztunnel pod", pod("istio-system", withLabel("app", "ztunnel")), dp, false, ReasonDataPlanePod},
		{"ztunnel by name label", pod("istio-system", withLabel(AgentNameLabel, ZtunnelAppLabelValue)), dp, false, ReasonDataPlanePod},
		{"agent pod", pod("istio-system", withLabel(AgentNameLabel, AgentNameLabelValue), amb), dp, false, ReasonDataPlanePod},
		// Elsewhere the data-plane labels exempt nothing: a tenant cannot
		// take a pod out of the mesh by calling it ztunnel.
		{"ztunnel label in a tenant namespace", pod("shop", withLabel("app", "ztunnel")), on, true, ReasonNamespaceLabel},
		{"agent label in a tenant namespace", pod("shop", withLabel(AgentNameLabel, AgentNameLabelValue), amb), off, true, ReasonPodLabel},
		{"succeeded pod", pod("shop", amb, withPhase(corev1.PodSucceeded)), on, false, ReasonTerminal},
		{"failed pod", pod("shop", withPhase(corev1.PodFailed)), on, false, ReasonTerminal},
		{"pending pod is enrolled", pod("shop", withPhase(corev1.PodPending)), on, true, ReasonNamespaceLabel},
		{"terminating pod stays enrolled", pod("shop", deleting), on, true, ReasonNamespaceLabel},
		{"terminating pod that finished", pod("shop", deleting, withPhase(corev1.PodSucceeded)), on, false, ReasonTerminal},
		{"terminating pod labelled none", pod("shop", deleting, none), on, false, ReasonPodOptOut},
		{"nil pod", nil, on, false, ReasonNoPod},
	}
	p := DefaultPolicy()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := p.Decide(c.pod, c.ns)
			if got.Enroll != c.enroll || got.Reason != c.reason {
				t.Fatalf("Decide = %+v, want enroll=%v reason=%q", got, c.enroll, c.reason)
			}
		})
	}
}

func TestDataPlaneNamespacesConfigurable(t *testing.T) {
	zt := withLabel("app", ZtunnelAppLabelValue)
	p := Policy{DataPlaneNamespaces: []string{"mesh-infra"}}
	if d := p.Decide(pod("mesh-infra", zt), namespace("mesh-infra", true)); d.Enroll || d.Reason != ReasonDataPlanePod {
		t.Errorf("ztunnel in a data-plane namespace: %+v", d)
	}
	if d := p.Decide(pod("istio-system", zt), namespace("istio-system", true)); !d.Enroll {
		t.Errorf("ztunnel label outside the configured namespaces exempted: %+v", d)
	}
	if !p.IgnoresDataPlaneLabel(pod("istio-system", zt)) || p.IgnoresDataPlaneLabel(pod("mesh-infra", zt)) || p.IgnoresDataPlaneLabel(pod("shop")) {
		t.Error("IgnoresDataPlaneLabel disagrees with Decide")
	}
	if d := (Policy{}).Decide(pod("istio-system", zt), namespace("istio-system", true)); !d.Enroll {
		t.Errorf("no data-plane namespaces: the label exempted a pod: %+v", d)
	}
}

func TestExcludedNamespacesConfigurable(t *testing.T) {
	p := Policy{ExcludedNamespaces: []string{"infra"}}
	if d := p.Decide(pod("kube-system"), namespace("kube-system", true)); !d.Enroll {
		t.Fatalf("kube-system not excluded by custom policy: %+v", d)
	}
	if d := p.Decide(pod("infra"), namespace("infra", true)); d.Enroll {
		t.Fatalf("infra excluded by custom policy but enrolled: %+v", d)
	}
}

func TestPerPodOverrides(t *testing.T) {
	if !DNSCapture(pod("a", withAnn(ambient.DNSCaptureAnnotation, "true")), false) {
		t.Error("dns-capture=true ignored")
	}
	if DNSCapture(pod("a", withAnn(ambient.DNSCaptureAnnotation, "false")), true) {
		t.Error("dns-capture=false ignored")
	}
	if !DNSCapture(pod("a", withAnn(ambient.DNSCaptureAnnotation, "maybe")), true) || DNSCapture(nil, false) {
		t.Error("invalid override should fall back to default")
	}
	if !BypassInbound(pod("a", withAnn(ambient.BypassInboundCaptureAnnotation, "true"))) || BypassInbound(pod("a")) || BypassInbound(nil) {
		t.Error("bypass-inbound-capture misread")
	}
	// Booleans read as Istio reads them: strconv.ParseBool, anything else
	// unset.
	for v, want := range map[string]bool{"1": true, "t": true, "T": true, "TRUE": true, "True": true,
		"0": false, "f": false, "F": false, "FALSE": false, "False": false} {
		if got := DNSCapture(pod("a", withAnn(ambient.DNSCaptureAnnotation, v)), !want); got != want {
			t.Errorf("dns-capture=%q: %v, want %v", v, got, want)
		}
		if got := BypassInbound(pod("a", withAnn(ambient.BypassInboundCaptureAnnotation, v))); got != want {
			t.Errorf("bypass-inbound-capture=%q: %v, want %v", v, got, want)
		}
	}
	for _, v := range []string{"", "yes", "on", " true", "tweedledum"} {
		if got := DNSCapture(pod("a", withAnn(ambient.DNSCaptureAnnotation, v)), true); !got {
			t.Errorf("dns-capture=%q overrode the default", v)
		}
		if BypassInbound(pod("a", withAnn(ambient.BypassInboundCaptureAnnotation, v))) {
			t.Errorf("bypass-inbound-capture=%q read as true", v)
		}
	}
}

func TestVirtualInterfaces(t *testing.T) {
	for in, want := range map[string][]string{
		"":                 nil,
		" , ,":             nil,
		"k6t-eth0":         {"k6t-eth0"},
		"en0ps1, en1ps1":   {"en0ps1", "en1ps1"},
		" tap0 ,, tap1 , ": {"tap0", "tap1"},
		"asd^&*(#),   ":    {"asd^&*(#)"},
	} {
		got := VirtualInterfaces(pod("a", withAnn(ambient.RerouteVirtualInterfacesAnnotation, in)))
		if !slices.Equal(got, want) {
			t.Errorf("%q: %q, want %q", in, got, want)
		}
	}
	if VirtualInterfaces(pod("a")) != nil || VirtualInterfaces(nil) != nil {
		t.Error("no annotation must mean no interfaces")
	}
}

func TestPodIPs(t *testing.T) {
	p := pod("a")
	if got := PodIPs(p); len(got) != 0 {
		t.Fatalf("no IPs: got %v", got)
	}
	p.Status.PodIP = "10.0.0.9"
	if got := PodIPs(p); len(got) != 1 || got[0].String() != "10.0.0.9" {
		t.Fatalf("legacy podIP: got %v", got)
	}
	p.Status.PodIPs = []corev1.PodIP{{IP: "::ffff:10.0.0.5"}, {IP: "fd00::5"}, {IP: "garbage"}}
	if got := PodIPs(p); len(got) != 2 || got[0].String() != "10.0.0.5" || got[1].String() != "fd00::5" {
		t.Fatalf("podIPs: got %v", got)
	}
}

func withInit(names ...string) podOpt {
	return func(p *corev1.Pod) {
		for _, n := range names {
			p.Spec.InitContainers = append(p.Spec.InitContainers, corev1.Container{Name: n})
		}
	}
}

// TestExpectsIstioCNI: a pod injected for istio-cni's sidecar mode is told
// by its istio-validation init container (Istio's injection template adds
// it instead of istio-init when pilot.cni.enabled is set), wherever it
// sits among the init containers; istio-init, other init containers, a
// bare sidecar status annotation or no pod at all are not.
func TestExpectsIstioCNI(t *testing.T) {
	status := withAnn(ambient.SidecarStatusAnnotation, `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`)
	for name, c := range map[string]struct {
		pod  *corev1.Pod
		want bool
	}{
		"validation":              {pod("a", status, withInit(ambient.IstioValidationInitContainer)), true},
		"validation among others": {pod("a", status, withInit("setup", ambient.IstioValidationInitContainer, "istio-proxy")), true},
		"istio-init":              {pod("a", withAnn(ambient.SidecarStatusAnnotation, `{"initContainers":["istio-init"]}`), withInit("istio-init")), false},
		"other init":              {pod("a", withInit("migrate")), false},
		"annotation only":         {pod("a", status), false},
		"plain":                   {pod("a"), false},
		"nil":                     {nil, false},
	} {
		got := ExpectsIstioCNI(c.pod)
		msg := IstioCNIExpected(c.pod)
		if got != c.want || (msg != "") != c.want {
			t.Errorf("%s: ExpectsIstioCNI %v, message %q; want %v", name, got, msg, c.want)
		}
	}
	msg := IstioCNIExpected(pod("a", withInit(ambient.IstioValidationInitContainer)))
	for _, want := range []string{"istio-validation", "pilot.cni.enabled", "ambient pods only", "istio-init"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q does not say %q", msg, want)
		}
	}
}
