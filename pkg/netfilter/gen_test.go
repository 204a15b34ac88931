package netfilter

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The generation is the namespace's own: it moves with every change made
// there, by nft or iptables-nft, and with nothing made elsewhere.
func TestGeneration(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft", "iptables-nft")
	a, b := testnet.NewNS(t), testnet.NewNS(t)
	gen := func(path string) uint32 {
		t.Helper()
		g, err := Generation(path)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	g0 := gen(a.Path())
	if again := gen(a.Path()); again != g0 {
		t.Fatalf("generation moved with nothing changed: %d then %d", g0, again)
	}
	sh(t, b, "nft", "add", "table", "inet", "elsewhere")
	if g := gen(a.Path()); g != g0 {
		t.Fatalf("a change in another namespace moved this one's generation: %d then %d", g0, g)
	}
	sh(t, a, "nft", "add", "table", "inet", "t")
	g1 := gen(a.Path())
	if g1 == g0 {
		t.Fatalf("nft add table left the generation at %d", g0)
	}
	sh(t, a, "iptables-nft", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "1", "-j", "ACCEPT")
	if g := gen(a.Path()); g == g1 {
		t.Fatalf("an iptables-nft rule left the generation at %d", g1)
	}
}
