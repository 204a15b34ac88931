// Package dsplacement tells whether a DaemonSet's controller would run its
// pod on a node, as its own predicate decides. It is pure (API types and
// the scheduler's helpers, no client), so both the agent and the plugin's
// fallback binary link it.
package dsplacement

import (
	"fmt"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	schedcorev1 "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"

	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
)

// systemTaintPrefixes name the taints Kubernetes itself puts on a node
// for its conditions (not ready, unreachable, under pressure, cordoned,
// network unavailable, not yet initialised by its cloud provider). They
// come and go with the node's state, and the DaemonSet controller
// tolerates most of them for every daemon anyway; a node in such a state
// gets its agent back once it recovers, so none of them is proof that
// the DaemonSet left the node. Only the operator's own taints count.
var systemTaintPrefixes = []string{"node.kubernetes.io/", "node.cloudprovider.kubernetes.io/"}

// systemTaint also holds for the CNI startup taint: it is on the node to
// wait for the agent (registered with it, or put back by the last agent's
// shutdown), never a sign that the DaemonSet left.
func systemTaint(t *corev1.Taint) bool {
	return t.Key == nodetaint.Key || slices.ContainsFunc(systemTaintPrefixes, func(p string) bool { return strings.HasPrefix(t.Key, p) })
}

// TargetsNode reports whether the DaemonSet controller would
// start ds's pod on node, as its own predicate decides: the template's
// nodeName, nodeSelector and required node affinity (matchExpressions and
// matchFields) must match the node, and every NoSchedule or NoExecute
// taint on it must be tolerated by the template, Kubernetes' own
// condition taints aside (systemTaintPrefixes). When it does not, why
// names the first reason. An error (a selector that does not parse)
// decides nothing.
func TargetsNode(ds *appsv1.DaemonSet, node *corev1.Node) (targets bool, why string, err error) {
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
	// Comparison operators on: a toleration using them was accepted by the
	// API server, so it means what it says; evaluating it off would read
	// it as not tolerating, which would uninstall by mistake.
	taint, untolerated := schedcorev1.FindMatchingUntoleratedTaint(klog.Background(), node.Spec.Taints, spec.Tolerations, func(t *corev1.Taint) bool {
		return (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute) && !systemTaint(t)
	}, true)
	if untolerated {
		return false, fmt.Sprintf("the node's taint %s is not tolerated", taint.ToString()), nil
	}
	return true, "", nil
}
