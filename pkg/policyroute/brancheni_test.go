package policyroute_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	cnins "github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	dt "github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// hostProbe is what the test needs of either backend's host probe.
type hostProbe interface {
	Ensure() error
	AddIP(netip.Addr) error
	DelIP(netip.Addr) error
	Remove() error
	RemoveBranchENI() error
	Close() error
}

// sgpNode is a node and a branch ENI pod wired as the VPC CNI does it for
// security groups for pods (strict mode): the node's own ENI ("trunk", a
// veth to a namespace that answers nothing, so nothing leaves the
// machine) carries a VLAN for the pod's branch ENI; the pod's veth and the
// VLAN select, by iif rules, a table of the pod's own whose default route
// leaves by the VLAN and whose host route names the veth. The main table
// has no route to the pod.
type sgpNode struct {
	node, pod cnins.NetNS
	podIP     netip.Addr
	table     int
	veth      string
	port      int
}

func must(err error, what string) error {
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

func newSGPNode(t *testing.T, earlyDemux string) *sgpNode {
	t.Helper()
	s := &sgpNode{
		node:  testnet.NewNS(t),
		pod:   testnet.NewNS(t),
		podIP: netip.AddrFrom4([4]byte{10, 77, byte(rand.IntN(250) + 1), byte(rand.IntN(250) + 2)}),
		table: 100 + rand.IntN(1000) + 1,
		veth:  testnet.RandName("vlan", 8),
	}
	vlanName := testnet.RandName("vl.", 8)
	podFD := int(s.pod.Fd())
	vpc := testnet.NewNS(t)
	vpcFD := int(vpc.Fd())
	var podMAC, hostMAC net.HardwareAddr
	err := s.node.Do(func(cnins.NetNS) error {
		// EKS nodes disable early demux for branch ENI pods and filter
		// reverse paths strictly, which the forward rule must satisfy too.
		for file, v := range map[string]string{"tcp_early_demux": earlyDemux, "conf/all/rp_filter": "1", "conf/default/rp_filter": "1"} {
			if err := os.WriteFile("/proc/sys/net/ipv4/"+file, []byte(v), 0o644); err != nil {
				return err
			}
		}
		// The node's ENI leads to a namespace of its own standing for the
		// VPC, which answers nothing.
		trunk := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: testnet.RandName("eni", 8)}, PeerName: testnet.RandName("vpc", 8)}
		if err := must(netlink.LinkAdd(trunk), "add trunk"); err != nil {
			return err
		}
		far, err := netlink.LinkByName(trunk.PeerName)
		if err != nil {
			return err
		}
		if err := must(netlink.LinkSetNsFd(far, vpcFD), "move trunk peer"); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(trunk); err != nil {
			return err
		}
		nodeAddr, _ := netlink.ParseAddr("10.76.0.10/24")
		if err := must(netlink.AddrAdd(trunk, nodeAddr), "node address"); err != nil {
			return err
		}
		if err := must(netlink.RouteAdd(&netlink.Route{LinkIndex: trunk.Index, Gw: net.IPv4(10, 76, 0, 1)}), "node default route"); err != nil {
			return err
		}
		var vlan netlink.Link = &netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: vlanName, ParentIndex: trunk.Index}, VlanId: 1 + rand.IntN(4000)}
		err = netlink.LinkAdd(vlan)
		if errors.Is(err, unix.EOPNOTSUPP) {
			// A kernel without 802.1Q: a second link to the VPC stands in
			// for the VLAN. The routing is the same; only the tag is not.
			t.Log("no 802.1Q in this kernel: a veth to the VPC namespace stands in for the VLAN")
			v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: vlanName}, PeerName: testnet.RandName("vpc", 8)}
			if err = netlink.LinkAdd(v); err == nil {
				var far netlink.Link
				if far, err = netlink.LinkByName(v.PeerName); err == nil {
					err = netlink.LinkSetNsFd(far, vpcFD)
				}
			}
			vlan = v
		}
		if err := must(err, "add vlan"); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(vlan); err != nil {
			return err
		}
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: s.veth}, PeerName: testnet.RandName("pod", 8)}
		if err := must(netlink.LinkAdd(veth), "add veth"); err != nil {
			return err
		}
		peer, err := netlink.LinkByName(veth.PeerName)
		if err != nil {
			return err
		}
		podMAC = peer.Attrs().HardwareAddr
		if err := must(netlink.LinkSetNsFd(peer, podFD), "move veth peer"); err != nil {
			return err
		}
		hv, err := netlink.LinkByName(s.veth)
		if err != nil {
			return err
		}
		hostMAC = hv.Attrs().HardwareAddr
		if err := netlink.LinkSetUp(hv); err != nil {
			return err
		}
		pod := &net.IPNet{IP: s.podIP.AsSlice(), Mask: net.CIDRMask(32, 32)}
		for _, r := range []*netlink.Route{
			{LinkIndex: hv.Attrs().Index, Dst: pod, Scope: netlink.SCOPE_LINK, Table: s.table},
			{LinkIndex: vlan.Attrs().Index, Gw: net.IPv4(10, 76, 1, 1), Flags: int(netlink.FLAG_ONLINK), Table: s.table},
		} {
			if err := must(netlink.RouteAdd(r), "pod table route"); err != nil {
				return err
			}
		}
		for _, iif := range []string{s.veth, vlanName} {
			r := netlink.NewRule()
			r.Priority, r.IifName, r.Table = 10, iif, s.table
			if err := must(netlink.RuleAdd(r), "iif rule"); err != nil {
				return err
			}
		}
		return must(netlink.NeighAdd(&netlink.Neigh{LinkIndex: hv.Attrs().Index, State: netlink.NUD_PERMANENT,
			IP: pod.IP, HardwareAddr: podMAC}), "pod neighbour")
	})
	if err != nil {
		t.Fatalf("node side: %v", err)
	}
	err = vpc.Do(func(cnins.NetNS) error {
		links, err := netlink.LinkList()
		for _, l := range links {
			err = errors.Join(err, netlink.LinkSetUp(l))
		}
		return err
	})
	if err != nil {
		t.Fatalf("vpc side: %v", err)
	}
	err = s.pod.Do(func(cnins.NetNS) error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		var eth netlink.Link
		for _, l := range links {
			if l.Type() == "veth" {
				eth = l
			}
		}
		if eth == nil {
			return errors.New("no veth in the pod")
		}
		if err := netlink.LinkSetUp(eth); err != nil {
			return err
		}
		a := &netlink.Addr{IPNet: &net.IPNet{IP: s.podIP.AsSlice(), Mask: net.CIDRMask(32, 32)}}
		if err := must(netlink.AddrAdd(eth, a), "pod address"); err != nil {
			return err
		}
		gw := net.IPv4(169, 254, 1, 1)
		if err := must(netlink.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Dst: &net.IPNet{IP: gw, Mask: net.CIDRMask(32, 32)}, Scope: netlink.SCOPE_LINK}), "gateway route"); err != nil {
			return err
		}
		if err := must(netlink.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: gw}), "pod default route"); err != nil {
			return err
		}
		return must(netlink.NeighAdd(&netlink.Neigh{LinkIndex: eth.Attrs().Index, State: netlink.NUD_PERMANENT,
			IP: gw, HardwareAddr: hostMAC}), "gateway neighbour")
	})
	if err != nil {
		t.Fatalf("pod side: %v", err)
	}
	s.serve(t)
	return s
}

// serve answers every connection to the pod with the peer's address, so a
// probe learns it got through and with which source.
func (s *sgpNode) serve(t *testing.T) {
	ln, err := netns.Socket(s.pod.Path(), func() (net.Listener, error) {
		return net.Listen("tcp4", netip.AddrPortFrom(s.podIP, 0).String())
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	s.port = ln.Addr().(*net.TCPAddr).Port
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, c.RemoteAddr().(*net.TCPAddr).IP.String()+"\n")
			_ = c.Close()
		}
	}()
}

// probe connects from the node as kubelet does and returns what the pod
// saw as the source, or an error when no answer came within wait.
func (s *sgpNode) probe(wait time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	c, err := netns.Socket(s.node.Path(), func() (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "tcp4", netip.AddrPortFrom(s.podIP, uint16(s.port)).String())
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(wait))
	b, err := io.ReadAll(c)
	if err != nil {
		return "", err
	}
	return string(b), nil
}

// branchRules lists the node's rules tagged as ours.
func (s *sgpNode) branchRules(t *testing.T) []netlink.Rule {
	t.Helper()
	var out []netlink.Rule
	err := s.node.Do(func(cnins.NetNS) error {
		rules, err := netlink.RuleList(unix.AF_INET)
		for _, r := range rules {
			if r.Protocol == ruleset.BranchENIProtocol {
				out = append(out, r)
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func backends(t *testing.T, s *sgpNode, cfg ruleset.HostProbeConfig) map[string]hostProbe {
	return map[string]hostProbe{
		"nftables": nftables.NewHostProbe(dt.Logger(t), s.node.Path(), cfg),
		"iptables": iptables.NewHostProbe(dt.Logger(t), iptables.BackendNFT, s.node.Path(), cfg),
	}
}

// TestBranchENIProbe builds the branch ENI shape in namespaces and probes
// the pod from the node through each backend's host probe SNAT: answered
// with the branch ENI path, unanswered without it (the SYN leaves by the
// node's ENI, and a reply would leave by the VLAN).
func TestBranchENIProbe(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "iptables-nft-restore", "iptables-nft-save")
	for _, name := range []string{"nftables", "iptables"} {
		t.Run(name, func(t *testing.T) {
			s := newSGPNode(t, "0")
			off := backends(t, s, ruleset.HostProbeConfig{NoBranchENI: true})[name]
			t.Cleanup(func() { _ = off.Close() })
			if err := off.Ensure(); err != nil {
				t.Fatal(err)
			}
			if err := off.AddIP(s.podIP); err != nil {
				t.Fatal(err)
			}
			if got := s.branchRules(t); len(got) != 0 {
				t.Fatalf("rules with the feature off: %v", got)
			}
			// Failing is the absence of an answer: the wait bounds it.
			if got, err := s.probe(2 * time.Second); err == nil {
				t.Fatalf("probe answered without the branch ENI path (source %q)", got)
			}

			on := backends(t, s, ruleset.HostProbeConfig{})[name]
			t.Cleanup(func() { _ = on.Close() })
			if err := on.AddIP(s.podIP); err != nil {
				t.Fatal(err)
			}
			if got := s.branchRules(t); len(got) != 2 {
				t.Fatalf("want the forward and return rules, have %v", got)
			}
			got, err := s.probe(30 * time.Second)
			if err != nil {
				t.Fatalf("probe with the branch ENI path: %v", err)
			}
			if want := ambient.DefaultProbeSNATv4.String() + "\n"; got != want {
				t.Fatalf("pod saw source %q, want the probe SNAT source %q", got, want)
			}
			// Idempotent, and gone with the pod.
			if err := on.AddIP(s.podIP); err != nil {
				t.Fatal(err)
			}
			if err := on.DelIP(s.podIP); err != nil {
				t.Fatal(err)
			}
			if got := s.branchRules(t); len(got) != 0 {
				t.Fatalf("rules left after DelIP: %v", got)
			}
			if err := on.AddIP(s.podIP); err != nil {
				t.Fatal(err)
			}
			// Remove leaves them (a backend switch), RemoveBranchENI not.
			if err := on.Remove(); err != nil {
				t.Fatal(err)
			}
			if got := s.branchRules(t); len(got) != 2 {
				t.Fatalf("Remove took the rules: %v", got)
			}
			if err := on.RemoveBranchENI(); err != nil {
				t.Fatal(err)
			}
			if got := s.branchRules(t); len(got) != 0 {
				t.Fatalf("rules left after RemoveBranchENI: %v", got)
			}
		})
	}
}

// TestBranchENIGate: on a node not prepared for branch ENI pods
// (tcp_early_demux=1, the kernel's default) nothing is looked for or added.
func TestBranchENIGate(t *testing.T) {
	testnet.RequireRoot(t)
	s := newSGPNode(t, "1")
	var found bool
	err := netns.Do(s.node.Path(), func() error {
		var err error
		found, err = policyroute.AddBranchENI(s.podIP)
		return err
	})
	if err != nil || found {
		t.Fatalf("AddBranchENI on an unprepared node: found %v, %v", found, err)
	}
	if got := s.branchRules(t); len(got) != 0 {
		t.Fatalf("rules on an unprepared node: %v", got)
	}
	// An ordinary pod (route in main, no iif rule) is not a branch ENI pod.
	err = netns.Do(s.node.Path(), func() error {
		c, err := policyroute.Dial(0)
		if err != nil {
			return err
		}
		defer c.Close()
		if _, ok, err := c.FindBranchENI(netip.MustParseAddr("10.76.0.99")); err != nil || ok {
			return fmt.Errorf("ordinary pod found as branch ENI: %v %v", ok, err)
		}
		b, ok, err := c.FindBranchENI(s.podIP)
		if err != nil || !ok || b.Table != s.table || b.Veth != s.veth || b.VethPriority != 10 {
			return fmt.Errorf("branch ENI pod: %+v %v %v", b, ok, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
