package ruleset

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// PodConfig holds the options for one pod's rule set.
type PodConfig struct {
	// ProbeSNATv4 and ProbeSNATv6 are the sources kubelet probes are SNATed
	// to on the host; traffic from (and to) them bypasses capture. The zero
	// value means ambient.DefaultProbeSNATv4 / ambient.DefaultProbeSNATv6.
	ProbeSNATv4, ProbeSNATv6 netip.Addr
	// DNSCapture redirects DNS (UDP and TCP port 53) to ztunnel's 15053.
	DNSCapture bool
	// BypassInbound disables inbound redirection to 15006 (ingress mode).
	BypassInbound bool
	// VirtualInterfaces are interfaces in the pod (KubeVirt's bridge to a
	// VM, say) whose incoming TCP is redirected to ztunnel's outbound port
	// as if the pod had sent it, whatever BypassInbound says. A trailing
	// "+" matches every name with that prefix, as with iptables -i.
	VirtualInterfaces []string
	// IPv4Only leaves IPv6 alone (Istio's ambient.ipv6: false): no IPv6
	// capture rules and no IPv6 policy route in the pod, so a dual-stack
	// pod's IPv6 traffic goes direct. The zero value captures both.
	IPv4Only bool
}

// Families lists the families whose rules belong to the desired state of a
// namespace: IPv4, and IPv6 when nsIPv6 (the namespace has IPv6) and the
// options do not leave it alone.
func (c PodConfig) Families(nsIPv6 bool) []Family {
	if nsIPv6 && !c.IPv4Only {
		return []Family{IPv4, IPv6}
	}
	return []Family{IPv4}
}

// StaleIPv6 reports whether c leaves IPv6 alone in a namespace that has
// it (nsIPv6: IPv6 on, or an IPv6 address on lo), where a previous
// configuration may have left IPv6 rules and an IPv6 policy route for
// removal to clear.
func (c PodConfig) StaleIPv6(nsIPv6 bool) bool { return c.IPv4Only && nsIPv6 }

// MaxVirtualInterfaces bounds PodConfig.VirtualInterfaces: each name costs
// a rule per family, and an annotation is not a place for hundreds.
const MaxVirtualInterfaces = 32

// validInterface accepts what the kernel accepts as an interface name (1 to
// 15 bytes, no '/', ':' or whitespace, not "." or "..") in printable ASCII
// without quotes or backslashes, with an optional trailing "+" wildcard.
func validInterface(name string) error {
	base := strings.TrimSuffix(name, "+")
	if base == "" || len(name) > 15 || name == "." || name == ".." {
		return fmt.Errorf("virtual interface name %q: want 1 to 15 characters", name)
	}
	for i := 0; i < len(base); i++ {
		c := base[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte("/:\"'+*\\", c) >= 0 {
			return fmt.Errorf("virtual interface name %q: character %q not allowed", name, c)
		}
	}
	return nil
}

// WithDefaults fills in the probe addresses.
func (c PodConfig) WithDefaults() PodConfig {
	if !c.ProbeSNATv4.IsValid() {
		c.ProbeSNATv4 = ambient.DefaultProbeSNATv4
	}
	if !c.ProbeSNATv6.IsValid() {
		c.ProbeSNATv6 = ambient.DefaultProbeSNATv6
	}
	return c
}

// Validate rejects probe addresses of the wrong family or with a zone, and
// virtual interface names no backend could take.
func (c PodConfig) Validate() error {
	c = c.WithDefaults()
	if !c.ProbeSNATv4.Unmap().Is4() {
		return fmt.Errorf("probe SNAT v4 address %s is not IPv4", c.ProbeSNATv4)
	}
	if !c.ProbeSNATv6.Is6() || c.ProbeSNATv6.Is4In6() || c.ProbeSNATv6.Zone() != "" {
		return fmt.Errorf("probe SNAT v6 address %s is not a plain IPv6 address", c.ProbeSNATv6)
	}
	if len(c.VirtualInterfaces) > MaxVirtualInterfaces {
		return fmt.Errorf("%d virtual interfaces, at most %d", len(c.VirtualInterfaces), MaxVirtualInterfaces)
	}
	for _, n := range c.VirtualInterfaces {
		if err := validInterface(n); err != nil {
			return err
		}
	}
	return nil
}

// Probe returns the probe SNAT address for family f.
func (c PodConfig) Probe(f Family) netip.Addr {
	c = c.WithDefaults()
	if f == IPv6 {
		return c.ProbeSNATv6
	}
	return c.ProbeSNATv4.Unmap()
}

// HostProbeConfig holds the host-side options.
type HostProbeConfig struct {
	// ProbeSNATv4 and ProbeSNATv6 are the SNAT sources; zero means the
	// ambient defaults. They must match the pods' PodConfig.
	ProbeSNATv4, ProbeSNATv6 netip.Addr
	// IPv4Only leaves IPv6 alone, as PodConfig.IPv4Only does in pods: no
	// IPv6 probe SNAT and no IPv6 probe set on the host.
	IPv4Only bool
	// NoBranchENI turns off the probe path of branch ENI pods (see
	// BranchENIRules), which is on by default, as in Istio, and inert on
	// nodes not prepared for them.
	NoBranchENI bool
}

// Pod returns the pod options with the same probe addresses and families.
func (c HostProbeConfig) Pod() PodConfig {
	return PodConfig{ProbeSNATv4: c.ProbeSNATv4, ProbeSNATv6: c.ProbeSNATv6, IPv4Only: c.IPv4Only}
}

// Families lists the families the host probe SNAT covers on a host with
// IPv6 (hostIPv6) or without.
func (c HostProbeConfig) Families(hostIPv6 bool) []Family { return c.Pod().Families(hostIPv6) }

// Validate rejects probe addresses of the wrong family.
func (c HostProbeConfig) Validate() error { return c.Pod().Validate() }

// Probe returns the SNAT source for family f, for callers wiring the pods'
// PodConfig to the same addresses.
func (c HostProbeConfig) Probe(f Family) netip.Addr { return c.Pod().Probe(f) }
