package verifier

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
)

// TestDecisionTable feeds the shared table to the verifier, over the
// agent's real pod cache: a running pod the agent does not hold is looked
// for as uncaptured, and one it holds is proven, exactly when the table
// says it must be captured, but for a pod being deleted, which the
// verifier leaves alone either way.
func TestDecisionTable(t *testing.T) {
	for _, c := range decisiontable.Cases() {
		t.Run(c.Name, func(t *testing.T) {
			policy, err := c.Policy()
			if err != nil {
				t.Fatal(err)
			}
			kube := fakecluster.New(t, podcache.Config{Policy: policy})
			kube.Start()
			kube.SetNamespace(c.Namespace)
			kube.SetPod(c.Pod)
			node := newFakeNode()
			v := New(Config{Agent: node, Pods: kube.Cache, Probe: node})
			p, err := kube.Cache.Pod(c.Pod.Namespace, c.Pod.Name)
			if err != nil {
				t.Fatal(err)
			}
			want := c.Enroll && !c.Going
			if got := v.uncaptured(p); got != want {
				t.Errorf("not held: uncaptured %v, want %v", got, want)
			}
			node.enrolled[p.UID] = &nodeagent.EnrolledPod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, State: nodeagent.StateEnabled}
			if _, _, got := v.subject(p.UID); got != want {
				t.Errorf("held: proven %v, want %v", got, want)
			}
		})
	}
}
