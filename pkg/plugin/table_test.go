package plugin

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
)

// TestDecisionTable feeds the shared table to the plugin's snapshot tier
// (the agent away, the API server too): with the snapshot the agent
// writes for the case (the pod listed with the agent's decision, its
// namespace enabled as the policy says), a pod that must be captured
// waits, and a pod of an excluded namespace starts. The snapshot never
// vouches for the rest: they wait, but in the control plane's namespaces.
func TestDecisionTable(t *testing.T) {
	for _, c := range decisiontable.Cases() {
		t.Run(c.Name, func(t *testing.T) {
			policy, err := c.Policy()
			if err != nil {
				t.Fatal(err)
			}
			n := newNode(t)
			staleSocket(t, n.sock)
			n.fallback(t, fakeAPIDown)
			ns, uid := c.Namespace.Name, string(c.Pod.UID)
			s := &nodefiles.EnablementSnapshot{Generation: 1, ExcludedNamespaces: append([]string{}, c.Excluded...), Namespaces: []string{ns},
				Pods: map[string]bool{uid: c.Enroll}, Written: time.Now()}
			if policy.MayEnableNamespace(c.Namespace) {
				s.EnabledNamespaces = []string{ns}
			}
			if err := nodefiles.WriteSnapshot(n.layout().StateSnapshot(), s); err != nil {
				t.Fatal(err)
			}
			excluded, _ := json.Marshal(append([]string{}, c.Excluded...))
			args := fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=sb1;K8S_POD_UID=%s", ns, c.Pod.Name, uid)
			_, err = run(t, add, n.conf(`,"excludedNamespaces":`+string(excluded)), args)
			if err != nil && cniCode(t, err) != types.ErrTryAgainLater {
				t.Fatalf("error %v, want code 11 or success", err)
			}
			switch {
			case c.Enroll && err == nil:
				t.Errorf("a pod that must be captured started")
			case slices.Contains(c.Excluded, ns) && err != nil:
				t.Errorf("a pod of an excluded namespace waits: %v", err)
			}
		})
	}
}

// TestFallbackContract: every verdict the fallback binary can print (the
// contract's type, every field set) is read back as printed, and the
// request a runtime without pod UIDs gives carries none.
func TestFallbackContract(t *testing.T) {
	for _, v := range []ambient.FallbackVerdict{
		{Enroll: true, Reason: "namespace labelled ambient", AgentGone: "the agent's DaemonSet istio-system/ambient-cni is deleted"},
		{Reason: "pod labelled none"},
	} {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := parseVerdict(b); err != nil || got != v {
			t.Errorf("%s: read as %+v, %v", b, got, err)
		}
	}
	b, _ := json.Marshal(ambient.FallbackRequest{Namespace: "shop", Name: "web"})
	if string(b) != `{"namespace":"shop","name":"web"}` {
		t.Errorf("request %s", b)
	}
}
