package fallback

import (
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
)

// TestDecisionTable feeds the shared table to the fallback binary's
// decision: the pod and its namespace as the API server serves them, the
// policy as the agent writes it into the plugin's credential.
func TestDecisionTable(t *testing.T) {
	for _, c := range decisiontable.Cases() {
		s, cred := newServer(t)
		s.pods = map[string]*corev1.Pod{c.Pod.Namespace + "/" + c.Pod.Name: c.Pod}
		s.nss = map[string]*corev1.Namespace{c.Namespace.Name: c.Namespace}
		cred.Policy = c.Wire()
		v, err := decide(t, cred, c.Pod.Namespace, c.Pod.Name, string(c.Pod.UID))
		if err != nil || v.Enroll != c.Enroll || v.Reason != string(c.Reason) {
			t.Errorf("%s: %+v, %v; want enroll %v (%s)", c.Name, v, err, c.Enroll, c.Reason)
		}
	}
}
