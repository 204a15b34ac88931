package apicalls

import (
	"context"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/ambient-cni/ambient-cni/pkg/dsplacement"
)

// IstioCNIDaemonSet is the name of istio-cni's DaemonSet in Istio's chart.
const IstioCNIDaemonSet = "istio-cni-node"

// IstioCNILeft tells whether istio-cni's DaemonSet has left a node for
// good, as the takeover needs: its agent's socket is also missing while
// its pod restarts or after a reboot, and it comes back then, chaining
// itself after our entry. Read through a list by name, which the agent's
// Role allows in its namespace.
type IstioCNILeft struct {
	// Client reads the DaemonSet and the node.
	Client UpgradeClient
	// Namespace and DaemonSet name istio-cni's DaemonSet.
	Namespace, DaemonSet string
	// Node is the agent's node.
	Node string
}

// Check returns nil when istio-cni's DaemonSet is being deleted or no
// longer schedules onto the node (a nodeSelector or a required node
// affinity the node no longer matches, an untolerated taint); otherwise an
// error saying why not, or why it cannot tell. A DaemonSet not found is
// not proof: it may live in another namespace than the one looked in.
func (l IstioCNILeft) Check(ctx context.Context) error {
	found, targets, err := l.targets(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("cannot tell whether istio-cni's DaemonSet %s/%s still schedules onto node %s: %w", l.Namespace, l.DaemonSet, l.Node, err)
	case !found:
		return fmt.Errorf("istio-cni's DaemonSet %s/%s not found, which is no proof that it left node %s (set migration.fromIstioCNI.daemonSet to its name; it must be in the release's namespace)", l.Namespace, l.DaemonSet, l.Node)
	case targets:
		return fmt.Errorf("istio-cni's DaemonSet %s/%s still schedules onto node %s (its pod is away, not gone): label the node out of it first", l.Namespace, l.DaemonSet, l.Node)
	}
	return nil
}

// Targets reports whether istio-cni's DaemonSet is present, not being
// deleted, and schedules onto the node: istio-cni is there or coming back.
func (l IstioCNILeft) Targets(ctx context.Context) (bool, error) {
	_, targets, err := l.targets(ctx)
	return targets, err
}

func (l IstioCNILeft) targets(ctx context.Context) (found, targets bool, err error) {
	list, err := l.Client.ListDaemonSets(ctx, l.Namespace, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", l.DaemonSet).String(),
	})
	if err != nil {
		return false, false, err
	}
	for i := range list.Items {
		ds := &list.Items[i]
		if ds.Name != l.DaemonSet {
			continue
		}
		if ds.DeletionTimestamp != nil {
			return true, false, nil
		}
		node, err := l.Client.GetNode(ctx, l.Node)
		if err != nil {
			return true, false, err
		}
		t, _, err := dsplacement.TargetsNode(ds, node)
		return true, t, err
	}
	return false, false, nil
}
