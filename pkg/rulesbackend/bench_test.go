package rulesbackend

import (
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// BenchmarkBackends measures, for every backend as New builds it, one
// pod's Apply into a fresh namespace (both families: the shipped DNS
// capture default, real netns, real iptables-restore or netlink), the
// converged re-apply, Verify, a verify by generation with nothing
// changed (the verifier's steady cost), and Remove. Namespaces are made
// outside the timed part. Besides wall time per operation it reports cpu-ms/op: the
// CPU time (user and system) of the process and the commands it ran,
// during the operations only.
//
//	go test -run '^$' -bench Backends -benchtime 200x ./pkg/rulesbackend
func BenchmarkBackends(b *testing.B) {
	cfg := ruleset.PodConfig{DNSCapture: true}
	for _, bc := range backends {
		b.Run(bc.name, func(b *testing.B) {
			testnet.RequireRoot(b)
			testnet.RequireCommands(b, bc.tools...)
			be, err := New(Config{Backend: mustParse(b, bc.value)})
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
				var cpu cpuMeter
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					cpu.start()
					if err := r.Apply(nss[i].Path(), cfg); err != nil {
						b.Fatal(err)
					}
					cpu.stop()
				}
				cpu.report(b)
			})
			b.Run("reapply-converged", func(b *testing.B) {
				n := testnet.NewNS(b)
				if err := r.Apply(n.Path(), cfg); err != nil {
					b.Fatal(err)
				}
				var cpu cpuMeter
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					cpu.start()
					if err := r.Apply(n.Path(), cfg); err != nil {
						b.Fatal(err)
					}
					cpu.stop()
				}
				cpu.report(b)
			})
			b.Run("verify", func(b *testing.B) {
				n := testnet.NewNS(b)
				if err := r.Apply(n.Path(), cfg); err != nil {
					b.Fatal(err)
				}
				var cpu cpuMeter
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					cpu.start()
					if d, err := r.Verify(n.Path(), cfg); err != nil || !d.Empty() {
						b.Fatal(err, d)
					}
					cpu.stop()
				}
				cpu.report(b)
			})
			// What the verifier pays per proof on a healthy pod: a verify
			// by the generation of the last clean one.
			b.Run("verify-unchanged", func(b *testing.B) {
				n := testnet.NewNS(b)
				if err := r.Apply(n.Path(), cfg); err != nil {
					b.Fatal(err)
				}
				gv := r.(ruleset.GenVerifier)
				d, gen, err := gv.VerifyGen(n.Path(), cfg, 0)
				if err != nil || !d.Empty() {
					b.Fatal(err, d)
				}
				var cpu cpuMeter
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					cpu.start()
					if d, _, err := gv.VerifyGen(n.Path(), cfg, gen); err != nil || !d.Empty() {
						b.Fatal(err, d)
					}
					cpu.stop()
				}
				cpu.report(b)
			})
			b.Run("remove", func(b *testing.B) {
				nss := fresh(b)
				b.StopTimer()
				for _, n := range nss {
					if err := r.Apply(n.Path(), cfg); err != nil {
						b.Fatal(err)
					}
				}
				var cpu cpuMeter
				b.StartTimer()
				for i := 0; i < b.N; i++ {
					cpu.start()
					if err := r.Remove(nss[i].Path()); err != nil {
						b.Fatal(err)
					}
					cpu.stop()
				}
				cpu.report(b)
			})
		})
	}
}

// cpuMeter sums the CPU time of the process and its waited-for children
// over the measured stretches.
type cpuMeter struct {
	total, at time.Duration
	n         int
}

func cpuNow() time.Duration {
	var self, children syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	_ = syscall.Getrusage(syscall.RUSAGE_CHILDREN, &children)
	d := func(tv syscall.Timeval) time.Duration { return time.Duration(tv.Nano()) }
	return d(self.Utime) + d(self.Stime) + d(children.Utime) + d(children.Stime)
}

func (m *cpuMeter) start() { m.at = cpuNow() }
func (m *cpuMeter) stop()  { m.total += cpuNow() - m.at; m.n++ }

func (m *cpuMeter) report(b *testing.B) {
	if m.n > 0 {
		b.ReportMetric(float64(m.total)/float64(m.n)/1e6, "cpu-ms/op")
	}
}
