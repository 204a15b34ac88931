package netfilter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// OwnerComment is the comment on every nf_tables table this project
// creates (`nft list ruleset` shows it). DeleteOwned deletes a table only
// when it carries this comment, so a table that existed before us, empty
// or not, is never taken away; in a pod, DeleteInert also takes a table
// that no longer decides anything.
const OwnerComment = "ambient-cni: created by the node agent; deleted when empty"

// TableFamily is an nf_tables address family.
type TableFamily uint8

// The families this project uses.
const (
	FamilyIPv4 TableFamily = unix.NFPROTO_IPV4
	FamilyIPv6 TableFamily = unix.NFPROTO_IPV6
	FamilyINet TableFamily = unix.NFPROTO_INET
)

// String returns nft's name of the family.
func (f TableFamily) String() string {
	switch f {
	case FamilyIPv4:
		return "ip"
	case FamilyIPv6:
		return "ip6"
	case FamilyINet:
		return "inet"
	}
	return fmt.Sprintf("family(%d)", uint8(f))
}

// TableRef names one nf_tables table.
type TableRef struct {
	Family TableFamily
	Name   string
}

// String renders the table as nft names it, e.g. "ip nat".
func (t TableRef) String() string { return t.Family.String() + " " + t.Name }

// BaseChain is a base chain as iptables-nft creates it: table, name,
// type ("filter", "nat" or "route"), hook (unix.NF_INET_*) and priority,
// policy accept.
type BaseChain struct {
	Table    TableRef
	Name     string
	Type     string
	Hook     uint32
	Priority int32
}

// String renders the chain as nft names it, e.g. "ip nat POSTROUTING".
func (c BaseChain) String() string { return c.Table.String() + " " + c.Name }

// Created is what CreateOwned made.
type Created struct {
	Tables []TableRef
	Chains []BaseChain
}

// Empty reports whether nothing was created.
func (c Created) Empty() bool { return len(c.Tables) == 0 && len(c.Chains) == 0 }

// CreateOwned prepares, in the namespace at netnsPath ("" = the caller's),
// what iptables-nft would otherwise create on its own, so that removal can
// tell it from what was there before: each of tables that does not exist
// yet, and each of chains that does not exist yet in a table that does,
// all marked with OwnerComment, in one transaction. (Chains in a table it
// creates need no mark: the table is ours.) Existing tables and chains are
// left exactly as they are.
func CreateOwned(netnsPath string, tables []TableRef, chains []BaseChain) (Created, error) {
	if len(tables) == 0 && len(chains) == 0 {
		return Created{}, nil
	}
	c, err := dialNetfilter(netnsPath)
	if err != nil {
		return Created{}, err
	}
	defer c.Close()
	// A table or chain another tool creates between the listing and the
	// batch makes the batch fail (NLM_F_EXCL): list again and retry once.
	for attempt := 0; ; attempt++ {
		var made Created
		var msgs []netlink.Message
		refs := append([]TableRef(nil), tables...)
		for _, ch := range chains {
			refs = append(refs, ch.Table)
		}
		have, err := tablesByFamily(c, refs)
		if err != nil {
			return Created{}, err
		}
		for _, t := range tables {
			if _, ok := have[t]; ok || slices.Contains(made.Tables, t) {
				continue
			}
			m, err := rawMsg(unix.NFT_MSG_NEWTABLE, netlink.Create|netlink.Excl, uint8(t.Family), []netlink.Attribute{
				{Type: unix.NFTA_TABLE_NAME, Data: cstr(t.Name)},
				{Type: nftaTableUserdata, Data: udataWithComment(OwnerComment)},
			})
			if err != nil {
				return Created{}, err
			}
			msgs = append(msgs, m)
			made.Tables = append(made.Tables, t)
		}
		existing := map[TableRef][]string{}
		for _, ch := range chains {
			if _, ok := have[ch.Table]; !ok || slices.Contains(made.Chains, ch) {
				continue // a table we create: iptables-nft fills it
			}
			names, ok := existing[ch.Table]
			if !ok {
				if names, err = listChainNames(c, uint8(ch.Table.Family), ch.Table.Name); err != nil {
					return Created{}, err
				}
				existing[ch.Table] = names
			}
			if slices.Contains(names, ch.Name) {
				continue
			}
			m, err := newBaseChain(ch)
			if err != nil {
				return Created{}, err
			}
			msgs = append(msgs, m)
			made.Chains = append(made.Chains, ch)
		}
		err = sendBatch(c, msgs)
		if err == nil {
			return made, nil
		}
		if !errors.Is(err, unix.EEXIST) || attempt > 0 {
			return Created{}, fmt.Errorf("create %v %v in netns %s: %w", made.Tables, made.Chains, netnsPath, err)
		}
	}
}

// nfAccept is the NF_ACCEPT verdict (a base chain policy).
const nfAccept = 1

// nftaChainUserdata is NFTA_CHAIN_USERDATA (not in x/sys).
const nftaChainUserdata = 12

func cstr(s string) []byte { return append([]byte(s), 0) }

func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

// newBaseChain builds the request for ch, policy accept, with our comment.
func newBaseChain(ch BaseChain) (netlink.Message, error) {
	hook, err := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: unix.NFTA_HOOK_HOOKNUM, Data: be32(ch.Hook)},
		{Type: unix.NFTA_HOOK_PRIORITY, Data: be32(uint32(ch.Priority))},
	})
	if err != nil {
		return netlink.Message{}, err
	}
	return rawMsg(unix.NFT_MSG_NEWCHAIN, netlink.Create|netlink.Excl, uint8(ch.Table.Family), []netlink.Attribute{
		{Type: unix.NFTA_CHAIN_TABLE, Data: cstr(ch.Table.Name)},
		{Type: unix.NFTA_CHAIN_NAME, Data: cstr(ch.Name)},
		{Type: unix.NLA_F_NESTED | unix.NFTA_CHAIN_HOOK, Data: hook},
		{Type: unix.NFTA_CHAIN_POLICY, Data: be32(nfAccept)},
		{Type: unix.NFTA_CHAIN_TYPE, Data: cstr(ch.Type)},
		{Type: nftaChainUserdata, Data: udataWithComment(OwnerComment)},
	})
}

// tablesByFamily lists the tables of every family named in refs.
func tablesByFamily(c *netlink.Conn, refs []TableRef) (map[TableRef]tableInfo, error) {
	have := map[TableRef]tableInfo{}
	var fams []TableFamily
	for _, t := range refs {
		if !slices.Contains(fams, t.Family) {
			fams = append(fams, t.Family)
		}
	}
	for _, f := range fams {
		ts, err := listTables(c, uint8(f))
		if err != nil {
			return nil, err
		}
		for _, t := range ts {
			have[TableRef{TableFamily(t.family), t.name}] = t
		}
	}
	return have, nil
}

// DeleteOwned deletes, in the namespace at netnsPath ("" = the caller's),
// what CreateOwned made among tables once it is empty: each table that
// carries OwnerComment and holds nothing but chains without rules or
// references, and, in the other tables, each chain that carries
// OwnerComment and holds no rule. Each table, and each such chain, goes in
// its own non-recursive transaction (NLM_F_NONREC): if another tool added
// anything since it was looked at, the kernel refuses with EBUSY and it
// stays. It returns what it deleted; what it keeps because it is not ours
// or not empty is no error.
func DeleteOwned(netnsPath string, tables []TableRef) (Created, error) {
	return deleteOwned(netnsPath, tables, false, func(c *netlink.Conn) { _ = c.Close() })
}

// DeleteInert is DeleteOwned that also deletes, whoever made it, each
// table among tables that holds nothing but built-in chains without rules
// whose policy is accept: such a table decides nothing, yet each of its
// chains still costs every packet a hook call. It is for a pod's
// namespace, where the tables our rules were written into may be another
// mesh agent's (istio-cni's iptables-nft, which made them and whose rules
// ours replaced); a host's tables are DeleteOwned's alone.
func DeleteInert(netnsPath string, tables []TableRef) (Created, error) {
	return deleteOwned(netnsPath, tables, true, func(c *netlink.Conn) { _ = c.Close() })
}

// inert reports whether chains are all built-in chains with policy
// accept: emptied of rules, their table does nothing.
func inert(chains []chainInfo) bool {
	for _, ch := range chains {
		if !ch.base || ch.policy != nfAccept {
			return false
		}
	}
	return true
}

// Owner runs CreateOwned and DeleteOwned for a long-lived caller: a
// connection whose batch deleted something is closed in the background,
// since closing it waits for the kernel to finish the deletion (10-25 ms).
// Close waits for those.
type Owner struct {
	closing sync.WaitGroup
}

// CreateOwned is the package's CreateOwned.
func (o *Owner) CreateOwned(netnsPath string, tables []TableRef, chains []BaseChain) (Created, error) {
	return CreateOwned(netnsPath, tables, chains)
}

// DeleteOwned is the package's DeleteOwned, closing in the background.
func (o *Owner) DeleteOwned(netnsPath string, tables []TableRef) (Created, error) {
	return deleteOwned(netnsPath, tables, false, o.closeLater)
}

// DeleteInert is the package's DeleteInert, closing in the background.
func (o *Owner) DeleteInert(netnsPath string, tables []TableRef) (Created, error) {
	return deleteOwned(netnsPath, tables, true, o.closeLater)
}

func (o *Owner) closeLater(c *netlink.Conn) { o.closing.Go(func() { _ = c.Close() }) }

// Close waits for background closes.
func (o *Owner) Close() error {
	o.closing.Wait()
	return nil
}

func deleteOwned(netnsPath string, tables []TableRef, inertToo bool, closeConn func(*netlink.Conn)) (Created, error) {
	var deleted Created
	if len(tables) == 0 {
		return deleted, nil
	}
	c, err := dialNetfilter(netnsPath)
	if err != nil {
		return deleted, err
	}
	defer closeConn(c)
	have, err := tablesByFamily(c, tables)
	if err != nil {
		return deleted, err
	}
	var errs []error
	try := func(what string, msgs []netlink.Message) bool {
		switch err := sendBatch(c, msgs); {
		case err == nil:
			return true
		case errors.Is(err, unix.EBUSY), errors.Is(err, unix.ENOENT):
			// Not empty (someone else's rule, chain or set), or gone.
		default:
			errs = append(errs, fmt.Errorf("delete %s in netns %s: %w", what, netnsPath, err))
		}
		return false
	}
	seen := map[TableRef]bool{}
	for _, t := range tables {
		info, ok := have[t]
		if !ok || seen[t] {
			continue
		}
		seen[t] = true
		chains, err := listChains(c, uint8(t.Family), t.Name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if info.comment == OwnerComment || (inertToo && inert(chains)) {
			var msgs []netlink.Message
			for _, ch := range chains {
				msgs = append(msgs, delChain(t, ch.name))
			}
			m, err := rawMsg(unix.NFT_MSG_DELTABLE, unix.NLM_F_NONREC, uint8(t.Family), []netlink.Attribute{
				{Type: unix.NFTA_TABLE_NAME, Data: cstr(t.Name)},
			})
			if err != nil {
				return deleted, err
			}
			if try("table "+t.String(), append(msgs, m)) {
				deleted.Tables = append(deleted.Tables, t)
			}
			continue
		}
		for _, ch := range chains {
			if ch.comment == OwnerComment && try("chain "+t.String()+" "+ch.name, []netlink.Message{delChain(t, ch.name)}) {
				deleted.Chains = append(deleted.Chains, BaseChain{Table: t, Name: ch.name})
			}
		}
	}
	return deleted, errors.Join(errs...)
}

// delChain is a non-recursive chain deletion: the kernel refuses it while
// the chain holds a rule or is referred to.
func delChain(t TableRef, name string) netlink.Message {
	m, _ := rawMsg(unix.NFT_MSG_DELCHAIN, unix.NLM_F_NONREC, uint8(t.Family), []netlink.Attribute{
		{Type: unix.NFTA_CHAIN_TABLE, Data: cstr(t.Name)},
		{Type: unix.NFTA_CHAIN_NAME, Data: cstr(name)},
	})
	return m
}
