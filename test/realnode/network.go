package realnode

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// ConflistName is the node's primary CNI config file.
const ConflistName = "10-ambient-node.conflist"

// network picks the pod subnet and bridge name, installs the reference
// plugins into the node's CNI bin dir and writes the primary conflist:
// bridge + host-local, as a plain bridged node has (under LayoutMultus,
// Multus's delegate, with Multus's config as the runtime's primary).
func (n *Node) network() error {
	subnet, err := pickSubnet()
	if err != nil {
		return err
	}
	n.Subnet = subnet.String()
	n.Gateway = subnet.Addr().Next().String()
	n.Bridge = "anode" + randHex(6)
	n.st.Bridge, n.st.Subnet = n.Bridge, n.Subnet
	primaryDir, err := n.layoutDirs()
	if err != nil {
		return err
	}
	for _, d := range []string{n.CNIBinDir, n.CNIConfDir, filepath.Join(n.Dir, "cni", "ipam")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if err := atomicfile.CopyFile(filepath.Join(n.Tools.CNIPlugins, p), filepath.Join(n.CNIBinDir, p), atomicfile.Options{Mode: 0o755}); err != nil {
			return fmt.Errorf("install CNI plugin %s: %w", p, err)
		}
	}
	b, err := bridgeConflist(n.Bridge, n.Subnet, n.Gateway, filepath.Join(n.Dir, "cni", "ipam"))
	if err != nil {
		return err
	}
	n.CNIConfFile = filepath.Join(primaryDir, ConflistName)
	n.CNIConfOriginal = append(b, '\n')
	if err := os.WriteFile(n.CNIConfFile, n.CNIConfOriginal, 0o644); err != nil {
		return err
	}
	if n.opts.Layout == LayoutMultus {
		// The runtime's primary becomes Multus's config.
		return n.writeMultus(n.CNIConfFile)
	}
	return nil
}

// bridgeConflist is the node's primary conflist: bridge + host-local on
// subnet, as a plain bridged node has, and as flannel's CNI plugin
// delegates on a flannel node (bridge, gateway, host-local on the node's
// lease).
func bridgeConflist(bridge, subnet, gateway, ipamDir string) ([]byte, error) {
	// cniVersion 1.1.0, as current primaries write: containerd 2.x then
	// calls CNI STATUS on every plugin of the list from its CRI Status.
	conf := map[string]any{
		"cniVersion": "1.1.0",
		"name":       "ambient-node",
		"plugins": []any{map[string]any{
			"type":        "bridge",
			"bridge":      bridge,
			"isGateway":   true,
			"ipMasq":      false,
			"hairpinMode": true,
			"ipam": map[string]any{
				"type":   "host-local",
				"ranges": [][]map[string]string{{{"subnet": subnet, "gateway": gateway}}},
				// Pods route everything via the bridge, as on any node
				// (kubelet probes are answered to the SNAT address that way).
				"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
				"dataDir": ipamDir,
			},
		}},
	}
	return json.MarshalIndent(conf, "", "  ")
}

// pickSubnet picks a random /24 in 10.200.0.0/13 that no route of the host
// overlaps, so the node's pods never shadow anything (or anyone else's
// test network).
func pickSubnet() (netip.Prefix, error) {
	routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("list routes: %w", err)
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("list addresses: %w", err)
	}
	var used []netip.Prefix
	for _, r := range routes {
		if r.Dst != nil {
			if p, ok := prefixOf(r.Dst); ok && p.Bits() > 0 {
				used = append(used, p)
			}
		}
	}
	for _, a := range addrs {
		if p, ok := prefixOf(a.IPNet); ok {
			used = append(used, p)
		}
	}
	for range 200 {
		cand := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(200 + rand.IntN(8)), byte(rand.IntN(256)), 0}), 24)
		free := true
		for _, u := range used {
			if u.Overlaps(cand) {
				free = false
				break
			}
		}
		if free {
			return cand, nil
		}
	}
	return netip.Prefix{}, errors.New("no free /24 in 10.200.0.0/13 for the pod network")
}

func prefixOf(n *net.IPNet) (netip.Prefix, bool) {
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a.Unmap(), ones).Masked(), true
}

// removeLinks deletes the node's bridge and any veth still attached to it
// (the pods' netns are gone by now, so normally none).
func removeLinks(st *state) []error {
	var errs []error
	for _, name := range st.Links {
		if l, err := netlink.LinkByName(name); err == nil {
			if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
				errs = append(errs, fmt.Errorf("delete %s: %w", name, err))
			}
		}
	}
	if st.Bridge == "" {
		return errs
	}
	br, err := netlink.LinkByName(st.Bridge)
	if err != nil {
		return errs
	}
	links, _ := netlink.LinkList()
	for _, l := range links {
		if l.Attrs().MasterIndex == br.Attrs().Index {
			// A veth goes by itself when its pod's netns does, which may
			// happen between the listing and here.
			if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
				errs = append(errs, fmt.Errorf("delete %s: %w", l.Attrs().Name, err))
			}
		}
	}
	if err := netlink.LinkDel(br); err != nil && !errors.Is(err, unix.ENODEV) {
		errs = append(errs, fmt.Errorf("delete bridge %s: %w", st.Bridge, err))
	}
	return errs
}
