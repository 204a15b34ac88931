package netfilter

import (
	"fmt"
	"slices"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// HasChains reports whether the namespace at netnsPath holds, in an ip or
// ip6 table (where iptables-nft keeps its rules), a chain named in names:
// a cheap netlink check for rules another backend left.
func HasChains(netnsPath string, names []string) (bool, error) {
	c, err := dialNetfilter(netnsPath)
	if err != nil {
		return false, err
	}
	defer c.Close()
	req := netlink.Message{
		Header: netlink.Header{Type: nftType(unix.NFT_MSG_GETCHAIN), Flags: netlink.Request | netlink.Dump},
		Data:   genmsg(unix.AF_UNSPEC, 0),
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return false, fmt.Errorf("list nf_tables chains in netns %s: %w", netnsPath, err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 || (m.Data[0] != unix.NFPROTO_IPV4 && m.Data[0] != unix.NFPROTO_IPV6) {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return false, err
		}
		for ad.Next() {
			if ad.Type() == unix.NFTA_CHAIN_NAME && slices.Contains(names, ad.String()) {
				return true, nil
			}
		}
	}
	return false, nil
}
