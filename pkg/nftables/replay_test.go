package nftables

import (
	"bytes"
	"testing"

	gnft "github.com/google/nftables"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	dt "github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestFreshBatchIsExact checks that the batch Apply replays for a new pod
// is what google/nftables builds for the program, every time the same
// bytes (pkg/netfilter's tests check a Recorder keeps google/nftables'
// messages).
func TestFreshBatchIsExact(t *testing.T) {
	a := NewApplier(dt.Logger(t))
	t.Cleanup(func() { _ = a.Close() })
	for name, cfg := range goldenConfigs {
		t.Run(name, func(t *testing.T) {
			p, err := a.program(cfg)
			if err != nil {
				t.Fatal(err)
			}
			q, err := netfilter.NewRecorder()
			if err != nil {
				t.Fatal(err)
			}
			add(q.Conn, p)
			again, err := q.Batch()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(p.fresh.Bytes(7), again.Bytes(7)) {
				t.Fatal("the program's batch differs from a new rendering of it")
			}
			if p.fresh.Len() == 0 {
				t.Fatal("empty batch")
			}
		})
	}
}

// TestReplayInstallsWhatGoogleNftablesDoes: the replayed batch and
// google/nftables' own Flush of the same program leave the same ruleset.
func TestReplayInstallsWhatGoogleNftablesDoes(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft")
	a := NewApplier(dt.Logger(t))
	t.Cleanup(func() { _ = a.Close() })
	for name, cfg := range goldenConfigs {
		t.Run(name, func(t *testing.T) {
			p, err := a.program(cfg)
			if err != nil {
				t.Fatal(err)
			}
			byGoogle, byReplay := testnet.NewNS(t), testnet.NewNS(t)
			if err := netns.Do(byGoogle.Path(), func() error {
				c, err := gnft.New()
				if err != nil {
					return err
				}
				add(c, p)
				return c.Flush()
			}); err != nil {
				t.Fatal(err)
			}
			if err := a.Apply(byReplay.Path(), cfg); err != nil {
				t.Fatal(err)
			}
			if x, y := nftRuleset(t, byGoogle.Path()), nftRuleset(t, byReplay.Path()); x != y {
				t.Fatalf("google/nftables' flush and the replay differ:\n--- google/nftables\n%s--- replay\n%s", x, y)
			}
		})
	}
}
