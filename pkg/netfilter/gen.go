package netfilter

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Generation returns the nf_tables generation of the namespace at
// netnsPath ("" = the caller's): a number the kernel bumps with every
// committed nf_tables transaction in that namespace, whoever made it (nft,
// iptables-nft, this program). While it stays the same, nothing in the
// namespace's nf_tables changed, so a state read once need not be read
// again. It says nothing of x_tables (iptables-legacy) nor of routing.
func Generation(netnsPath string) (uint32, error) {
	c, err := dialNetfilter(netnsPath)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	req := netlink.Message{
		Header: netlink.Header{Type: nftType(unix.NFT_MSG_GETGEN), Flags: netlink.Request},
		Data:   genmsg(unix.AF_UNSPEC, 0),
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return 0, fmt.Errorf("read nf_tables generation in netns %s: %w", netnsPath, err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				return ad.Uint32(), nil
			}
		}
		if err := ad.Err(); err != nil {
			return 0, err
		}
	}
	return 0, errors.New("nf_tables generation: no NFTA_GEN_ID in the answer")
}
