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

// TestRelevantLinksByName: a link counts by its name, not its type: a
// suite beside the e2e makes veth pairs of its own names in the host's
// namespace for a moment (testnet's tna…/tnb…), the node's pod veths are
// named veth….
func TestRelevantLinksByName(t *testing.T) {
	diff := []string{"links: + tnb383af821 veth", "links: + veth1a2b3c4d veth", "links: + anodec1a2b3 bridge"}
	got := Relevant(diff)
	if want := []string{"links: + veth1a2b3c4d veth", "links: + anodec1a2b3 bridge"}; !slices.Equal(got, want) {
		t.Errorf("Relevant = %q, want %q", got, want)
	}
}
