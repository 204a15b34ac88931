package app

import (
	"io"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/fallback"
	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
)

// TestCredentialPolicyDecidesAsTheAgent: the policy the agent writes into
// the plugin's credential, read back as the fallback binary reads it,
// decides every pod of the shared table as the agent's own policy does,
// whatever the settings (each case's pod decided under each setting).
func TestCredentialPolicyDecidesAsTheAgent(t *testing.T) {
	self := []string{"--node-name=n1", "--pod-namespace=" + decisiontable.AgentNamespace, "--pod-name=" + decisiontable.AgentPod}
	for _, args := range [][]string{
		nil,
		{"--excluded-namespaces=", "--data-plane-namespaces=istio-system,kube-system"},
		{`--enablement-selector=[{podSelector: {matchLabels: {mesh: "on"}}}, {namespaceSelector: {matchLabels: {team: a}}}]`},
		{"--enablement-selector=[]"},
	} {
		c, err := Parse(append(self, args...), env(nil), io.Discard)
		if err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		agent := c.EnablementPolicy()
		fallback, err := fallback.Policy(credentialPolicy(c))
		if err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		for _, tc := range decisiontable.Cases() {
			a, f := agent.Decide(tc.Pod, tc.Namespace), fallback.Decide(tc.Pod, tc.Namespace)
			if a != f {
				t.Errorf("%q, %s: the agent decides %+v, the fallback %+v", args, tc.Name, a, f)
			}
		}
	}
}
