package realnode

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestRelevantLeavesOtherProgramsMounts: a host path that became a mount
// point beside the node (ip netns's /run/netns, made by a suite running
// beside the e2e) is another program's, not the node's leftover; a host
// path the node left without a mount on it still counts.
func TestRelevantLeavesOtherProgramsMounts(t *testing.T) {
	dir := t.TempDir()
	netns, kubelet := filepath.Join(dir, "netns"), filepath.Join(dir, "kubelet")
	for _, p := range []string{netns, kubelet} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	diff := []string{
		"files: + " + kubelet,
		"files: + " + netns,
		"mounts: + " + netns + " ext4 " + netns,
	}
	got := Relevant(diff)
	if want := []string{"files: + " + kubelet}; !slices.Equal(got, want) {
		t.Errorf("Relevant = %q, want %q", got, want)
	}
}
