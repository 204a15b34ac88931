package rulesbackend

import (
	"net/netip"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestCloseReleasesConnections: the nftables host probe keeps a netlink
// connection between calls, and the appliers close some connections in the
// background; Close leaves no descriptor of the backend's open (install-cni
// closes the backend at shutdown, once nothing uses it).
func TestCloseReleasesConnections(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "ip")
	host, pod := testnet.NewNS(t), testnet.NewNS(t)
	b, err := New(Config{Backend: mustParse(t, string(NFTables)), HostNetns: host.Path()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Probe.Remove(); _ = b.Close() })
	ip := netip.MustParseAddr("10.250.0.7")
	use := func() {
		t.Helper()
		if err := b.Probe.Ensure(); err != nil {
			t.Fatal(err)
		}
		if err := b.Probe.AddIP(ip); err != nil {
			t.Fatal(err)
		}
		if err := b.Probe.DelIP(ip); err != nil {
			t.Fatal(err)
		}
		if err := b.Rules.Apply(pod.Path(), ruleset.PodConfig{}); err != nil {
			t.Fatal(err)
		}
		if err := b.Rules.Remove(pod.Path()); err != nil {
			t.Fatal(err)
		}
	}
	// Once first, so that what the runtime opens once is not counted.
	use()
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	before := testnet.OpenFDs(t)
	use()
	if held := testnet.OpenFDs(t); held <= before {
		t.Fatalf("%d descriptors open while in use, %d before: the backend held nothing, so this test proves nothing", held, before)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if after := testnet.OpenFDs(t); after != before {
		t.Errorf("%d descriptors open after Close, %d before use", after, before)
	}
}
