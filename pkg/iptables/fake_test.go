package iptables

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// This file is the package's in-memory fake of the namespaces it drives:
// an iptables-restore simulator, so that the package's unit tests run the
// real Applier and HostProbe without root.

// builtinChains are the chains iptables creates on its own per table.
var builtinChains = map[string][]string{
	"raw":    {"PREROUTING", "OUTPUT"},
	"mangle": {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"},
	"nat":    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
	"filter": {"INPUT", "FORWARD", "OUTPUT"},
}

func cloneSave(s *Save) *Save {
	out := &Save{}
	for _, t := range s.Tables {
		nt := &SavedTable{Name: t.Name}
		for _, c := range t.Chains {
			nc := &SavedChain{Name: c.Name, Policy: c.Policy}
			for _, r := range c.Rules {
				nc.Rules = append(nc.Rules, SavedRule{Args: append([]string(nil), r.Args...)})
			}
			nt.Chains = append(nt.Chains, nc)
		}
		out.Tables = append(out.Tables, nt)
	}
	return out
}

// simulateRestore models iptables-restore --noflush closely enough to
// check plans: a table block is all-or-nothing; declaring an existing user
// chain flushes it; -I inserts at a position; -D needs an exact match; -X
// needs an empty, unreferenced user chain.
func simulateRestore(cur *Save, input string) (*Save, error) {
	s := cloneSave(cur)
	var work *SavedTable
	var workIdx int
	for n, line := range strings.Split(input, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fail := func(format string, a ...any) (*Save, error) {
			return nil, fmt.Errorf("line %d %q: %s", n+1, line, fmt.Sprintf(format, a...))
		}
		switch {
		case strings.HasPrefix(line, "*"):
			if work != nil {
				return fail("nested table")
			}
			name := line[1:]
			workIdx = -1
			for i, t := range s.Tables {
				if t.Name == name {
					workIdx = i
				}
			}
			if workIdx >= 0 {
				work = cloneSave(&Save{Tables: []*SavedTable{s.Tables[workIdx]}}).Tables[0]
			} else {
				work = &SavedTable{Name: name}
				for _, c := range builtinChains[name] {
					work.Chains = append(work.Chains, &SavedChain{Name: c, Policy: "ACCEPT"})
				}
			}
		case line == "COMMIT":
			if work == nil {
				return fail("COMMIT outside table")
			}
			if workIdx >= 0 {
				s.Tables[workIdx] = work
			} else {
				s.Tables = append(s.Tables, work)
			}
			work = nil
		case work == nil:
			return fail("command outside table")
		case strings.HasPrefix(line, ":"):
			f := strings.Fields(line[1:])
			if c := work.Chain(f[0]); c != nil {
				c.Rules = nil
			} else {
				work.Chains = append(work.Chains, &SavedChain{Name: f[0], Policy: f[1]})
			}
		default:
			args, err := splitArgs(line)
			if err != nil || len(args) < 2 {
				return fail("bad command")
			}
			c := work.Chain(args[1])
			if c == nil && (args[0] == "-A" || args[0] == "-I") && isBuiltin(work.Name, args[1]) {
				c = &SavedChain{Name: args[1], Policy: "ACCEPT"}
				work.Chains = append(work.Chains, c)
			}
			if c == nil {
				return fail("no chain %s", args[1])
			}
			spec := joinArgs(args[2:])
			switch args[0] {
			case "-A":
				if t := (SavedRule{Args: args[2:]}).Target(); isOurChain(t) && work.Chain(t) == nil {
					return fail("jump to missing chain %s", t)
				}
				c.Rules = append(c.Rules, SavedRule{Args: args[2:]})
			case "-I":
				pos, err := strconv.Atoi(args[2])
				if err != nil || pos < 1 || pos > len(c.Rules)+1 {
					return fail("bad position")
				}
				rule := SavedRule{Args: args[3:]}
				c.Rules = append(c.Rules[:pos-1], append([]SavedRule{rule}, c.Rules[pos-1:]...)...)
			case "-D":
				i := 0
				for ; i < len(c.Rules) && c.Rules[i].Spec() != spec; i++ {
				}
				if i == len(c.Rules) {
					return fail("no such rule")
				}
				c.Rules = append(c.Rules[:i], c.Rules[i+1:]...)
			case "-F":
				c.Rules = nil
			case "-X":
				if len(c.Rules) > 0 || c.Policy != "-" {
					return fail("chain not empty or built-in")
				}
				for _, o := range work.Chains {
					for _, r := range o.Rules {
						if r.Target() == c.Name {
							return fail("chain still referenced from %s", o.Name)
						}
					}
				}
				for i, o := range work.Chains {
					if o == c {
						work.Chains = append(work.Chains[:i], work.Chains[i+1:]...)
						break
					}
				}
			default:
				return fail("unsupported command")
			}
		}
	}
	if work != nil {
		return nil, fmt.Errorf("table %s not committed", work.Name)
	}
	return s, nil
}

func isBuiltin(table, chain string) bool {
	for _, c := range builtinChains[table] {
		if c == chain {
			return true
		}
	}
	return false
}

// fakeNS is one fake network namespace: per-family iptables state, the
// nf_tables tables made for iptables-nft, and the policy routing flags and
// namespace state, driven through the Executor, Router and TableOwner
// interfaces.
type fakeNS struct {
	saves  map[ruleset.Family]*Save
	rule   map[ruleset.Family]bool
	route  map[ruleset.Family]bool
	noIPv6 bool
	noLoV6 bool // lo has IPv6 disabled
	loDown bool
	owned  map[string]bool // "ip nat": tables CreateOwned made
	// routeErr makes EnsurePolicyRoute of a family fail.
	routeErr map[ruleset.Family]error
}

// fakeHost implements Executor, Router and TableOwner over simulated network
// namespaces: backend b's iptables-save prints, and iptables-restore
// --noflush applies, a namespace's state, modelled closely enough to check
// plans (a table block is all-or-nothing; declaring an existing user chain
// flushes it; -I inserts at a position; -D needs an exact match; -X needs
// an empty, unreferenced user chain); the nf_tables tables iptables-nft
// needs (created and deleted as ours), the namespace state (lo, IPv6) and
// the policy route are modelled too. A path
// names a simulated namespace by itself, except one that opens a real
// network namespace (a held handle's /proc/<pid>/fd/<n>, say), which
// names that namespace whatever path reaches it. Every command run is
// logged. Pass it to NewApplier or NewHostProbe with WithExecutor,
// WithRouter and WithTableOwner.
type fakeHost struct {
	mu      sync.Mutex
	ns      map[string]*fakeNS
	log     []string
	backend Backend
	failOn  string // a command name that fails
}

// newFakeHost returns a fakeHost with no namespaces; each appears empty (IPv6
// enabled) on first use.
func newFakeHost(b Backend) *fakeHost {
	return &fakeHost{ns: map[string]*fakeNS{}, backend: b}
}

// key names the simulated namespace of path: the real namespace's
// identity when path opens one, else the path.
func key(path string) string {
	var fs unix.Statfs_t
	var st unix.Stat_t
	if path != "" && unix.Statfs(path, &fs) == nil && fs.Type == unix.NSFS_MAGIC && unix.Stat(path, &st) == nil {
		return fmt.Sprintf("netns:%d:%d", st.Dev, st.Ino)
	}
	return path
}

func (h *fakeHost) get(path string) *fakeNS {
	k := key(path)
	n, ok := h.ns[k]
	if !ok {
		n = &fakeNS{saves: map[ruleset.Family]*Save{ruleset.IPv4: {}, ruleset.IPv6: {}}, rule: map[ruleset.Family]bool{}, route: map[ruleset.Family]bool{},
			owned: map[string]bool{}, routeErr: map[ruleset.Family]error{}}
		h.ns[k] = n
	}
	return n
}

// Run implements Executor.
func (h *fakeHost) Run(_ context.Context, path string, cmd Cmd) ([]byte, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.log = append(h.log, cmd.Name)
	if cmd.Name == h.failOn {
		return nil, fmt.Errorf("%s: injected failure", cmd.Name)
	}
	n := h.get(path)
	for _, f := range ruleset.Families {
		switch cmd.Name {
		case h.backend.SaveCmd(f):
			return []byte("# Generated by fake\n" + n.saves[f].String()), nil
		case h.backend.RestoreCmd(f):
			next, err := simulateRestore(n.saves[f], string(cmd.Stdin))
			if err != nil {
				return nil, err
			}
			n.saves[f] = next
			return nil, nil
		}
	}
	return nil, fmt.Errorf("fake: unexpected command %s", cmd)
}

// State implements Router.
func (h *fakeHost) State(path string) (netns.State, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.get(path)
	return netns.State{LoopbackUp: !n.loDown, IPv6: !n.noIPv6, IPv6Loopback: !n.noIPv6 && !n.noLoV6}, nil
}

// PolicyRouteState implements Router.
func (h *fakeHost) PolicyRouteState(path string, f ruleset.Family, _ ruleset.PolicyRoute) (bool, bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.get(path)
	return n.rule[f], n.route[f], nil
}

// EnsurePolicyRoute implements Router: it reports the parts it added.
func (h *fakeHost) EnsurePolicyRoute(path string, f ruleset.Family, _ ruleset.PolicyRoute) (policyroute.Parts, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.get(path)
	if err := n.routeErr[f]; err != nil {
		return policyroute.Parts{}, err
	}
	added := policyroute.Parts{Rule: !n.rule[f], Route: !n.route[f]}
	n.rule[f], n.route[f] = true, true
	return added, nil
}

// RemovePolicyRoute implements Router: only the named parts go.
func (h *fakeHost) RemovePolicyRoute(path string, f ruleset.Family, _ ruleset.PolicyRoute, parts policyroute.Parts) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.get(path)
	if parts.Rule {
		n.rule[f] = false
	}
	if parts.Route {
		n.route[f] = false
	}
	return nil
}

func fakeFamily(t netfilter.TableRef) ruleset.Family {
	if t.Family == netfilter.FamilyIPv6 {
		return ruleset.IPv6
	}
	return ruleset.IPv4
}

// CreateOwned implements TableOwner: tables appear empty (built-in chains
// only), as iptables-nft-save shows a table it did not fill. Chains are
// not modelled: iptables-nft-save shows built-in chains either way.
func (h *fakeHost) CreateOwned(path string, tables []netfilter.TableRef, _ []netfilter.BaseChain) (netfilter.Created, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.log = append(h.log, "create-owned")
	n := h.get(path)
	var created []netfilter.TableRef
	for _, t := range tables {
		s := n.saves[fakeFamily(t)]
		if s.Table(t.Name) != nil {
			continue
		}
		nt := &SavedTable{Name: t.Name}
		for _, c := range builtinChains[t.Name] {
			nt.Chains = append(nt.Chains, &SavedChain{Name: c, Policy: "ACCEPT"})
		}
		s.Tables = append(s.Tables, nt)
		n.owned[t.String()] = true
		created = append(created, t)
	}
	return netfilter.Created{Tables: created}, nil
}

// DeleteOwned implements TableOwner: only owned tables with no rules and
// no user chains go.
func (h *fakeHost) DeleteOwned(path string, tables []netfilter.TableRef) (netfilter.Created, error) {
	return h.deleteTables(path, tables, false)
}

// DeleteInert implements TableOwner: DeleteOwned, and tables of others
// holding only built-in chains without rules, policy ACCEPT.
func (h *fakeHost) DeleteInert(path string, tables []netfilter.TableRef) (netfilter.Created, error) {
	return h.deleteTables(path, tables, true)
}

func (h *fakeHost) deleteTables(path string, tables []netfilter.TableRef, inert bool) (netfilter.Created, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.log = append(h.log, "delete-owned")
	n := h.get(path)
	var deleted []netfilter.TableRef
	for _, t := range tables {
		s := n.saves[fakeFamily(t)]
		tbl := s.Table(t.Name)
		if tbl == nil || (!n.owned[t.String()] && !inert) {
			continue
		}
		empty := true
		for _, c := range tbl.Chains {
			if len(c.Rules) > 0 || c.Policy == "-" || (!n.owned[t.String()] && c.Policy != "ACCEPT") {
				empty = false
			}
		}
		if !empty {
			continue
		}
		s.Tables = slices.DeleteFunc(s.Tables, func(x *SavedTable) bool { return x == tbl })
		delete(n.owned, t.String())
		deleted = append(deleted, t)
	}
	return netfilter.Created{Tables: deleted}, nil
}

// takeLog returns and clears the log of command names run.
func (h *fakeHost) takeLog() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	l := h.log
	h.log = nil
	return l
}

// fakeSets implements IPSets in memory, per namespace path; adding an
// address of the wrong family to a set fails, as in the kernel. Pass it to
// NewHostProbe with WithIPSets.
type fakeSets struct {
	mu   sync.Mutex
	sets map[string]map[string]map[netip.Addr]bool // netns → set → members
	fam  map[string]ruleset.Family
}

// newFakeSets returns fakeSets with no sets.
func newFakeSets() *fakeSets {
	return &fakeSets{sets: map[string]map[string]map[netip.Addr]bool{}, fam: map[string]ruleset.Family{}}
}

// EnsureSet implements IPSets.
func (s *fakeSets) EnsureSet(ns, name string, f ruleset.Family) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sets[ns] == nil {
		s.sets[ns] = map[string]map[netip.Addr]bool{}
	}
	if s.sets[ns][name] == nil {
		s.sets[ns][name] = map[netip.Addr]bool{}
		s.fam[name] = f
	}
	return nil
}

// DestroySet implements IPSets.
func (s *fakeSets) DestroySet(ns, name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.sets[ns], name)
	return nil
}

// AddIP implements IPSets.
func (s *fakeSets) AddIP(ns, name string, ip netip.Addr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.sets[ns][name]
	if set == nil {
		return fmt.Errorf("no set %s", name)
	}
	if ip.Is4() != (s.fam[name] == ruleset.IPv4) {
		return fmt.Errorf("family mismatch for %s in %s", ip, name)
	}
	set[ip] = true
	return nil
}

// DelIP implements IPSets.
func (s *fakeSets) DelIP(ns, name string, ip netip.Addr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.sets[ns][name]
	if set == nil {
		return fmt.Errorf("no set %s", name)
	}
	delete(set, ip)
	return nil
}

// ListSet implements IPSets.
func (s *fakeSets) ListSet(ns, name string) ([]netip.Addr, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	set, ok := s.sets[ns][name]
	if !ok {
		return nil, false, nil
	}
	var out []netip.Addr
	for a := range set {
		out = append(out, a)
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out, true, nil
}
