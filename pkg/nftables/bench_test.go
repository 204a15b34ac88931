package nftables

import (
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	gnft "github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// cpuClock is the process's CPU time (user + system).
func cpuClock(b *testing.B) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// onFreshNS runs op b.N times, each on a new namespace with lo up, timing
// (and counting the CPU and allocations of) op alone.
func onFreshNS(b *testing.B, op func(n ns.NetNS) error) {
	testnet.RequireRoot(b)
	var cpu time.Duration
	b.StopTimer()
	for range b.N {
		n := testnet.NewNS(b)
		c0 := cpuClock(b)
		b.StartTimer()
		err := op(n)
		b.StopTimer()
		cpu += cpuClock(b) - c0
		if err != nil {
			b.Fatal(err)
		}
		if err := testnet.RemoveNS(n); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// BenchmarkFreshBatch is the pod's nf_tables batch alone (for the whole
// Apply, see pkg/rulesbackend's BenchmarkBackends), in a new
// namespace: sent as google/nftables sends it (every message acked, one
// receive each, the messages built each time), and replayed as Apply
// does (built once, one ack).
func BenchmarkFreshBatch(b *testing.B) {
	a := NewApplier(nil)
	p, err := a.program(ruleset.PodConfig{DNSCapture: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("google-nftables", func(b *testing.B) {
		onFreshNS(b, func(n ns.NetNS) error {
			var c *gnft.Conn
			if err := netns.Do(n.Path(), func() error {
				var err error
				c, err = gnft.New(gnft.AsLasting())
				return err
			}); err != nil {
				return err
			}
			defer func() { _ = c.CloseLasting() }()
			add(c, p)
			return c.Flush()
		})
	})
	b.Run("replay", func(b *testing.B) {
		onFreshNS(b, func(n ns.NetNS) error {
			var s *netfilter.Socket
			if err := netns.Do(n.Path(), func() error {
				var err error
				s, err = netfilter.DialSocket()
				return err
			}); err != nil {
				return err
			}
			defer func() { _ = s.Close() }()
			return s.Send(p.fresh)
		})
	})
}

// BenchmarkProbeSetAdd is what enrolling a pod costs the host probe SNAT:
// one pod IP added to its family's set.
func BenchmarkProbeSetAdd(b *testing.B) {
	testnet.RequireRoot(b)
	n := testnet.NewNS(b)
	h := NewHostProbe(nil, n.Path(), ruleset.HostProbeConfig{})
	b.Cleanup(func() { _ = h.Close() })
	if err := h.Ensure(); err != nil {
		b.Fatal(err)
	}
	var cpu time.Duration
	c0 := cpuClock(b)
	b.ResetTimer()
	for i := range b.N {
		if err := h.AddIP(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	cpu = cpuClock(b) - c0
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}
