package nodefiles

import (
	"encoding/json"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

func TestSnapshotRule(t *testing.T) {
	var missing *EnablementSnapshot
	if !missing.MayNeedCapture("shop") {
		t.Error("missing snapshot must fail closed")
	}
	s := &EnablementSnapshot{Generation: 1, EnabledNamespaces: []string{"shop"}, ExcludedNamespaces: []string{"kube-system"}}
	if !s.MayNeedCapture("shop") || s.MayNeedCapture("other") || s.MayNeedCapture("kube-system") {
		t.Errorf("namespace rule wrong: %+v", s)
	}
	s.PodLevelEnablement = true
	if !s.MayNeedCapture("other") || s.MayNeedCapture("kube-system") {
		t.Errorf("pod-level rule wrong: %+v", s)
	}
}

func TestParseSnapshot(t *testing.T) {
	good, _ := json.Marshal(EnablementSnapshot{Generation: 3, EnabledNamespaces: []string{"a"}})
	if s, err := ParseSnapshot(good); err != nil || s.Generation != 3 {
		t.Fatalf("ParseSnapshot(good) = %v, %v", s, err)
	}
	for name, in := range map[string][]byte{
		"empty":          nil,
		"garbage":        []byte("{{{"),
		"zero gen":       []byte(`{"generation":0}`),
		"wrong type":     []byte(`{"generation":"1"}`),
		"huge":           make([]byte, maxSnapshotBytes+1),
		"negative gen":   []byte(`{"generation":-4}`),
		"array not obj":  []byte(`[1,2]`),
		"trailing bytes": []byte(`{"generation":1} x`),
	} {
		if _, err := ParseSnapshot(in); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzParseSnapshot(f *testing.F) {
	fuzzseed.Add(f, "FuzzParseSnapshot")
	f.Add([]byte(`{"generation":1,"enabledNamespaces":["a"],"podLevelEnablement":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseSnapshot(b)
		if err == nil && s.Generation <= 0 {
			t.Fatalf("accepted generation %d", s.Generation)
		}
	})
}
