package nodeagent

import (
	"path/filepath"
	"testing"

	"golang.org/x/time/rate"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// TestAnnotationBudget: the annotation writes are paced by a budget of
// their own, the kubelet's 50/s with burst 100 unless configured.
func TestAnnotationBudget(t *testing.T) {
	for _, tc := range []struct {
		qps   float64
		burst int
		want  rate.Limit
		wantB int
	}{
		{0, 0, DefaultAnnotationQPS, DefaultAnnotationBurst},
		{7.5, 15, 7.5, 15},
	} {
		dir := t.TempDir()
		a, err := NewAgent(Config{Rules: newRecordedRules(), Annotator: &fakeAnnotator{}, AnnotationQPS: tc.qps, AnnotationBurst: tc.burst,
			SnapshotFile: filepath.Join(dir, "snap"), SpoolDir: filepath.Join(dir, "spool"), RecordDir: nodefiles.InDir(dir).Records()})
		if err != nil {
			t.Fatal(err)
		}
		if l := a.annotations.limit; l.Limit() != tc.want || l.Burst() != tc.wantB {
			t.Errorf("configured %v/%d: limit %v burst %d, want %v/%d", tc.qps, tc.burst, l.Limit(), l.Burst(), tc.want, tc.wantB)
		}
	}
}
