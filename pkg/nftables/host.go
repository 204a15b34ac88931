package nftables

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"

	gnft "github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// HostProbe keeps the kubelet probe SNAT in one network namespace (the
// node's, netnsPath "", in production) as one nf_tables table, inet
// ambient-probe-snat: a set of enrolled pod IPs per family and a nat chain
// at POSTROUTING priority 90, so it runs before iptables' nat table and any
// nat chain at the usual srcnat priority. It keeps one netlink connection
// open (set updates delete elements; see Applier), closed by Remove or
// Close. Safe for concurrent use.
type HostProbe struct {
	log   *slog.Logger
	netns string
	cfg   ruleset.HostProbeConfig

	mu sync.Mutex
	c  conn // lazily dialled; zero when closed
	// seen is what the probe sets held at nf_tables generation seenGen
	// (seen nil: not read yet), for Lacks.
	seen    map[netip.Addr]bool
	seenGen uint32
}

// NewHostProbe returns a HostProbe for the namespace at netnsPath ("" = the
// caller's).
func NewHostProbe(log *slog.Logger, netnsPath string, cfg ruleset.HostProbeConfig) *HostProbe {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &HostProbe{log: log.With("component", "nftables", "part", "host-probe"), netns: netnsPath, cfg: cfg}
}

// conn returns the lasting connection, dialling it first. h.mu held.
func (h *HostProbe) conn() (conn, error) {
	if h.c.ok() {
		return h.c, nil
	}
	c, err := dial(h.netns, true)
	if err != nil {
		return conn{}, err
	}
	h.c = c
	return c, nil
}

// drop closes the connection after an error, so the next call starts on a
// clean socket. h.mu held.
func (h *HostProbe) drop() {
	if h.c.ok() {
		_ = h.c.close()
		h.c = conn{}
	}
}

// Close closes the netlink connection; the rules stay.
func (h *HostProbe) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.drop()
	return nil
}

func (h *HostProbe) families() ([]ruleset.Family, error) {
	st, err := netns.StateOf(h.netns)
	if err != nil {
		return nil, err
	}
	return h.cfg.Families(st.IPv6), nil
}

func (h *HostProbe) program() (program, error) {
	fams, err := h.families()
	if err != nil {
		return program{}, err
	}
	return renderHost(h.cfg, fams)
}

// Ensure creates the table, sets and chain, or repairs them in one batch
// when they drift, keeping the sets' members. Safe at every agent start and
// as a periodic resync.
func (h *HostProbe) Ensure() error {
	if err := h.cfg.Validate(); err != nil {
		return err
	}
	p, err := h.program()
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	c, err := h.conn()
	if err != nil {
		return err
	}
	live, _, err := readLive(c, []string{TableHost}, true)
	if err != nil {
		h.drop()
		return fmt.Errorf("read host nf_tables state: %w", err)
	}
	if len(diff(p, live, []string{TableHost})) == 0 {
		return nil
	}
	// Add what is missing (existing sets keep their members), then
	// replace the chain: deleting it and adding it again in the same
	// batch also fixes a hook or priority changed by hand.
	t := p.tables[0]
	if lt := live[TableHost]; lt != nil {
		for _, lc := range lt.chains {
			c.q.DelChain(lc.c)
		}
		// A set of the wrong type cannot be added over, and one the
		// program no longer has (IPv6's, with IPv6 now left alone) serves
		// nothing; their rules went with the chain above, so they can go.
		for _, ls := range lt.sets {
			i := slices.IndexFunc(t.sets, func(s *set) bool { return s.name == ls.Name })
			if i < 0 || ls.KeyType.GetNFTMagic() != t.sets[i].keyType.GetNFTMagic() {
				c.q.DelSet(ls)
			}
		}
	}
	add(c.q.Conn, p)
	if err := c.flush(); err != nil {
		h.drop()
		return fmt.Errorf("install host probe SNAT (%s): %w", t.name, err)
	}
	return nil
}

func (h *HostProbe) set(f ruleset.Family) *gnft.Set {
	kt := gnft.TypeIPAddr
	if f == ruleset.IPv6 {
		kt = gnft.TypeIP6Addr
	}
	return &gnft.Set{Table: &gnft.Table{Name: TableHost, Family: gnft.TableFamilyINet}, Name: ruleset.ProbeSet(f), KeyType: kt}
}

// setOp runs one element change on the probe set of ip's family.
func (h *HostProbe) setOp(ip netip.Addr, del bool) error {
	ip, f, err := ruleset.ProbeIP(ip)
	if err != nil {
		return err
	}
	if f == ruleset.IPv6 && h.cfg.IPv4Only {
		// No IPv6 probe SNAT: the pod's IPv6 is not captured, so kubelet's
		// IPv6 probes reach the app as they are.
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	c, err := h.conn()
	if err != nil {
		return err
	}
	s := h.set(f)
	el := []gnft.SetElement{{Key: ip.AsSlice()}}
	op, verb := c.q.SetAddElements, "add"
	if del {
		op, verb = c.q.SetDeleteElements, "delete"
	}
	if err := op(s, el); err != nil {
		return err
	}
	err = c.flush()
	if del && errors.Is(err, unix.ENOENT) {
		return nil // already absent, or no set: nothing to remove
	}
	if err != nil {
		h.drop()
		return fmt.Errorf("%s %s in set %s: %w", verb, ip, s.Name, err)
	}
	return nil
}

// AddIP adds an enrolled pod IP to its family's set (idempotent), and, for
// a branch ENI pod, its probe path (pkg/policyroute.AddBranchENI). Call
// after the pod's rules are in place.
func (h *HostProbe) AddIP(ip netip.Addr) error {
	if err := h.setOp(ip, false); err != nil {
		return err
	}
	if h.cfg.NoBranchENI || (h.cfg.IPv4Only && ip.Unmap().Is6()) {
		return nil
	}
	return netns.Do(h.netns, func() error {
		_, err := policyroute.AddBranchENI(ip.Unmap())
		return err
	})
}

// DelIP removes a pod IP from its family's set and its branch ENI probe
// path (idempotent).
func (h *HostProbe) DelIP(ip netip.Addr) error {
	if err := h.setOp(ip, true); err != nil {
		return err
	}
	return h.removeBranchENI(ip.Unmap())
}

// RemoveBranchENI deletes the probe path of every branch ENI pod. Remove
// leaves it: the ip rules are the node's, not one backend's, and a switch
// of backends removes the old one's after the new one has added its own.
func (h *HostProbe) RemoveBranchENI() error { return h.removeBranchENI(netip.Addr{}) }

func (h *HostProbe) removeBranchENI(ip netip.Addr) error {
	return netns.Do(h.netns, func() error { return policyroute.RemoveBranchENI(ip) })
}

// IPs lists the IPs in both sets, for reconciliation after a restart.
func (h *HostProbe) IPs() ([]netip.Addr, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c, err := h.conn()
	if err != nil {
		return nil, err
	}
	live, _, err := readLive(c, []string{TableHost}, true)
	if err != nil {
		h.drop()
		return nil, err
	}
	lt := live[TableHost]
	if lt == nil {
		return nil, nil
	}
	var out []netip.Addr
	for _, f := range ruleset.Families {
		if !slices.ContainsFunc(lt.sets, func(s *gnft.Set) bool { return s.Name == ruleset.ProbeSet(f) }) {
			continue
		}
		els, err := c.r.GetSetElements(h.set(f))
		if err != nil {
			h.drop()
			return nil, fmt.Errorf("list set %s: %w", ruleset.ProbeSet(f), err)
		}
		for _, e := range els {
			if a, ok := netip.AddrFromSlice(e.Key); ok {
				out = append(out, a.Unmap())
			}
		}
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out, nil
}

// Lacks returns those of ips the probe sets lack: what the verifier asks
// for every pod it proves. The sets are listed again only when the
// namespace's nf_tables generation moved since the last list, so on a
// quiet node a proof does not read the IPs of every other pod.
func (h *HostProbe) Lacks(ips []netip.Addr) ([]netip.Addr, error) {
	// Read before the sets: a change made after it moves it, so the next
	// call lists again.
	gen, err := netfilter.Generation(h.netns)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	have := h.seen
	if h.seenGen != gen {
		have = nil
	}
	h.mu.Unlock()
	if have == nil {
		list, err := h.IPs()
		if err != nil {
			return nil, err
		}
		have = make(map[netip.Addr]bool, len(list))
		for _, ip := range list {
			have[ip] = true
		}
		h.mu.Lock()
		h.seen, h.seenGen = have, gen
		h.mu.Unlock()
	}
	var out []netip.Addr
	for _, ip := range ips {
		ip, f, err := ruleset.ProbeIP(ip)
		if err != nil || (f == ruleset.IPv6 && h.cfg.IPv4Only) {
			continue // AddIP puts none there
		}
		if !have[ip] {
			out = append(out, ip)
		}
	}
	return out, nil
}

// Verify reports drift of the table, its sets and its chain.
func (h *HostProbe) Verify() (ruleset.Drift, error) {
	p, err := h.program()
	if err != nil {
		return ruleset.Drift{}, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	c, err := h.conn()
	if err != nil {
		return ruleset.Drift{}, err
	}
	live, _, err := readLive(c, []string{TableHost}, true)
	if err != nil {
		h.drop()
		return ruleset.Drift{}, err
	}
	return ruleset.Drift{Items: diff(p, live, []string{TableHost})}, nil
}

// RemoveRules is Remove: the sets live in the table.
func (h *HostProbe) RemoveRules() error { return h.Remove() }

// Remove deletes the table with its sets and chain, leaving the namespace
// as before Ensure, and closes the connection. Idempotent.
func (h *HostProbe) Remove() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	c, err := h.conn()
	if err != nil {
		return err
	}
	defer h.drop()
	tables, err := c.r.ListTablesOfFamily(gnft.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("list host nf_tables tables: %w", err)
	}
	for _, t := range tables {
		if t.Name == TableHost {
			c.q.DelTable(t)
			if err := c.flush(); err != nil {
				return fmt.Errorf("remove host probe SNAT: %w", err)
			}
		}
	}
	return nil
}
