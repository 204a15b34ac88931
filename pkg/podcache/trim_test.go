package podcache

import (
	"fmt"
	"maps"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

// fullPod is a pod carrying everything a real one may: the fields the
// agent reads and plenty it does not.
func fullPod(mut func(*corev1.Pod)) *corev1.Pod {
	now := metav1.Now()
	grace := int64(30)
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: "web", Namespace: "shop", UID: "u-1", ResourceVersion: "42",
			Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient, "app": "web"},
			Annotations: map[string]string{
				ambient.RedirectionAnnotation:                      ambient.RedirectionEnabled,
				ambient.DNSCaptureAnnotation:                       "false",
				ambient.BypassInboundCaptureAnnotation:             "true",
				ambient.RerouteVirtualInterfacesAnnotation:         "k6t-eth0,tap0",
				"kubectl.kubernetes.io/last-applied-configuration": strings.Repeat("x", 10<<10),
			},
			ManagedFields:     []metav1.ManagedFieldsEntry{{Manager: "kubectl"}},
			OwnerReferences:   []metav1.OwnerReference{{Kind: "ReplicaSet", Name: "web-1"}},
			Finalizers:        []string{"example.com/f"},
			DeletionTimestamp: &now, DeletionGracePeriodSeconds: &grace,
		},
		Spec: corev1.PodSpec{
			NodeName: "node-a", ServiceAccountName: "web-sa",
			Containers: []corev1.Container{{Name: "app", Image: "web:1", Env: []corev1.EnvVar{{Name: "BIG", Value: strings.Repeat("y", 4096)}}}},
		},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: "10.0.0.7",
			PodIPs:            []corev1.PodIP{{IP: "10.0.0.7"}, {IP: "fd00::7"}},
			ContainerStatuses: []corev1.ContainerStatus{{Name: "app", Ready: true}},
		},
	}
	if mut != nil {
		mut(p)
	}
	return p
}

// TestTrimPodKeepsWhatDecisionsRead: for pods that differ in each field
// the agent reads, every decision and reading of the trimmed pod equals
// the full pod's, and nothing else is kept.
func TestTrimPodKeepsWhatDecisionsRead(t *testing.T) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}}
	pol := enablement.DefaultPolicy()
	cases := map[string]func(*corev1.Pod){
		"as is":        nil,
		"host network": func(p *corev1.Pod) { p.Spec.HostNetwork = true },
		"terminal":     func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded },
		"sidecar":      func(p *corev1.Pod) { p.Annotations[ambient.SidecarStatusAnnotation] = `{"containers":["istio-proxy"]}` },
		"opt out":      func(p *corev1.Pod) { p.Labels[ambient.DataplaneModeLabel] = ambient.DataplaneModeNone },
		"ztunnel":      func(p *corev1.Pod) { p.Labels["app"] = enablement.ZtunnelAppLabelValue },
		"no label":     func(p *corev1.Pod) { delete(p.Labels, ambient.DataplaneModeLabel) },
		"dns default":  func(p *corev1.Pod) { delete(p.Annotations, ambient.DNSCaptureAnnotation) },
		"excluded":     func(p *corev1.Pod) { p.Namespace = ambient.DefaultExcludedNamespace },
		"ipv4 only":    func(p *corev1.Pod) { p.Status.PodIPs = nil },
		"expects istio-cni": func(p *corev1.Pod) {
			p.Annotations[ambient.SidecarStatusAnnotation] = `{"initContainers":["istio-validation"]}`
			p.Spec.InitContainers = []corev1.Container{{Name: "setup", Image: "x"}, {Name: ambient.IstioValidationInitContainer, Image: "proxyv2", Args: []string{"istio-iptables", "--run-validation"}}}
		},
		"other init containers": func(p *corev1.Pod) {
			p.Spec.InitContainers = []corev1.Container{{Name: "istio-init", Image: "proxyv2"}}
		},
	}
	for name, mut := range cases {
		full := fullPod(mut)
		o, err := TrimPod(full.DeepCopy())
		if err != nil {
			t.Fatal(err)
		}
		got := o.(*corev1.Pod)
		if a, b := pol.Decide(got, ns), pol.Decide(full, ns); a != b {
			t.Errorf("%s: trimmed pod decided %+v, full pod %+v", name, a, b)
		}
		for what, eq := range map[string]bool{
			"DNSCapture":        enablement.DNSCapture(got, true) == enablement.DNSCapture(full, true),
			"BypassInbound":     enablement.BypassInbound(got) == enablement.BypassInbound(full),
			"VirtualInterfaces": reflect.DeepEqual(enablement.VirtualInterfaces(got), enablement.VirtualInterfaces(full)),
			"PodIPs":            reflect.DeepEqual(enablement.PodIPs(got), enablement.PodIPs(full)),
			"identity": got.Name == full.Name && got.Namespace == full.Namespace && got.UID == full.UID &&
				got.ResourceVersion == full.ResourceVersion && got.Spec.NodeName == full.Spec.NodeName,
			"service account": got.Spec.ServiceAccountName == full.Spec.ServiceAccountName,
			"deletion":        got.DeletionTimestamp.Equal(full.DeletionTimestamp),
			"redirection":     got.Annotations[ambient.RedirectionAnnotation] == full.Annotations[ambient.RedirectionAnnotation],
			"labels":          reflect.DeepEqual(got.Labels, full.Labels),
			"ExpectsIstioCNI": enablement.ExpectsIstioCNI(got) == enablement.ExpectsIstioCNI(full),
		} {
			if !eq {
				t.Errorf("%s: %s differs after trimming", name, what)
			}
		}
		if len(got.ManagedFields)+len(got.OwnerReferences)+len(got.Finalizers)+len(got.Spec.Containers)+len(got.Status.ContainerStatuses) != 0 {
			t.Errorf("%s: trimmed pod keeps what the agent never reads: %+v", name, got)
		}
		for _, c := range got.Spec.InitContainers {
			if c.Name != ambient.IstioValidationInitContainer || !reflect.DeepEqual(c, corev1.Container{Name: c.Name}) {
				t.Errorf("%s: trimmed pod keeps an init container beyond istio-validation's name: %+v", name, c)
			}
		}
		if _, ok := got.Annotations["kubectl.kubernetes.io/last-applied-configuration"]; ok {
			t.Errorf("%s: an annotation the agent never reads was kept", name)
		}
	}
	// Already trimmed objects (a relist) and other types pass unchanged.
	once, _ := TrimPod(fullPod(nil))
	twice, _ := TrimPod(once)
	if !reflect.DeepEqual(once, twice) {
		t.Error("trimming is not idempotent")
	}
	if o, _ := TrimPod("tombstone"); o != "tombstone" {
		t.Error("a non-pod was changed")
	}
}

// TestNamespaceLabelKeysFromPolicy: the cache keeps the keys the
// configured selectors read, and the dataplane-mode label for the explain
// view even when no selector reads it.
func TestNamespaceLabelKeysFromPolicy(t *testing.T) {
	sel, err := enablement.ParseSelectors([]byte(`
- podSelector: {}
  namespaceSelector:
    matchExpressions: [{key: team, operator: In, values: [pay]}, {key: kubernetes.io/metadata.name, operator: Exists}]
- podSelector: {matchLabels: {only-pod: "x"}}
  namespaceSelector: {}
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		policy enablement.Policy
		want   []string
	}{
		{enablement.DefaultPolicy(), []string{ambient.DataplaneModeLabel}},
		{enablement.Policy{Selectors: sel}, []string{ambient.DataplaneModeLabel, "kubernetes.io/metadata.name", "team"}},
	} {
		if got := NamespaceLabelKeys(tc.policy); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("NamespaceLabelKeys = %q, want %q", got, tc.want)
		}
	}
}

// hostileNamespace carries what anyone allowed to create namespaces may
// put in one: a megabyte of annotations, thousands of labels (among them
// those the selectors read), a spec and a status.
func hostileNamespace(labels map[string]string) *corev1.Namespace {
	now := metav1.Now()
	n := &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: "shop", UID: "n-1", ResourceVersion: "7", DeletionTimestamp: &now,
			Labels:        map[string]string{},
			Annotations:   map[string]string{},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}},
			Finalizers:    []string{"example.com/f"},
		},
		Spec:   corev1.NamespaceSpec{Finalizers: []corev1.FinalizerName{"kubernetes"}},
		Status: corev1.NamespaceStatus{Phase: corev1.NamespaceTerminating, Conditions: []corev1.NamespaceCondition{{Type: "x"}}},
	}
	for i := range 4000 {
		n.Labels[fmt.Sprintf("noise.example.com/l%04d", i)] = strings.Repeat("v", 63)
	}
	for i := range 100 {
		n.Annotations[fmt.Sprintf("noise.example.com/a%03d", i)] = strings.Repeat("z", 10<<10)
	}
	maps.Copy(n.Labels, labels)
	return n
}

// TestNamespaceTransform: of a hostile namespace the cache keeps its
// name, resourceVersion, deletion time and the labels of the kept keys,
// nothing else (not even its UID, which nothing reads),
// and every decision of the trimmed namespace equals the full one's.
func TestNamespaceTransform(t *testing.T) {
	sel, err := enablement.ParseSelectors([]byte(`
- podSelector: {}
  namespaceSelector:
    matchExpressions: [{key: team, operator: In, values: [pay]}, {key: quarantine, operator: DoesNotExist}]
`))
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	amb := map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	for name, tc := range map[string]struct {
		policy enablement.Policy
		labels map[string]string
		kept   map[string]string
	}{
		"default, labelled":     {enablement.DefaultPolicy(), amb, amb},
		"default, opted out":    {enablement.DefaultPolicy(), map[string]string{ambient.DataplaneModeLabel: "none", "team": "pay"}, map[string]string{ambient.DataplaneModeLabel: "none"}},
		"default, no kept keys": {enablement.DefaultPolicy(), nil, nil},
		"custom, selected":      {enablement.Policy{Selectors: sel}, map[string]string{"team": "pay"}, map[string]string{"team": "pay"}},
		"custom, quarantined":   {enablement.Policy{Selectors: sel}, map[string]string{"team": "pay", "quarantine": "", ambient.DataplaneModeLabel: "ambient"}, map[string]string{"team": "pay", "quarantine": "", ambient.DataplaneModeLabel: "ambient"}},
		"custom, other team":    {enablement.Policy{Selectors: sel}, map[string]string{"team": "ops"}, map[string]string{"team": "ops"}},
	} {
		t.Run(name, func(t *testing.T) {
			full := hostileNamespace(tc.labels)
			trim := NamespaceTransform(NamespaceLabelKeys(tc.policy))
			o, err := trim(full.DeepCopy())
			if err != nil {
				t.Fatal(err)
			}
			got := o.(*corev1.Namespace)
			want := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", ResourceVersion: "7",
				DeletionTimestamp: full.DeletionTimestamp, Labels: tc.kept}}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("trimmed namespace %+v, want %+v", got.ObjectMeta, want.ObjectMeta)
			}
			if a, b := tc.policy.MayEnableNamespace(got), tc.policy.MayEnableNamespace(full); a != b {
				t.Errorf("MayEnableNamespace %v trimmed, %v full", a, b)
			}
			if a, b := tc.policy.Decide(pod, got), tc.policy.Decide(pod, full); a != b {
				t.Errorf("Decide %+v trimmed, %+v full", a, b)
			}
			bare := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}
			if a, b := tc.policy.Selectors.NamespaceChangeMatters(nil, got.Labels), tc.policy.Selectors.NamespaceChangeMatters(bare.Labels, full.Labels); a != b {
				t.Errorf("NamespaceChangeMatters %v trimmed, %v full", a, b)
			}
			again, _ := trim(got)
			if !reflect.DeepEqual(again, got) {
				t.Error("trimming is not idempotent")
			}
		})
	}
	if o, _ := NamespaceTransform(nil)("tombstone"); o != "tombstone" {
		t.Error("a non-namespace was changed")
	}
}
