package podcache_test

import (
	"context"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
)

// TestDecisionTable feeds the shared table to the cache's entry points:
// the CNI path (Decide), the pod controller's and the verifier's
// (DecideCached, on the trimmed pod the cache keeps), and the plugin's
// snapshot (NodeState, the decision the snapshot lists per pod).
func TestDecisionTable(t *testing.T) {
	for _, c := range decisiontable.Cases() {
		t.Run(c.Name, func(t *testing.T) {
			policy, err := c.Policy()
			if err != nil {
				t.Fatal(err)
			}
			k := fakecluster.New(t, podcache.Config{Policy: policy})
			k.Start()
			k.SetNamespace(c.Namespace)
			p := k.SetPod(c.Pod)
			check := func(what string, enroll bool, reason string) {
				t.Helper()
				if enroll != c.Enroll || (reason != "" && reason != string(c.Reason)) {
					t.Errorf("%s: enroll %v (%s), want %v (%s)", what, enroll, reason, c.Enroll, c.Reason)
				}
			}
			d, _, err := k.Cache.Decide(context.Background(), p.Namespace, p.Name, string(p.UID))
			if err != nil {
				t.Fatalf("Decide: %v", err)
			}
			check("Decide (CNI path)", d.Enroll, string(d.Reason))
			cached, err := k.Cache.Pod(p.Namespace, p.Name)
			if err != nil {
				t.Fatal(err)
			}
			d = k.Cache.DecideCached(cached)
			check("DecideCached", d.Enroll, string(d.Reason))
			_, pods := k.Cache.NodeState()
			enroll, listed := pods[string(p.UID)]
			if !listed {
				t.Errorf("NodeState does not list the pod: %v", pods)
			}
			check("NodeState (the snapshot's pods)", enroll, "")
		})
	}
}
