package nodeagent

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// genRules answers VerifyGen with a fixed generation and the drift it is
// given, and records the generation each call was passed.
type genRules struct {
	*recordedRules
	gen    uint32
	drift  ruleset.Drift
	passed []uint32
}

func (g *genRules) VerifyGen(_ string, _ ruleset.PodConfig, gen uint32) (ruleset.Drift, uint32, error) {
	g.passed = append(g.passed, gen)
	return g.drift, g.gen, nil
}

// Inspect hands the backend the generation of the pod's last clean
// verify, so an unchanged pod is not read again, and forgets it once the
// rules drifted: the next verify reads in full.
func TestInspectVerifiesByGeneration(t *testing.T) {
	testnet.RequireRoot(t)
	pn := testnet.NewNS(t)
	h, err := netns.Open(pn.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	rules := &genRules{recordedRules: newRecordedRules(), gen: 7}
	a := &Agent{cfg: Config{Rules: rules}}
	e := &entry{ns: h}
	verify := func() {
		t.Helper()
		if _, err := a.verifyRules(e); err != nil {
			t.Fatal(err)
		}
	}
	verify() // nothing known: read in full
	verify() // clean at 7: passed 7
	rules.drift = ruleset.Drift{Items: []ruleset.DriftItem{{Kind: ruleset.DriftMissing, Object: "chain"}}}
	verify() // drifted: forgotten
	rules.drift = ruleset.Drift{}
	verify() // read in full again
	verify()
	want := []uint32{0, 7, 7, 0, 7}
	if len(rules.passed) != len(want) {
		t.Fatalf("generations passed %v, want %v", rules.passed, want)
	}
	for i := range want {
		if rules.passed[i] != want[i] {
			t.Fatalf("generations passed %v, want %v", rules.passed, want)
		}
	}
}
