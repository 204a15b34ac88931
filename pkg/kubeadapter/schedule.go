package kubeadapter

import (
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	schedcorev1 "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"
)

// daemonPodTolerations are the tolerations the DaemonSet controller adds
// to every pod it creates, whatever the template says: a node that is not
// ready, unreachable, under pressure or cordoned still runs its daemons.
// Without them a cordoned or NotReady node would look like one the
// DaemonSet left.
var daemonPodTolerations = []corev1.Toleration{
	{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
	{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
	{Key: corev1.TaintNodeDiskPressure, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
	{Key: corev1.TaintNodeMemoryPressure, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
	{Key: corev1.TaintNodePIDPressure, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
	{Key: corev1.TaintNodeUnschedulable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
}

// hostNetworkDaemonToleration is added too for hostNetwork daemons, which
// do not need the node's pod network.
var hostNetworkDaemonToleration = corev1.Toleration{
	Key: corev1.TaintNodeNetworkUnavailable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule,
}

// DaemonSetTargetsNode reports whether the DaemonSet controller would
// start ds's pod on node, as its own predicate decides: the template's
// nodeName, nodeSelector and required node affinity (matchExpressions and
// matchFields) must match the node, and every NoSchedule or NoExecute
// taint on it must be tolerated (by the template or by the tolerations the
// controller adds). When it does not, why names the first reason. An
// error (a selector that does not parse) decides nothing.
func DaemonSetTargetsNode(ds *appsv1.DaemonSet, node *corev1.Node) (targets bool, why string, err error) {
	spec := &ds.Spec.Template.Spec
	if spec.NodeName != "" && spec.NodeName != node.Name {
		return false, fmt.Sprintf("its pod template is pinned to node %q", spec.NodeName), nil
	}
	if ok, _ := nodeaffinity.NewRequiredNodeAffinity(spec.NodeSelector, nil).Match(node); !ok {
		return false, "its nodeSelector does not match the node's labels", nil
	}
	if spec.Affinity != nil && spec.Affinity.NodeAffinity != nil && spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
		ok, err := nodeaffinity.NewRequiredNodeAffinity(nil, spec.Affinity).Match(node)
		if err != nil {
			return false, "", fmt.Errorf("daemonset %s/%s required node affinity: %w", ds.Namespace, ds.Name, err)
		}
		if !ok {
			return false, "its required node affinity does not match the node", nil
		}
	}
	tolerations := append(append([]corev1.Toleration(nil), spec.Tolerations...), daemonPodTolerations...)
	if spec.HostNetwork {
		tolerations = append(tolerations, hostNetworkDaemonToleration)
	}
	// Comparison operators on: a toleration using them was accepted by the
	// API server, so it means what it says; evaluating it off would read
	// it as not tolerating, which would uninstall by mistake.
	taint, untolerated := schedcorev1.FindMatchingUntoleratedTaint(klog.Background(), node.Spec.Taints, tolerations, func(t *corev1.Taint) bool {
		return t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute
	}, true)
	if untolerated {
		return false, fmt.Sprintf("the node's taint %s is not tolerated", taint.ToString()), nil
	}
	return true, "", nil
}
