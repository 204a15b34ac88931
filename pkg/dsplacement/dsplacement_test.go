package dsplacement

import (
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
)

func nodeWith(labels map[string]string, taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: labels}, Spec: corev1.NodeSpec{Taints: taints}}
}

func dsWith(f func(*corev1.PodSpec)) *appsv1.DaemonSet {
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "ambient-cni"}}
	f(&ds.Spec.Template.Spec)
	return ds
}

func requiredAffinity(terms ...corev1.NodeSelectorTerm) *corev1.Affinity {
	return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: terms},
	}}
}

func TestTargetsNode(t *testing.T) {
	linux := map[string]string{"kubernetes.io/os": "linux", "mesh": "on"}
	in := func(key string, values ...string) corev1.NodeSelectorRequirement {
		return corev1.NodeSelectorRequirement{Key: key, Operator: corev1.NodeSelectorOpIn, Values: values}
	}
	taint := func(key string, effect corev1.TaintEffect) corev1.Taint {
		return corev1.Taint{Key: key, Value: "v", Effect: effect}
	}
	for _, tc := range []struct {
		name string
		ds   *appsv1.DaemonSet
		node *corev1.Node
		want bool
		why  string // part of the reason when not targeted
	}{
		{"no constraints", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil), true, ""},
		{"nodeSelector matches", dsWith(func(s *corev1.PodSpec) { s.NodeSelector = map[string]string{"mesh": "on"} }), nodeWith(linux), true, ""},
		{"nodeSelector value differs", dsWith(func(s *corev1.PodSpec) { s.NodeSelector = map[string]string{"mesh": "off"} }), nodeWith(linux), false, "nodeSelector"},
		{"nodeSelector label missing", dsWith(func(s *corev1.PodSpec) { s.NodeSelector = map[string]string{"zone": "a"} }), nodeWith(linux), false, "nodeSelector"},
		{"pinned to another node", dsWith(func(s *corev1.PodSpec) { s.NodeName = "node-b" }), nodeWith(nil), false, "pinned"},
		{"pinned to this node", dsWith(func(s *corev1.PodSpec) { s.NodeName = "node-a" }), nodeWith(nil), true, ""},
		{"matchExpressions match", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = requiredAffinity(corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{in("mesh", "on", "yes")}})
		}), nodeWith(linux), true, ""},
		{"matchExpressions miss", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = requiredAffinity(corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{in("mesh", "off")}})
		}), nodeWith(linux), false, "affinity"},
		{"NotIn excludes the node", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = requiredAffinity(corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{
				{Key: "mesh", Operator: corev1.NodeSelectorOpNotIn, Values: []string{"on"}}}})
		}), nodeWith(linux), false, "affinity"},
		{"terms are ORed", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = requiredAffinity(
				corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{in("mesh", "off")}},
				corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{in("kubernetes.io/os", "linux")}})
		}), nodeWith(linux), true, ""},
		{"matchFields names the node", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = requiredAffinity(corev1.NodeSelectorTerm{MatchFields: []corev1.NodeSelectorRequirement{in("metadata.name", "node-a")}})
		}), nodeWith(nil), true, ""},
		{"matchFields names another node", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = requiredAffinity(corev1.NodeSelectorTerm{MatchFields: []corev1.NodeSelectorRequirement{in("metadata.name", "node-b")}})
		}), nodeWith(nil), false, "affinity"},
		{"only preferred affinity", dsWith(func(s *corev1.PodSpec) {
			s.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{
				{Weight: 1, Preference: corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{in("mesh", "off")}}}}}}
		}), nodeWith(linux), true, ""},
		{"NoSchedule taint not tolerated", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, taint("dedicated", corev1.TaintEffectNoSchedule)), false, "dedicated"},
		{"NoExecute taint not tolerated", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, taint("dedicated", corev1.TaintEffectNoExecute)), false, "dedicated"},
		{"PreferNoSchedule taint is not a constraint", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, taint("dedicated", corev1.TaintEffectPreferNoSchedule)), true, ""},
		{"taint tolerated by Exists", dsWith(func(s *corev1.PodSpec) {
			s.Tolerations = []corev1.Toleration{{Operator: corev1.TolerationOpExists}}
		}), nodeWith(nil, taint("dedicated", corev1.TaintEffectNoSchedule)), true, ""},
		{"taint tolerated by Equal", dsWith(func(s *corev1.PodSpec) {
			s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "v", Effect: corev1.TaintEffectNoSchedule}}
		}), nodeWith(nil, taint("dedicated", corev1.TaintEffectNoSchedule)), true, ""},
		{"toleration for another value", dsWith(func(s *corev1.PodSpec) {
			s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "w"}}
		}), nodeWith(nil, taint("dedicated", corev1.TaintEffectNoSchedule)), false, "dedicated"},
		{"toleration for the other effect", dsWith(func(s *corev1.PodSpec) {
			s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
		}), nodeWith(nil, taint("dedicated", corev1.TaintEffectNoExecute)), false, "dedicated"},
		// Kubernetes' own condition taints come and go: a cordoned, NotReady
		// or pressured node gets its agent back, so it is no uninstall.
		{"cordoned", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeUnschedulable, Effect: corev1.TaintEffectNoSchedule}), true, ""},
		{"not ready", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoExecute}), true, ""},
		{"unreachable", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeUnreachable, Effect: corev1.TaintEffectNoExecute}), true, ""},
		{"memory pressure", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeMemoryPressure, Effect: corev1.TaintEffectNoSchedule}), true, ""},
		{"network unavailable, host network", dsWith(func(s *corev1.PodSpec) { s.HostNetwork = true }),
			nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeNetworkUnavailable, Effect: corev1.TaintEffectNoSchedule}), true, ""},
		{"network unavailable, pod network", dsWith(func(*corev1.PodSpec) {}),
			nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeNetworkUnavailable, Effect: corev1.TaintEffectNoSchedule}), true, ""},
		{"not ready, NoSchedule", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoSchedule}), true, ""},
		{"cloud provider not initialised", dsWith(func(*corev1.PodSpec) {}),
			nodeWith(nil, corev1.Taint{Key: "node.cloudprovider.kubernetes.io/uninitialized", Value: "true", Effect: corev1.TaintEffectNoSchedule}), true, ""},
		// The CNI startup taint waits for the agent: the DaemonSet has not
		// left a node that carries it.
		{"CNI startup taint", dsWith(func(*corev1.PodSpec) {}), nodeWith(nil, nodetaint.Taint), true, ""},
		{"an operator taint beside a condition taint", dsWith(func(*corev1.PodSpec) {}),
			nodeWith(nil, corev1.Taint{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoSchedule}, taint("dedicated", corev1.TaintEffectNoSchedule)), false, "dedicated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why, err := TargetsNode(tc.ds, tc.node)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want || !strings.Contains(why, tc.why) || (got && why != "") {
				t.Errorf("targets = %v (%q), want %v (reason naming %q)", got, why, tc.want, tc.why)
			}
		})
	}
}

// A selector the API server would not have accepted decides nothing: an
// error, not an uninstall.
func TestTargetsNodeBadSelector(t *testing.T) {
	ds := dsWith(func(s *corev1.PodSpec) {
		s.Affinity = requiredAffinity(corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{
			{Key: "mesh", Operator: "Sometimes", Values: []string{"on"}}}})
	})
	if got, _, err := TargetsNode(ds, nodeWith(nil)); err == nil {
		t.Errorf("bad operator: targets = %v, no error", got)
	}
}
