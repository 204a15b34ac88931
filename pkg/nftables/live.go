package nftables

import (
	"bytes"
	"errors"
	"fmt"
	"slices"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// conn is what one call holds in a namespace: a lasting google/nftables
// socket for reads (r), and for changes a Recorder they are queued on (q)
// and a socket that sends them as one transaction asking for one ack (w).
// The sockets are created inside the namespace and used from any thread.
// Reads and changes are apart on purpose: a change queued on r would
// never be sent.
type conn struct {
	r *gnft.Conn
	q *netfilter.Recorder
	w *netfilter.Socket
}

// dial opens a connection in the namespace at netnsPath ("" = the
// caller's); write adds what changes need.
func dial(netnsPath string, write bool) (conn, error) {
	var c conn
	err := netns.Do(netnsPath, func() error {
		var err error
		c, err = dialHere(write)
		return err
	})
	if err != nil {
		return conn{}, fmt.Errorf("nf_tables netlink in netns %s: %w", netnsPath, err)
	}
	return c, nil
}

// dialHere opens a connection in the calling thread's namespace.
func dialHere(write bool) (conn, error) {
	r, err := gnft.New(gnft.AsLasting())
	if err != nil {
		return conn{}, fmt.Errorf("nf_tables netlink: %w", err)
	}
	c := conn{r: r}
	if !write {
		return c, nil
	}
	if c.q, err = netfilter.NewRecorder(); err == nil {
		c.w, err = netfilter.DialSocket()
	}
	if err != nil {
		_ = r.CloseLasting()
		return conn{}, err
	}
	return c, nil
}

// ok reports whether c is open.
func (c conn) ok() bool { return c.r != nil }

// close closes c's sockets.
func (c conn) close() error {
	if c.r == nil {
		return nil
	}
	return errors.Join(c.r.CloseLasting(), c.w.Close())
}

// flush sends what is queued on c.q as one transaction.
func (c conn) flush() error {
	b, err := c.q.Batch()
	if err != nil {
		return err
	}
	return c.w.Send(b)
}

// liveChain is one of our chains as the kernel holds it.
type liveChain struct {
	c     *gnft.Chain
	rules []*gnft.Rule
}

// liveTable is one of our tables as the kernel holds it.
type liveTable struct {
	chains []*liveChain
	sets   []*gnft.Set
}

func (t *liveTable) chain(name string) *liveChain {
	for _, c := range t.chains {
		if c.c.Name == name {
			return c
		}
	}
	return nil
}

// readLive reads the inet tables named in names that exist, with their
// chains, rules and sets; a missing table is absent from the map. foreign
// tells whether any ip or ip6 table exists (where iptables-nft keeps its
// rules).
func readLive(c conn, names []string, withSets bool) (live map[string]*liveTable, foreign bool, err error) {
	tables, err := c.r.ListTablesOfFamily(gnft.TableFamilyUnspecified)
	if err != nil {
		return nil, false, fmt.Errorf("list nf_tables tables: %w", err)
	}
	live = map[string]*liveTable{}
	for _, t := range tables {
		switch {
		case t.Family == gnft.TableFamilyIPv4 || t.Family == gnft.TableFamilyIPv6:
			foreign = true
		case t.Family == gnft.TableFamilyINet && slices.Contains(names, t.Name):
			live[t.Name] = &liveTable{}
		}
	}
	if len(live) == 0 {
		return live, foreign, nil
	}
	chains, err := c.r.ListChainsOfTableFamily(gnft.TableFamilyINet)
	if err != nil {
		return nil, false, fmt.Errorf("list nf_tables chains: %w", err)
	}
	for _, ch := range chains {
		lt := live[ch.Table.Name]
		if lt == nil {
			continue
		}
		rules, err := c.r.GetRules(ch.Table, ch)
		if err != nil {
			return nil, false, fmt.Errorf("list rules of %s %s: %w", ch.Table.Name, ch.Name, err)
		}
		lt.chains = append(lt.chains, &liveChain{c: ch, rules: rules})
	}
	if withSets {
		for name, lt := range live {
			sets, err := c.r.GetSets(&gnft.Table{Name: name, Family: gnft.TableFamilyINet})
			if err != nil {
				return nil, false, fmt.Errorf("list sets of %s: %w", name, err)
			}
			lt.sets = sets
		}
	}
	return live, foreign, nil
}

// sameSpec reports whether a live chain is the base chain we want.
func sameSpec(live *gnft.Chain, want *chain) bool {
	return live.Type == want.typ && live.Hooknum != nil && *live.Hooknum == *want.hook &&
		live.Priority != nil && int32(*live.Priority) == want.prio &&
		(live.Policy == nil || *live.Policy == gnft.ChainPolicyAccept)
}

// diff compares the kernel's tables (live, holding at most the tables in
// owned) with the program: tables, chains, sets, and rules by id.
func diff(p program, live map[string]*liveTable, owned []string) []ruleset.DriftItem {
	var items []ruleset.DriftItem
	item := func(kind ruleset.DriftKind, obj, table, chain string) ruleset.DriftItem {
		return ruleset.DriftItem{Kind: kind, Object: obj, Table: table, Chain: chain}
	}
	for _, t := range p.tables {
		lt := live[t.name]
		if lt == nil {
			items = append(items, item(ruleset.DriftMissing, "table", t.name, ""))
			continue
		}
		for _, s := range t.sets {
			i := slices.IndexFunc(lt.sets, func(x *gnft.Set) bool { return x.Name == s.name })
			if i < 0 || lt.sets[i].KeyType.GetNFTMagic() != s.keyType.GetNFTMagic() {
				it := item(ruleset.DriftMissing, "set", t.name, "")
				it.Want = s.name + " " + s.text
				items = append(items, it)
			}
		}
		for _, c := range t.chains {
			lc := lt.chain(c.name)
			switch {
			case lc == nil:
				items = append(items, item(ruleset.DriftMissing, "chain", t.name, c.name))
				for i, r := range c.rules {
					it := item(ruleset.DriftMissing, "nft rule", t.name, c.name)
					it.Position, it.Want = i+1, r.text
					items = append(items, it)
				}
				continue
			case !sameSpec(lc.c, c):
				items = append(items, item(ruleset.DriftChanged, "chain", t.name, c.name))
			}
			want := make([]string, len(c.rules))
			for i, r := range c.rules {
				want[i] = r.text
			}
			have := make([]string, len(lc.rules))
			for i, lr := range lc.rules {
				have[i] = fmt.Sprintf("rule handle %d (not ours, or edited)", lr.Handle)
				for _, r := range c.rules {
					if bytes.Equal(lr.UserData, r.id) {
						have[i] = r.text
						break
					}
				}
			}
			items = append(items, ruleset.DiffRules(item(ruleset.DriftMissing, "nft rule", t.name, c.name), want, have)...)
		}
		for _, ls := range lt.sets {
			if !slices.ContainsFunc(t.sets, func(s *set) bool { return s.name == ls.Name }) {
				it := item(ruleset.DriftExtra, "set", t.name, "")
				it.Have = ls.Name
				items = append(items, it)
			}
		}
		for _, lc := range lt.chains {
			if t.chain(lc.c.Name) == nil {
				items = append(items, item(ruleset.DriftExtra, "chain", t.name, lc.c.Name))
			}
		}
	}
	for _, name := range owned {
		if live[name] != nil && !slices.ContainsFunc(p.tables, func(t *table) bool { return t.name == name }) {
			items = append(items, item(ruleset.DriftExtra, "table", name, ""))
		}
	}
	return items
}

// add queues the program's tables, sets, chains and rules on q. Set ids
// are numbered here, unique in the batch, so the same program always
// makes the same bytes (google/nftables would number them from a
// process-wide counter).
func add(q *gnft.Conn, p program) {
	var setID uint32
	for _, t := range p.tables {
		tbl := q.AddTable(&gnft.Table{Name: t.name, Family: gnft.TableFamilyINet})
		ids := map[string]uint32{}
		for _, s := range t.sets {
			setID++
			gs := &gnft.Set{Table: tbl, Name: s.name, KeyType: s.keyType, ID: setID}
			// Only fails for anonymous or malformed sets, which we never make.
			_ = q.AddSet(gs, nil)
			ids[s.name] = gs.ID
		}
		for _, ch := range t.chains {
			accept := gnft.ChainPolicyAccept
			gc := q.AddChain(&gnft.Chain{Name: ch.name, Table: tbl, Type: ch.typ, Hooknum: ch.hook,
				Priority: gnft.ChainPriorityRef(gnft.ChainPriority(ch.prio)), Policy: &accept})
			for _, r := range ch.rules {
				exprs := make([]expr.Any, len(r.exprs))
				for i, e := range r.exprs {
					if l, ok := e.(*expr.Lookup); ok {
						// A set added in the same batch is found by its id.
						cp := *l
						cp.SetID = ids[l.SetName]
						e = &cp
					}
					exprs[i] = e
				}
				q.AddRule(&gnft.Rule{Table: tbl, Chain: gc, Exprs: exprs, UserData: r.id})
			}
		}
	}
}
