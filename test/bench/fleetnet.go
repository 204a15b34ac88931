package bench

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The fleet's nodes each have a network namespace of their own, so that
// their agents' host rules, metrics ports and istio-cni's fixed readiness
// port do not meet: a bridge in the benchmark's namespace (where the API
// server listens) and one veth per node into it, the node's end named
// eth0 with the node's address.

// fleetNet is the bridge the nodes hang off.
type fleetNet struct {
	bridge string
	// gateway is the bridge's address: the API server as the nodes reach
	// it.
	gateway netip.Prefix
	nodes   []*fleetNetns
}

// fleetSubnet holds the bridge and the nodes' addresses (the benchmark's
// own network namespace has nothing else in it).
var fleetSubnet = netip.MustParsePrefix("10.250.0.0/16")

func newFleetNet() (*fleetNet, error) {
	f := &fleetNet{bridge: testnet.RandName("fb", 8), gateway: netip.PrefixFrom(fleetSubnet.Addr().Next(), fleetSubnet.Bits())}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: f.bridge}}
	if err := netlink.LinkAdd(br); err != nil {
		return nil, fmt.Errorf("add bridge %s: %w", f.bridge, err)
	}
	if err := netlink.AddrAdd(br, &netlink.Addr{IPNet: prefixNet(f.gateway)}); err != nil {
		return f, errors.Join(fmt.Errorf("address bridge %s: %w", f.bridge, err), f.Close())
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return f, errors.Join(fmt.Errorf("bring up bridge %s: %w", f.bridge, err), f.Close())
	}
	return f, nil
}

// fleetNetns is one node's network namespace, bound at path.
type fleetNetns struct {
	path, veth string
	addr       netip.Addr
}

// addNode makes node i's namespace, bound to a file at path, joined to
// the bridge with the i-th address after the gateway.
func (f *fleetNet) addNode(i int, path string) (*fleetNetns, error) {
	addr := f.gateway.Addr()
	for range i + 1 {
		addr = addr.Next()
	}
	if !fleetSubnet.Contains(addr) {
		return nil, fmt.Errorf("node %d has no address left in %s", i, fleetSubnet)
	}
	n := &fleetNetns{path: path, veth: testnet.RandName("fv", 8), addr: addr}
	if err := bindNewNetns(path); err != nil {
		return nil, err
	}
	f.nodes = append(f.nodes, n)
	nsh, err := ns.GetNS(path)
	if err != nil {
		return nil, err
	}
	defer nsh.Close()
	br, err := netlink.LinkByName(f.bridge)
	if err != nil {
		return nil, err
	}
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{Name: n.veth, MasterIndex: br.Attrs().Index},
		PeerName:  "eth0", PeerNamespace: netlink.NsFd(int(nsh.Fd())),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("add veth %s: %w", n.veth, err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		return nil, fmt.Errorf("bring up %s: %w", n.veth, err)
	}
	return n, nsh.Do(func(ns.NetNS) error {
		for _, name := range []string{"lo", "eth0"} {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if name == "eth0" {
				if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(addr, fleetSubnet.Bits()))}); err != nil {
					return fmt.Errorf("address eth0: %w", err)
				}
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return fmt.Errorf("bring up %s: %w", name, err)
			}
		}
		return nil
	})
}

// Close removes the nodes' namespaces (their veths go with them: the
// agents in them must be stopped) and the bridge.
func (f *fleetNet) Close() error {
	var err error
	for _, n := range f.nodes {
		if uerr := unix.Unmount(n.path, unix.MNT_DETACH); uerr != nil && !errors.Is(uerr, unix.EINVAL) {
			err = errors.Join(err, fmt.Errorf("unmount %s: %w", n.path, uerr))
		}
		if rerr := os.Remove(n.path); rerr != nil && !os.IsNotExist(rerr) {
			err = errors.Join(err, rerr)
		}
	}
	f.nodes = nil
	if l, lerr := netlink.LinkByName(f.bridge); lerr == nil {
		err = errors.Join(err, netlink.LinkDel(l))
	}
	return err
}

// bindNewNetns creates a network namespace and binds it at path (in the
// node's directory, not /run/netns: the agents scan that for pods). The
// namespace is entered on a thread of its own that exits with the
// goroutine, so no other goroutine ever runs in it.
func bindNewNetns(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	f.Close()
	done := make(chan error, 1)
	go func() { // owner: bindNewNetns, which waits; the thread dies with it
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- fmt.Errorf("unshare a network namespace: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		if err := unix.Mount(src, path, "", unix.MS_BIND, ""); err != nil {
			done <- fmt.Errorf("bind the network namespace at %s: %w", path, err)
			return
		}
		done <- nil
	}()
	if err := <-done; err != nil {
		_ = os.Remove(path)
		return err
	}
	return nil
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
