package controller_test

import (
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
)

// TestDecisionTable feeds the shared table to the pod controller's plan:
// a running pod the agent does not hold is captured exactly when the
// table says it must be, and one the agent holds is let go exactly when
// the table says it must not be.
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
			p := kube.SetPod(c.Pod)
			agent := newFakeAgent()
			ctl := controller.New(controller.Config{Pods: kube.Cache, Agent: agent, Finder: &fakeFinder{running: map[types.UID]bool{}}})
			key := types.NamespacedName{Namespace: p.Namespace, Name: p.Name}
			if capture, unenroll := ctl.Plan(key); capture != c.Enroll || unenroll != "" {
				t.Errorf("not held: capture %v, unenroll %q; want capture %v", capture, unenroll, c.Enroll)
			}
			agent.enrolled[key] = p.UID
			if capture, unenroll := ctl.Plan(key); capture || (unenroll == p.UID) == c.Enroll {
				t.Errorf("held: capture %v, unenroll %q; want it let go: %v", capture, unenroll, !c.Enroll)
			}
		})
	}
}
