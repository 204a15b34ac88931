package enablement_test

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/decisiontable"
)

// TestDecisionTable: the policy itself gives the table's answers; every
// other entry point's TestDecisionTable checks it agrees.
func TestDecisionTable(t *testing.T) {
	for _, c := range decisiontable.Cases() {
		p, err := c.Policy()
		if err != nil {
			t.Fatal(err)
		}
		if d := p.Decide(c.Pod, c.Namespace); d.Enroll != c.Enroll || d.Reason != c.Reason {
			t.Errorf("%s: %+v, want enroll %v (%s)", c.Name, d, c.Enroll, c.Reason)
		}
	}
}
