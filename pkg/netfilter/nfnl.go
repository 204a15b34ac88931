package netfilter

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// This file talks nf_tables netlink directly for the few things
// google/nftables v0.3.0 cannot express: table userdata (the ownership
// comment) and non-recursive deletion (NLM_F_NONREC), which the kernel
// refuses when a chain still holds a rule or a table still holds anything.

// nftaTableUserdata is NFTA_TABLE_USERDATA (not in x/sys).
const nftaTableUserdata = 6

// udataTableComment is libnftnl's NFTNL_UDATA_TABLE_COMMENT: nft prints it
// as the table's comment.
const udataTableComment = 0

// dialNetfilter opens a NETLINK_NETFILTER socket inside the namespace at
// netnsPath ("" = the caller's), through netns.Socket: the one place that
// enters a namespace, so the netlink library never switches a thread
// itself.
func dialNetfilter(netnsPath string) (*netlink.Conn, error) {
	return netns.Socket(netnsPath, func() (*netlink.Conn, error) {
		c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
		if err != nil {
			return nil, fmt.Errorf("netlink (netfilter): %w", err)
		}
		return c, nil
	})
}

// genmsg is struct nfgenmsg: family, version, resource id (big endian).
func genmsg(family uint8, resID uint16) []byte {
	return []byte{family, unix.NFNETLINK_V0, byte(resID >> 8), byte(resID)}
}

func nftType(msg int) netlink.HeaderType {
	return netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msg)
}

// rawMsg builds one nf_tables request with attributes.
func rawMsg(msg int, flags netlink.HeaderFlags, family uint8, attrs []netlink.Attribute) (netlink.Message, error) {
	data, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return netlink.Message{}, err
	}
	return netlink.Message{
		Header: netlink.Header{Type: nftType(msg), Flags: netlink.Request | netlink.Acknowledge | flags},
		Data:   append(genmsg(family, 0), data...),
	}, nil
}

// sendBatch sends msgs as one nf_tables transaction on c, asking for one
// ack: the kernel applies all or nothing.
func sendBatch(c *netlink.Conn, msgs []netlink.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	b, err := NewBatch(msgs)
	if err != nil {
		return err
	}
	s, err := socketOf(c)
	if err != nil {
		return err
	}
	if err := c.SetReadDeadline(time.Now().Add(batchAckWait)); err != nil {
		return err
	}
	defer func() { _ = c.SetReadDeadline(time.Time{}) }()
	return s.Send(b)
}

// tableInfo is what a table dump tells about one table.
type tableInfo struct {
	family  uint8
	name    string
	use     uint32
	comment string
}

// listTables dumps the tables of one family (unix.NFPROTO_*).
func listTables(c *netlink.Conn, family uint8) ([]tableInfo, error) {
	req := netlink.Message{
		Header: netlink.Header{Type: nftType(unix.NFT_MSG_GETTABLE), Flags: netlink.Request | netlink.Dump},
		Data:   genmsg(family, 0),
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return nil, fmt.Errorf("list nf_tables tables: %w", err)
	}
	var out []tableInfo
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		t := tableInfo{family: m.Data[0]}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return nil, err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_TABLE_NAME:
				t.name = ad.String()
			case unix.NFTA_TABLE_USE:
				t.use = ad.Uint32()
			case nftaTableUserdata:
				t.comment = udataComment(ad.Bytes())
			}
		}
		if err := ad.Err(); err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

// chainInfo is what a chain dump tells about one chain.
type chainInfo struct {
	name    string
	comment string
	// base: the chain is attached to a hook; policy is its verdict for
	// packets no rule decides (NF_ACCEPT, NF_DROP).
	base   bool
	policy uint32
}

// listChains dumps the chains of one table.
func listChains(c *netlink.Conn, family uint8, table string) ([]chainInfo, error) {
	req := netlink.Message{
		Header: netlink.Header{Type: nftType(unix.NFT_MSG_GETCHAIN), Flags: netlink.Request | netlink.Dump},
		Data:   genmsg(family, 0),
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return nil, fmt.Errorf("list nf_tables chains: %w", err)
	}
	var out []chainInfo
	for _, m := range msgs {
		if len(m.Data) < 4 || m.Data[0] != family {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return nil, err
		}
		ad.ByteOrder = binary.BigEndian
		var tbl string
		var ch chainInfo
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_CHAIN_TABLE:
				tbl = ad.String()
			case unix.NFTA_CHAIN_NAME:
				ch.name = ad.String()
			case unix.NFTA_CHAIN_HOOK:
				ch.base = true
			case unix.NFTA_CHAIN_POLICY:
				ch.policy = ad.Uint32()
			case nftaChainUserdata:
				ch.comment = udataComment(ad.Bytes())
			}
		}
		if err := ad.Err(); err != nil {
			return nil, err
		}
		if tbl == table {
			out = append(out, ch)
		}
	}
	return out, nil
}

// listChainNames lists the names of the chains of one table.
func listChainNames(c *netlink.Conn, family uint8, table string) ([]string, error) {
	chains, err := listChains(c, family, table)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(chains))
	for i, ch := range chains {
		names[i] = ch.name
	}
	return names, nil
}

// udataComment extracts the comment TLV from table or chain userdata
// (libnftnl numbers the comment 0 for both).
func udataComment(b []byte) string {
	for len(b) >= 2 {
		typ, n := b[0], int(b[1])
		if len(b) < 2+n {
			return ""
		}
		if typ == udataTableComment {
			v := b[2 : 2+n]
			if len(v) > 0 && v[len(v)-1] == 0 {
				v = v[:len(v)-1]
			}
			return string(v)
		}
		b = b[2+n:]
	}
	return ""
}

// udataWithComment encodes a table or chain comment the way nft does.
func udataWithComment(s string) []byte {
	v := append([]byte(s), 0)
	return append([]byte{udataTableComment, byte(len(v))}, v...)
}
