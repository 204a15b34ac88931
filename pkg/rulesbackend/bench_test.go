package rulesbackend

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/internal/testnet"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/containernetworking/plugins/pkg/ns"
)

// BenchmarkBackends measures, for every backend as New builds it, one
// pod's Apply into a fresh namespace (both families: the shipped DNS
// capture default, real netns, real iptables-restore or netlink), the
// converged re-apply, Verify, and Remove. Namespaces are made outside the
// timed part; Remove's namespaces come from a timed-out Apply.
//
//	go test -run '^$' -bench . -benchtime 200x ./pkg/rulesbackend
func BenchmarkBackends(b *testing.B) {
	cfg := ruleset.PodConfig{DNSCapture: true}
	for _, bc := range backends {
		b.Run(bc.name, func(b *testing.B) {
			testnet.RequireRoot(b)
			testnet.RequireCommands(b, bc.tools...)
			be, err := New(Config{Backend: bc.value})
			if err != nil {
				b.Fatal(err)
			}
			r := be.Rules
			fresh := func(b *testing.B) []ns.NetNS {
				b.StopTimer()
				defer b.StartTimer()
				out := make([]ns.NetNS, b.N)
				for i := range out {
					out[i] = testnet.NewNS(b)
				}
				return out
			}
			b.Run("apply", func(b *testing.B) {
				nss := fresh(b)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := r.Apply(nss[i].Path(), cfg); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("reapply-converged", func(b *testing.B) {
				n := testnet.NewNS(b)
				if err := r.Apply(n.Path(), cfg); err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := r.Apply(n.Path(), cfg); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("verify", func(b *testing.B) {
				n := testnet.NewNS(b)
				if err := r.Apply(n.Path(), cfg); err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if d, err := r.Verify(n.Path(), cfg); err != nil || !d.Empty() {
						b.Fatal(err, d)
					}
				}
			})
			b.Run("remove", func(b *testing.B) {
				nss := fresh(b)
				b.StopTimer()
				for _, n := range nss {
					if err := r.Apply(n.Path(), cfg); err != nil {
						b.Fatal(err)
					}
				}
				b.StartTimer()
				for i := 0; i < b.N; i++ {
					if err := r.Remove(nss[i].Path()); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
