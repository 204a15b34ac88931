package policyroute

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestEnsureRemove: adding reports what it added, a second add adds
// nothing, removal of the named parts leaves the other.
func TestEnsureRemove(t *testing.T) {
	testnet.RequireRoot(t)
	n := testnet.NewNS(t)
	want := ruleset.PodRules(ruleset.PodConfig{}, ruleset.IPv4).Routing
	var c *Conn
	if err := netns.Do(n.Path(), func() error {
		st, err := netns.ReadState()
		if err != nil {
			return err
		}
		c, err = Dial(st.LoopbackIndex)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, err := c.EnsurePolicyRoute(ruleset.IPv4, want); err != nil || got != All {
		t.Fatalf("first ensure: %+v %v", got, err)
	}
	if got, err := c.EnsurePolicyRoute(ruleset.IPv4, want); err != nil || got.Any() {
		t.Fatalf("second ensure: %+v %v", got, err)
	}
	if err := c.RemovePolicyRoute(ruleset.IPv4, want, Parts{Rule: true}); err != nil {
		t.Fatal(err)
	}
	if rule, route, err := c.PolicyRouteState(ruleset.IPv4, want); err != nil || rule || !route {
		t.Fatalf("after removing the rule: rule %v route %v %v", rule, route, err)
	}
	if d := Drift(ruleset.IPv4, want, false, true); len(d) != 1 || d[0].Object != "ip rule" {
		t.Fatalf("drift %v", d)
	}
	if err := c.RemovePolicyRoute(ruleset.IPv4, want, All); err != nil {
		t.Fatal(err)
	}
	if err := c.RemovePolicyRoute(ruleset.IPv4, want, All); err != nil {
		t.Fatalf("second remove: %v", err)
	}
}
