package rulesbackend

import (
	"net/netip"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// BenchmarkProbeIPs measures, on a host probe set holding 500 pods' IPs,
// listing it and asking whether it holds one pod's IP (Lacks, what the
// verifier asks for every proof).
//
//	go test -run '^$' -bench ProbeIPs -benchtime 200x ./pkg/rulesbackend
func BenchmarkProbeIPs(b *testing.B) {
	for _, bc := range backends {
		b.Run(bc.name, func(b *testing.B) {
			testnet.RequireRoot(b)
			testnet.RequireCommands(b, append(bc.tools, "ipset")...)
			h := testnet.NewNS(b)
			be, err := New(Config{Backend: mustParse(b, bc.value), HostNetns: h.Path()})
			if err != nil {
				b.Fatal(err)
			}
			p := be.Probe
			if err := p.Ensure(); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = p.Remove() })
			for i := range 500 {
				if err := p.AddIP(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})); err != nil {
					b.Fatal(err)
				}
			}
			b.Run("list", func(b *testing.B) {
				var cpu cpuMeter
				for i := 0; i < b.N; i++ {
					cpu.start()
					if ips, err := p.IPs(); err != nil || len(ips) != 500 {
						b.Fatal(err, len(ips))
					}
					cpu.stop()
				}
				cpu.report(b)
			})
			b.Run("lacks", func(b *testing.B) {
				one := []netip.Addr{netip.AddrFrom4([4]byte{10, 1, 1, 7})}
				var cpu cpuMeter
				for i := 0; i < b.N; i++ {
					cpu.start()
					if lack, err := p.Lacks(one); err != nil || len(lack) != 0 {
						b.Fatal(err, lack)
					}
					cpu.stop()
				}
				cpu.report(b)
			})
		})
	}
}
