package nftables

import (
	"crypto/sha256"
	"fmt"
	"net/netip"
	"strings"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Pod tables: inet tables named as Istio's nftables mode names them, so a
// pod moving between implementations never holds two competing sets of
// capture rules. Each holds base chains only, at the priorities and of
// the types iptables-nft uses for its raw, mangle and nat tables.
const (
	TableRaw    = "istio-ambient-raw"
	TableMangle = "istio-ambient-mangle"
	TableNAT    = "istio-ambient-nat"
)

// TableHost is the host's table: the probe SNAT chain and the probe sets.
const TableHost = "ambient-probe-snat"

// HostPriority is the host chain's priority: before every nat chain at
// POSTROUTING that uses the usual srcnat priority (100), iptables' nat
// table included, so a MASQUERADE or ACCEPT there cannot take kubelet's
// probes first. The first nat chain that binds a connection wins.
const HostPriority = 90

// PodTables lists the pod tables in the order they are created.
var PodTables = []string{TableRaw, TableMangle, TableNAT}

// program is a rule set rendered for nftables: tables with their sets and
// base chains, each rule both as netlink expressions and as nft text.
type program struct {
	tables []*table
	// fresh installs the program in a namespace without our tables; set
	// by Applier.program, nil elsewhere.
	fresh *netfilter.Batch
}

type table struct {
	name   string
	sets   []*set
	chains []*chain
}

type set struct {
	name    string
	keyType gnft.SetDatatype
	text    string // nft's type name
}

type chain struct {
	name  string
	typ   gnft.ChainType
	hook  *gnft.ChainHook
	prio  int32
	rules []*rule
}

type rule struct {
	exprs []expr.Any
	text  string
	// id is stored as the rule's userdata; Verify compares ids, so a
	// rule edited by hand (which loses it) or an old rendering shows.
	id []byte
}

// udataRuleID is the userdata TLV type of our rule ids: not one nft knows,
// so `nft list` shows nothing of it (libnftnl ignores unknown types).
const udataRuleID = 0xa1

func ruleID(table, chain, text string) []byte {
	sum := sha256.Sum256([]byte(table + "\x00" + chain + "\x00" + text))
	return append([]byte{udataRuleID, 8}, sum[:8]...)
}

func (t *table) chain(name string) *chain {
	for _, c := range t.chains {
		if c.name == name {
			return c
		}
	}
	return nil
}

// tableName maps a model table to our nftables table of that kind.
func tableName(t ruleset.Table) string {
	switch t {
	case ruleset.Raw:
		return TableRaw
	case ruleset.Mangle:
		return TableMangle
	}
	return TableNAT
}

// baseChain is the chain for hook h of table t, as iptables-nft would
// register it (same type and priority), named for the hook.
func baseChain(t ruleset.Table, h ruleset.Hook) *chain {
	c := &chain{name: strings.ToLower(string(h)), typ: gnft.ChainTypeFilter}
	switch h {
	case ruleset.Prerouting:
		c.hook = gnft.ChainHookPrerouting
	case ruleset.Output:
		c.hook = gnft.ChainHookOutput
	case ruleset.Postrouting:
		c.hook = gnft.ChainHookPostrouting
	}
	switch t {
	case ruleset.Raw:
		c.prio = -300
	case ruleset.Mangle:
		c.prio = -150
		if h == ruleset.Output {
			// A mark restored here must re-route the packet.
			c.typ = gnft.ChainTypeRoute
		}
	case ruleset.NAT:
		c.typ = gnft.ChainTypeNAT
		c.prio = -100
		if h == ruleset.Postrouting {
			c.prio = 100
		}
	}
	return c
}

// renderPod renders a pod's rule set of both families into the three inet
// tables. The families' rules line up one for one (ruleset builds them
// from the same list); a rule without anything family-specific is the
// same for both and appears once, the others appear per family, IPv4
// first, each guarded by its family. Each family sees its rules in order.
// With cfg.IPv4Only there are IPv4 rules only, every one guarded by its
// family, so no IPv6 packet is touched.
func renderPod(cfg ruleset.PodConfig) (program, error) {
	v4, v6 := ruleset.PodRules(cfg, ruleset.IPv4), ruleset.PodRules(cfg, ruleset.IPv6)
	var p program
	for i, c4 := range v4.Chains {
		c6 := v6.Chains[i]
		if c6.Table != c4.Table || c6.Hook != c4.Hook || len(c6.Rules) != len(c4.Rules) {
			return program{}, fmt.Errorf("nftables: IPv4 and IPv6 rules of %s %s do not line up", c4.Table, c4.Hook)
		}
		t := p.table(tableName(c4.Table))
		ch := baseChain(c4.Table, c4.Hook)
		t.chains = append(t.chains, ch)
		for j := range c4.Rules {
			r4, err := renderRule(c4.Rules[j], ruleset.IPv4)
			if err != nil {
				return program{}, err
			}
			if cfg.IPv4Only {
				ch.rules = append(ch.rules, guarded(r4, c4.Rules[j], ruleset.IPv4))
				continue
			}
			r6, err := renderRule(c6.Rules[j], ruleset.IPv6)
			if err != nil {
				return program{}, err
			}
			ch.rules = append(ch.rules, r4)
			if r6.text != r4.text {
				ch.rules = append(ch.rules, r6)
			}
		}
	}
	p.finish()
	return p, nil
}

// guarded returns r, rendered from m for family f, with a family check
// first unless a match of r already implies one.
func guarded(r *rule, m ruleset.Rule, f ruleset.Family) *rule {
	if m.Src.IsSet() || m.Dst.IsSet() || m.DstSet != "" {
		return r
	}
	b := &builder{}
	b.family(f)
	name := "ipv4"
	if f == ruleset.IPv6 {
		name = "ipv6"
	}
	return &rule{exprs: append(b.exprs, r.exprs...), text: "meta nfproto " + name + " " + r.text}
}

// renderHost renders the host's probe SNAT for the given families into one
// inet table with a probe set per family.
func renderHost(cfg ruleset.HostProbeConfig, fams []ruleset.Family) (program, error) {
	var p program
	t := p.table(TableHost)
	ch := baseChain(ruleset.NAT, ruleset.Postrouting)
	ch.prio = HostPriority
	t.chains = append(t.chains, ch)
	for _, f := range fams {
		s := &set{name: ruleset.ProbeSet(f), keyType: gnft.TypeIPAddr, text: "ipv4_addr"}
		if f == ruleset.IPv6 {
			s.keyType, s.text = gnft.TypeIP6Addr, "ipv6_addr"
		}
		t.sets = append(t.sets, s)
		for _, c := range ruleset.HostProbeRules(cfg, f).Chains {
			for _, r := range c.Rules {
				nr, err := renderRule(r, f)
				if err != nil {
					return program{}, err
				}
				ch.rules = append(ch.rules, nr)
			}
		}
	}
	p.finish()
	return p, nil
}

func (p *program) table(name string) *table {
	for _, t := range p.tables {
		if t.name == name {
			return t
		}
	}
	t := &table{name: name}
	p.tables = append(p.tables, t)
	return t
}

// finish gives every rule its id.
func (p *program) finish() {
	for _, t := range p.tables {
		for _, c := range t.chains {
			for _, r := range c.rules {
				r.id = ruleID(t.name, c.name, r.text)
			}
		}
	}
}

// builder collects a rule's expressions and nft text side by side.
type builder struct {
	exprs []expr.Any
	words []string
	// nfproto and l4proto remember the guards already loaded.
	nfproto bool
	l4proto ruleset.Proto
}

func (b *builder) say(format string, a ...any) { b.words = append(b.words, fmt.Sprintf(format, a...)) }

func cmpOp(not bool) expr.CmpOp {
	if not {
		return expr.CmpOpNeq
	}
	return expr.CmpOpEq
}

func neq(not bool) string {
	if not {
		return "!= "
	}
	return ""
}

// family guards a family-specific match: google/nftables adds no implicit
// protocol dependency, so in an inet table an ip payload match needs a
// meta nfproto check first (nft adds the same one silently).
func (b *builder) family(f ruleset.Family) {
	if b.nfproto {
		return
	}
	b.nfproto = true
	proto := byte(unix.NFPROTO_IPV4)
	if f == ruleset.IPv6 {
		proto = unix.NFPROTO_IPV6
	}
	b.exprs = append(b.exprs,
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
}

// proto loads and checks the transport protocol once.
func (b *builder) proto(p ruleset.Proto) {
	if p == ruleset.AnyProto || b.l4proto == p {
		return
	}
	b.l4proto = p
	num := byte(unix.IPPROTO_TCP)
	if p == ruleset.UDP {
		num = unix.IPPROTO_UDP
	}
	b.exprs = append(b.exprs,
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{num}})
}

func (b *builder) addr(m ruleset.AddrMatch, src bool, f ruleset.Family) {
	b.family(f)
	pfx := m.Prefix.Masked()
	a := pfx.Addr()
	off, name := uint32(16), "ip daddr"
	if src {
		off, name = 12, "ip saddr"
	}
	if f == ruleset.IPv6 {
		off, name = 24, "ip6 daddr"
		if src {
			off, name = 8, "ip6 saddr"
		}
	}
	n := uint32(a.BitLen() / 8)
	b.exprs = append(b.exprs, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n})
	if pfx.Bits() < a.BitLen() {
		mask := netip.PrefixFrom(a, pfx.Bits())
		b.exprs = append(b.exprs, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: n,
			Mask: prefixMask(mask), Xor: make([]byte, n)})
		b.say("%s %s%s", name, neq(m.Not), pfx)
	} else {
		b.say("%s %s%s", name, neq(m.Not), a)
	}
	b.exprs = append(b.exprs, &expr.Cmp{Op: cmpOp(m.Not), Register: 1, Data: a.AsSlice()})
}

func prefixMask(p netip.Prefix) []byte {
	out := make([]byte, p.Addr().BitLen()/8)
	for i := 0; i < p.Bits(); i++ {
		out[i/8] |= 0x80 >> (i % 8)
	}
	return out
}

// iface matches an interface name; a trailing "+" (iptables' wildcard)
// compares the prefix only, as nft's "name*" does.
func (b *builder) iface(m ruleset.IfaceMatch, in bool) {
	key, name := expr.MetaKeyOIFNAME, "oifname"
	if in {
		key, name = expr.MetaKeyIIFNAME, "iifname"
	}
	var data []byte
	text := m.Name
	if prefix, ok := strings.CutSuffix(m.Name, "+"); ok {
		data, text = []byte(prefix), prefix+"*"
	} else {
		data = make([]byte, unix.IFNAMSIZ)
		copy(data, m.Name)
	}
	b.exprs = append(b.exprs,
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: cmpOp(m.Not), Register: 1, Data: data})
	b.say("%s %s%q", name, neq(m.Not), text)
}

func (b *builder) port(p ruleset.Proto, m ruleset.PortMatch, src bool) {
	b.proto(p)
	off, name := uint32(2), "dport"
	if src {
		off, name = 0, "sport"
	}
	b.exprs = append(b.exprs,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2},
		&expr.Cmp{Op: cmpOp(m.Not), Register: 1, Data: binaryutil.BigEndian.PutUint16(m.Port)})
	b.say("%s %s %s%d", p, name, neq(m.Not), m.Port)
}

// mark matches (mark & mask) == value on the packet or connection mark;
// marks are host-endian in registers.
func (b *builder) mark(m ruleset.MarkMatch, conn bool) {
	load, name := expr.Any(&expr.Meta{Key: expr.MetaKeyMARK, Register: 1}), "meta mark"
	if conn {
		load, name = &expr.Ct{Key: expr.CtKeyMARK, Register: 1}, "ct mark"
	}
	b.exprs = append(b.exprs, load,
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(m.Mask), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: cmpOp(m.Not), Register: 1, Data: binaryutil.NativeEndian.PutUint32(m.Value)})
	b.say("%s & %#08x %s%#08x", name, m.Mask, map[bool]string{false: "== ", true: "!= "}[m.Not], m.Value)
}

// renderRule renders one rule of family f.
func renderRule(r ruleset.Rule, f ruleset.Family) (*rule, error) {
	b := &builder{}
	if r.Src.IsSet() {
		b.addr(r.Src, true, f)
	}
	if r.Dst.IsSet() {
		b.addr(r.Dst, false, f)
	}
	if r.In.IsSet() {
		b.iface(r.In, true)
	}
	if r.Out.IsSet() {
		b.iface(r.Out, false)
	}
	switch {
	case r.SPort.IsSet() || r.DPort.IsSet():
		if r.SPort.IsSet() {
			b.port(r.Proto, r.SPort, true)
		}
		if r.DPort.IsSet() {
			b.port(r.Proto, r.DPort, false)
		}
	case r.Proto != ruleset.AnyProto:
		b.proto(r.Proto)
		b.say("meta l4proto %s", r.Proto)
	}
	if r.Mark.IsSet() {
		b.mark(r.Mark, false)
	}
	if r.ConnMark.IsSet() {
		b.mark(r.ConnMark, true)
	}
	if r.SocketExists {
		// meta skuid needs a full local socket: forwarded packets (no
		// socket) break out of the rule, like iptables' --socket-exists.
		b.exprs = append(b.exprs,
			&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
			&expr.Cmp{Op: expr.CmpOpGte, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)})
		b.say("meta skuid >= 0")
	}
	if r.DstSet != "" {
		b.family(f)
		off, n, name := uint32(16), uint32(4), "ip daddr"
		if f == ruleset.IPv6 {
			off, n, name = 24, 16, "ip6 daddr"
		}
		b.exprs = append(b.exprs,
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
			&expr.Lookup{SourceRegister: 1, SetName: r.DstSet})
		b.say("%s @%s", name, r.DstSet)
	}
	switch a := r.Action; a.Kind {
	case ruleset.Return:
		b.exprs = append(b.exprs, &expr.Verdict{Kind: expr.VerdictReturn})
		b.say("return")
	case ruleset.Redirect:
		if r.Proto == ruleset.AnyProto {
			return nil, fmt.Errorf("nftables: redirect without a protocol")
		}
		b.exprs = append(b.exprs,
			&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(a.Port)},
			&expr.Redir{RegisterProtoMin: 1})
		b.say("redirect to :%d", a.Port)
	case ruleset.CTZone:
		b.exprs = append(b.exprs,
			&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint16(a.Zone)},
			&expr.Ct{Key: expr.CtKeyZONE, Register: 1, SourceRegister: true})
		b.say("ct zone set %d", a.Zone)
	case ruleset.SetConnMark:
		// iptables' --set-xmark: ctmark = (ctmark & ^mask) ^ value.
		b.exprs = append(b.exprs,
			&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
				Mask: binaryutil.NativeEndian.PutUint32(^a.Mask), Xor: binaryutil.NativeEndian.PutUint32(a.Value)},
			&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true})
		b.say("ct mark set ct mark & %#08x ^ %#08x", ^a.Mask, a.Value)
	case ruleset.RestoreMark:
		b.exprs = append(b.exprs,
			&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1, SourceRegister: true})
		b.say("meta mark set ct mark")
	case ruleset.SNAT:
		b.family(f)
		fam, name := uint32(unix.NFPROTO_IPV4), "ip"
		if f == ruleset.IPv6 {
			fam, name = unix.NFPROTO_IPV6, "ip6"
		}
		b.exprs = append(b.exprs,
			&expr.Immediate{Register: 1, Data: a.To.AsSlice()},
			&expr.NAT{Type: expr.NATTypeSourceNAT, Family: fam, RegAddrMin: 1})
		to := a.To.String()
		if f == ruleset.IPv6 {
			to = "[" + to + "]"
		}
		b.say("snat %s to %s", name, to)
	default:
		return nil, fmt.Errorf("nftables: no rendering for action %d", a.Kind)
	}
	return &rule{exprs: b.exprs, text: strings.Join(b.words, " ")}, nil
}

// Text renders the program as an nft script (`nft -f`), for review and
// golden files: what Apply installs, in nft's own syntax.
func (p program) Text() string {
	var sb strings.Builder
	for i, t := range p.tables {
		if i > 0 {
			sb.WriteString("\n")
		}
		fmt.Fprintf(&sb, "table inet %s {\n", t.name)
		for _, s := range t.sets {
			fmt.Fprintf(&sb, "\tset %s {\n\t\ttype %s\n\t}\n\n", s.name, s.text)
		}
		for j, c := range t.chains {
			if j > 0 {
				sb.WriteString("\n")
			}
			fmt.Fprintf(&sb, "\tchain %s {\n\t\ttype %s hook %s priority %d; policy accept;\n", c.name, c.typ, hookName(c.hook), c.prio)
			for _, r := range c.rules {
				fmt.Fprintf(&sb, "\t\t%s\n", r.text)
			}
			sb.WriteString("\t}\n")
		}
		sb.WriteString("}\n")
	}
	return sb.String()
}

func hookName(h *gnft.ChainHook) string {
	switch *h {
	case *gnft.ChainHookPrerouting:
		return "prerouting"
	case *gnft.ChainHookOutput:
		return "output"
	case *gnft.ChainHookPostrouting:
		return "postrouting"
	}
	return fmt.Sprintf("hook(%d)", *h)
}

// PodText renders a pod's nftables rules as an nft script.
func PodText(cfg ruleset.PodConfig) (string, error) {
	p, err := renderPod(cfg)
	if err != nil {
		return "", err
	}
	return p.Text(), nil
}

// HostText renders the host's probe SNAT as an nft script, for both
// families (IPv4 alone with cfg.IPv4Only).
func HostText(cfg ruleset.HostProbeConfig) (string, error) {
	p, err := renderHost(cfg, cfg.Families(true))
	if err != nil {
		return "", err
	}
	return p.Text(), nil
}
