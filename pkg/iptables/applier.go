package iptables

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Applier installs, verifies and removes the in-pod rule set. It holds no
// per-namespace state, so one Applier serves every pod and is safe for
// concurrent use.
type Applier struct {
	log      *slog.Logger
	backend  Backend
	exec     Executor
	router   Router
	tables   TableOwner
	sets     IPSets
	lockWait time.Duration
	timeout  time.Duration
	// stripes serialise Apply and Remove per namespace path, so two
	// callers converging the same pod cannot both add a missing jump. Two
	// pods whose paths share a stripe wait for each other, so there are
	// many: eight ADDs at once share one with a chance of about 3 %.
	stripes [1024]sync.Mutex
}

// lock takes the stripe of netnsPath and returns its unlock.
func (a *Applier) lock(netnsPath string) func() {
	h := fnv.New32a()
	_, _ = h.Write([]byte(netnsPath))
	m := &a.stripes[h.Sum32()%uint32(len(a.stripes))]
	m.Lock()
	return m.Unlock
}

// Option configures an Applier.
type Option func(*Applier)

// WithExecutor replaces the command runner (tests use a fake).
func WithExecutor(e Executor) Option { return func(a *Applier) { a.exec = e } }

// WithRouter replaces the netlink side (tests use a fake).
func WithRouter(r Router) Option { return func(a *Applier) { a.router = r } }

// TableOwner creates the nf_tables tables and base chains iptables-nft
// would create, marked as ours, and deletes them once empty
// (pkg/netfilter's CreateOwned, DeleteOwned and, in pods, DeleteInert);
// only the nft backend uses it.
type TableOwner interface {
	CreateOwned(netnsPath string, tables []netfilter.TableRef, chains []netfilter.BaseChain) (netfilter.Created, error)
	DeleteOwned(netnsPath string, tables []netfilter.TableRef) (netfilter.Created, error)
	DeleteInert(netnsPath string, tables []netfilter.TableRef) (netfilter.Created, error)
}

// WithTableOwner replaces the nf_tables table side (tests use a fake).
func WithTableOwner(t TableOwner) Option { return func(a *Applier) { a.tables = t } }

// WithLockWait sets how long iptables-restore waits for the xtables lock
// (legacy takes a host-wide lock even for other namespaces). Default 10s.
func WithLockWait(d time.Duration) Option { return func(a *Applier) { a.lockWait = d } }

// WithTimeout bounds each Apply, Verify or Remove that has no deadline of
// its own. Default 60s.
func WithTimeout(d time.Duration) Option { return func(a *Applier) { a.timeout = d } }

// NewApplier returns an Applier using backend b for every namespace.
func NewApplier(log *slog.Logger, b Backend, opts ...Option) *Applier {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Applier{
		log:      log.With("component", "iptables", "backend", string(b)),
		backend:  b,
		exec:     NetnsExecutor{},
		router:   NetlinkRouter{},
		tables:   &netfilter.Owner{},
		sets:     NetlinkIPSets{},
		lockWait: 10 * time.Second,
		timeout:  60 * time.Second,
	}
	for _, o := range opts {
		o(a)
	}
	return a
}

// Close waits for netlink connections the Applier closes in the
// background (see netfilter.Owner).
func (a *Applier) Close() error {
	if c, ok := a.tables.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// Backend returns the backend the Applier drives.
func (a *Applier) Backend() Backend { return a.backend }

func (a *Applier) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || a.timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, a.timeout)
}

// save reads and parses the family's current state in the namespace.
func (a *Applier) save(ctx context.Context, netnsPath string, f ruleset.Family) (*Save, error) {
	out, err := a.exec.Run(ctx, netnsPath, Cmd{Name: a.backend.SaveCmd(f)})
	if err != nil {
		return nil, fmt.Errorf("read %s rules in netns %s: %w", f, netnsPath, err)
	}
	s, err := ParseSave(string(out))
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", a.backend.SaveCmd(f), err)
	}
	return s, nil
}

// restore feeds plan to iptables-restore --noflush: one transaction.
func (a *Applier) restore(ctx context.Context, netnsPath string, f ruleset.Family, plan string) error {
	args := []string{"--noflush"}
	if a.lockWait > 0 {
		args = append(args, "-w", strconv.Itoa(max(1, int(a.lockWait/time.Second))))
	}
	_, err := a.exec.Run(ctx, netnsPath, Cmd{Name: a.backend.RestoreCmd(f), Args: args, Stdin: []byte(plan)})
	if err != nil {
		a.log.Debug("iptables-restore failed", "netns", netnsPath, "family", f.String(), "input", plan)
		return fmt.Errorf("apply %s rules in netns %s: %w", f, netnsPath, err)
	}
	return nil
}

// Apply installs cfg's rules in the namespace: the policy routes, then for
// each family one iptables-restore --noflush transaction (skipped when
// nothing differs). It is all or nothing: when any step fails, what the
// earlier steps changed is undone and the namespace is as it was. IPv6 is
// programmed only when the namespace has IPv6, its policy route only when
// lo has IPv6 too; leftovers of ours in a family without IPv6 are removed.
func (a *Applier) Apply(netnsPath string, cfg ruleset.PodConfig) error {
	return a.ApplyContext(context.Background(), netnsPath, cfg)
}

// familyPlan is one family's part of an apply.
type familyPlan struct {
	f      ruleset.Family
	rs     RuleSet
	routes bool // the policy route belongs to the desired state
	cur    *Save
	plan   string
	added  policyroute.Parts // routing this apply added, undone on failure
	done   bool              // the restore succeeded, reverted on failure
}

// ApplyContext is Apply with a context.
func (a *Applier) ApplyContext(ctx context.Context, netnsPath string, cfg ruleset.PodConfig) error {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	ctx, cancel := a.bound(ctx)
	defer cancel()
	v6, err := a.router.State(netnsPath)
	if err != nil {
		return err
	}
	if !v6.LoopbackUp {
		return fmt.Errorf("lo is down in netns %s: redirected traffic could not reach ztunnel", netnsPath)
	}
	wantV6 := slices.Contains(cfg.Families(v6.IPv6), ruleset.IPv6)
	plans := []*familyPlan{{f: ruleset.IPv4, rs: PodRules(cfg, ruleset.IPv4), routes: true}}
	if wantV6 {
		plans = append(plans, &familyPlan{f: ruleset.IPv6, rs: PodRules(cfg, ruleset.IPv6), routes: v6.IPv6Loopback})
	}
	// Read everything first: a failure here has changed nothing.
	err = each(plans, func(p *familyPlan) error {
		cur, err := a.save(ctx, netnsPath, p.f)
		if err != nil {
			return err
		}
		p.cur, p.plan = cur, PlanApply(p.rs, cur)
		return nil
	})
	if err != nil {
		return err
	}
	if err := a.applyPlans(ctx, netnsPath, plans, podScope); err != nil {
		return err
	}
	switch {
	case cfg.StaleIPv6(v6.IPv6 || v6.IPv6Loopback):
		// IPv6 is left alone in a namespace that has it: what a previous
		// configuration installed for it goes, policy route included.
		if err := a.removeFamily(ctx, netnsPath, ruleset.IPv6, true); err != nil {
			return fmt.Errorf("remove IPv6 rules left by a previous configuration: %w", err)
		}
	case !v6.IPv6:
		if err := a.removeFamily(ctx, netnsPath, ruleset.IPv6, false); err != nil {
			a.log.Debug("no IPv6 leftovers removed", "netns", netnsPath, "err", err)
		}
	}
	if len(plans) > 1 && !v6.IPv6Loopback {
		a.log.Debug("IPv6 disabled on lo: no IPv6 policy route", "netns", netnsPath)
	}
	return nil
}

// applyPlans runs the changing part of an apply: policy routes first (a
// route without the mangle rules changes no packet: nothing carries the
// mark yet), then the restores, both families at once. On any failure it
// undoes what succeeded.
func (a *Applier) applyPlans(ctx context.Context, netnsPath string, plans []*familyPlan, sc *scope) error {
	var errs []error
	for _, p := range plans {
		if !p.routes || len(p.rs.Tables) == 0 || sc != podScope {
			continue
		}
		added, err := a.router.EnsurePolicyRoute(netnsPath, p.f, p.rs.Routing)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s policy routing in netns %s: %w", p.f, netnsPath, err))
			break
		}
		p.added = added
	}
	var created netfilter.Created
	if tables, chains := ownedToBe(plans); len(errs) == 0 && a.backend == BackendNFT && len(tables)+len(chains) > 0 {
		// What iptables-nft would create is created first, marked as
		// ours, so that removal knows it may delete it.
		var err error
		created, err = a.tables.CreateOwned(netnsPath, tables, chains)
		if err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		errs = append(errs, each(plans, func(p *familyPlan) error {
			if p.plan == "" {
				return nil
			}
			if err := a.restore(ctx, netnsPath, p.f, p.plan); err != nil {
				return err
			}
			p.done = true
			return nil
		}))
	}
	err := errors.Join(errs...)
	if err == nil {
		for _, p := range plans {
			a.log.Debug("rules applied", "netns", netnsPath, "family", p.f.String(), "changed", p.plan != "" || p.added.Any())
		}
		return nil
	}
	if uerr := a.undo(ctx, netnsPath, plans, sc, created); uerr != nil {
		a.log.Error("undoing a failed apply failed; the next apply or remove converges it", "netns", netnsPath, "err", uerr)
		return fmt.Errorf("%w (undo: %v)", err, uerr)
	}
	return err
}

// undo reverts what applyPlans changed, from the states read before it.
func (a *Applier) undo(ctx context.Context, netnsPath string, plans []*familyPlan, sc *scope, created netfilter.Created) error {
	var errs []error
	for _, p := range plans {
		if !p.done {
			continue
		}
		after, err := a.save(ctx, netnsPath, p.f)
		if err == nil {
			if plan := planRevert(sc, p.cur, after); plan != "" {
				err = a.restore(ctx, netnsPath, p.f, plan)
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("revert %s rules: %w", p.f, err))
		}
	}
	if !created.Empty() {
		refs := created.Tables
		for _, c := range created.Chains {
			refs = append(refs, c.Table)
		}
		if _, err := a.tables.DeleteOwned(netnsPath, refs); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range plans {
		if p.added.Any() {
			if err := a.router.RemovePolicyRoute(netnsPath, p.f, p.rs.Routing, p.added); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// ownedToBe lists what iptables-nft would create for the plans: the
// tables the saves do not show, and the built-in chains the plans write to
// in tables they do show (iptables-nft-save prints built-in chains whether
// or not they exist, so CreateOwned looks for itself).
func ownedToBe(plans []*familyPlan) ([]netfilter.TableRef, []netfilter.BaseChain) {
	var tables []netfilter.TableRef
	var chains []netfilter.BaseChain
	for _, p := range plans {
		table := ""
		for _, l := range strings.Split(p.plan, "\n") {
			if strings.HasPrefix(l, "*") {
				table = l[1:]
				if p.cur.Table(table) == nil {
					tables = append(tables, nftTable(p.f, table))
				}
				continue
			}
			f := strings.Fields(l)
			if len(f) < 2 || (f[0] != "-A" && f[0] != "-I") || p.cur.Table(table) == nil {
				continue
			}
			if spec, ok := baseChainSpecs[table][f[1]]; ok {
				ch := netfilter.BaseChain{Table: nftTable(p.f, table), Name: f[1], Type: spec.typ, Hook: spec.hook, Priority: spec.prio}
				if !slices.Contains(chains, ch) {
					chains = append(chains, ch)
				}
			}
		}
	}
	return tables, chains
}

// baseChainSpec is how iptables-nft registers a built-in chain.
type baseChainSpec struct {
	typ  string
	hook uint32
	prio int32
}

// baseChainSpecs are iptables-nft's built-in chains of the tables we use
// (iptables' nft.c, the same for ip and ip6).
var baseChainSpecs = map[string]map[string]baseChainSpec{
	TableRaw: {
		"PREROUTING": {"filter", unix.NF_INET_PRE_ROUTING, -300},
		"OUTPUT":     {"filter", unix.NF_INET_LOCAL_OUT, -300},
	},
	TableMangle: {
		"PREROUTING":  {"filter", unix.NF_INET_PRE_ROUTING, -150},
		"INPUT":       {"filter", unix.NF_INET_LOCAL_IN, -150},
		"FORWARD":     {"filter", unix.NF_INET_FORWARD, -150},
		"OUTPUT":      {"route", unix.NF_INET_LOCAL_OUT, -150},
		"POSTROUTING": {"filter", unix.NF_INET_POST_ROUTING, -150},
	},
	TableNAT: {
		"PREROUTING":  {"nat", unix.NF_INET_PRE_ROUTING, -100},
		"INPUT":       {"nat", unix.NF_INET_LOCAL_IN, 100},
		"OUTPUT":      {"nat", unix.NF_INET_LOCAL_OUT, -100},
		"POSTROUTING": {"nat", unix.NF_INET_POST_ROUTING, 100},
	},
}

// nftTable names the nf_tables table iptables-nft uses for table t.
func nftTable(f ruleset.Family, t string) netfilter.TableRef {
	if f == ruleset.IPv6 {
		return netfilter.TableRef{Family: netfilter.FamilyIPv6, Name: t}
	}
	return netfilter.TableRef{Family: netfilter.FamilyIPv4, Name: t}
}

// each runs fn for every plan at once (the families share nothing, and each
// costs a few process executions) and joins the errors.
func each(plans []*familyPlan, fn func(*familyPlan) error) error {
	errs := make([]error, len(plans))
	var wg sync.WaitGroup
	for i, p := range plans {
		wg.Go(func() { errs[i] = fn(p) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// perFamily runs fn for both families at once and joins their errors.
func perFamily(fn func(ruleset.Family) error) error {
	plans := make([]*familyPlan, len(ruleset.Families))
	for i, f := range ruleset.Families {
		plans[i] = &familyPlan{f: f}
	}
	return each(plans, func(p *familyPlan) error { return fn(p.f) })
}

// Verify compares the namespace with cfg's desired state and returns the
// drift; an empty Drift means the rules are exactly in place.
func (a *Applier) Verify(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, error) {
	return a.VerifyContext(context.Background(), netnsPath, cfg)
}

// VerifyContext is Verify with a context.
func (a *Applier) VerifyContext(ctx context.Context, netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, error) {
	d, _, _, err := a.verify(ctx, netnsPath, cfg, 0, false)
	return d, err
}

// VerifyGen implements ruleset.GenVerifier. The nft flavour keeps its
// rules in nf_tables: while the namespace's generation stays gen, the
// iptables-save runs (a few milliseconds of CPU each) are skipped. The
// legacy flavour's x_tables have no generation: it returns 0 and reads
// in full every time.
func (a *Applier) VerifyGen(netnsPath string, cfg ruleset.PodConfig, gen uint32) (ruleset.Drift, uint32, error) {
	d, _, now, err := a.VerifySeeingGen(netnsPath, cfg, gen)
	return d, now, err
}

// VerifySeeingGen is VerifyGen, also reporting what it saw of the
// namespace's other netfilter tables: its x_tables (iptables-legacy)
// tables, from the state the verify reads anyway, so a look for legacy
// rules is only made where there are some; whether it holds nf_tables
// tables of another tool is not read, and it says it may.
func (a *Applier) VerifySeeingGen(netnsPath string, cfg ruleset.PodConfig, gen uint32) (ruleset.Drift, netfilter.Seen, uint32, error) {
	d, now, st, err := a.verify(context.Background(), netnsPath, cfg, gen, true)
	return d, netfilter.Seen{IPTables: true, XTables: len(st.XTables) > 0}, now, err
}

// verify is Verify, also returning the namespace's state; withGen reads
// the generation for VerifyGen.
func (a *Applier) verify(ctx context.Context, netnsPath string, cfg ruleset.PodConfig, gen uint32, withGen bool) (ruleset.Drift, uint32, netns.State, error) {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return ruleset.Drift{}, 0, netns.State{}, err
	}
	if err := cfg.Validate(); err != nil {
		return ruleset.Drift{}, 0, netns.State{}, err
	}
	ctx, cancel := a.bound(ctx)
	defer cancel()
	// The policy routes wanted: the rules are rendered only when read.
	wants := map[ruleset.Family]ruleset.PolicyRoute{}
	for _, f := range ruleset.Families {
		wants[f] = ruleset.PodRules(cfg, f).Routing
	}
	pv, err := a.view(netnsPath, cfg, wants, withGen && a.backend == BackendNFT)
	if err != nil {
		return ruleset.Drift{}, 0, netns.State{}, err
	}
	now, v6 := pv.gen, pv.state
	unchanged := gen != 0 && now == gen
	drifts := make([][]ruleset.DriftItem, len(ruleset.Families))
	if !unchanged {
		// The rules, one iptables-save per family, at once.
		err = perFamily(func(f ruleset.Family) error {
			i := slices.Index(ruleset.Families, f)
			rs := PodRules(cfg, f)
			stale := f == ruleset.IPv6 && cfg.StaleIPv6(v6.IPv6 || v6.IPv6Loopback)
			if f == ruleset.IPv6 && !stale && !v6.IPv6 {
				// Only leftovers can drift in a disabled family; one
				// that cannot be read there has none.
				if cur, err := a.save(ctx, netnsPath, f); err == nil {
					drifts[i] = RuleSet{Family: f}.Diff(cur).Items
				}
				return nil
			}
			cur, err := a.save(ctx, netnsPath, f)
			if err != nil {
				return err
			}
			if stale {
				// IPv6 left alone: anything of ours there is a leftover.
				drifts[i] = RuleSet{Family: f}.Diff(cur).Items
			} else {
				drifts[i] = rs.Diff(cur).Items
			}
			return nil
		})
		if err != nil {
			return ruleset.Drift{}, 0, netns.State{}, err
		}
	}
	var d ruleset.Drift
	for i, f := range ruleset.Families {
		d.Items = append(d.Items, drifts[i]...)
		r, ok := pv.routes[f]
		if !ok {
			continue
		}
		want := wants[f]
		if f == ruleset.IPv6 && cfg.StaleIPv6(v6.IPv6 || v6.IPv6Loopback) {
			d.Items = append(d.Items, policyroute.Leftover(f, want, r.rule, r.route)...)
		} else {
			d.Items = append(d.Items, policyroute.Drift(f, want, r.rule, r.route)...)
		}
	}
	return d, now, v6, nil
}

// podView is what a verify reads of a pod's namespace besides its
// iptables rules: the nf_tables generation (when asked), the namespace's
// state, and the policy rule and route of each family that has one to
// check.
type podView struct {
	gen    uint32
	state  netns.State
	routes map[ruleset.Family]routeState
}

// routeState says whether a family's policy rule and local route exist.
type routeState struct{ rule, route bool }

// routeFamilies are the families whose policy route a verify checks in a
// namespace in state st: IPv4 always; IPv6 when it has IPv6 on lo as well
// (the desired route), or when cfg leaves IPv6 alone on a namespace that
// has it (a leftover).
func routeFamilies(cfg ruleset.PodConfig, st netns.State) []ruleset.Family {
	out := []ruleset.Family{ruleset.IPv4}
	if cfg.StaleIPv6(st.IPv6 || st.IPv6Loopback) || (st.IPv6 && st.IPv6Loopback) {
		out = append(out, ruleset.IPv6)
	}
	return out
}

// view reads the pod's podView, the policy routes against wants. With the netlink router it enters the
// namespace once for all of it, on one routing socket: the verifier
// verifies every pod each period, and each entry and socket costs system
// time. The generation is read first: a change made after it moves it,
// so the next verify reads the rules again.
func (a *Applier) view(netnsPath string, cfg ruleset.PodConfig, wants map[ruleset.Family]ruleset.PolicyRoute, withGen bool) (podView, error) {
	pv := podView{routes: map[ruleset.Family]routeState{}}
	if _, ok := a.router.(NetlinkRouter); ok {
		err := netns.Do(netnsPath, func() error {
			var err error
			if withGen {
				// "": the namespace this thread is in now.
				if pv.gen, err = netfilter.Generation(""); err != nil {
					return err
				}
			}
			if pv.state, err = netns.ReadState(); err != nil {
				return err
			}
			c, err := policyroute.Dial(pv.state.LoopbackIndex)
			if err != nil {
				return err
			}
			defer c.Close()
			for _, f := range routeFamilies(cfg, pv.state) {
				rule, route, err := c.PolicyRouteState(f, wants[f])
				if err != nil {
					return fmt.Errorf("%s policy routing: %w", f, err)
				}
				pv.routes[f] = routeState{rule, route}
			}
			return nil
		})
		if err != nil {
			return podView{}, fmt.Errorf("netns %s: %w", netnsPath, err)
		}
		return pv, nil
	}
	var err error
	if withGen {
		if pv.gen, err = netfilter.Generation(netnsPath); err != nil {
			return podView{}, err
		}
	}
	if pv.state, err = a.router.State(netnsPath); err != nil {
		return podView{}, err
	}
	for _, f := range routeFamilies(cfg, pv.state) {
		rule, route, err := a.router.PolicyRouteState(netnsPath, f, wants[f])
		if err != nil {
			return podView{}, fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
		}
		pv.routes[f] = routeState{rule, route}
	}
	return pv, nil
}

// Remove deletes everything Apply installed in the namespace, whatever
// options it was applied with: our chains, every rule referring to them,
// the policy rule and route. With the nft backend the tables and built-in
// chains Apply created are deleted too once empty (see dropOwnedTables;
// legacy tables cannot be unregistered, and an empty one has no effect).
// It is idempotent and safe when nothing is installed.
func (a *Applier) Remove(netnsPath string) error {
	return a.RemoveContext(context.Background(), netnsPath)
}

// RemoveContext is Remove with a context.
func (a *Applier) RemoveContext(ctx context.Context, netnsPath string) error {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	ctx, cancel := a.bound(ctx)
	defer cancel()
	v6, err := a.router.State(netnsPath)
	if err != nil {
		return err
	}
	return perFamily(func(f ruleset.Family) error {
		err := a.removeFamily(ctx, netnsPath, f, f == ruleset.IPv4 || v6.IPv6)
		if err != nil && f == ruleset.IPv6 && !v6.IPv6 {
			// ip6tables may be unusable without IPv6; nothing of ours can be there.
			a.log.Debug("skipping IPv6 removal", "netns", netnsPath, "err", err)
			return nil
		}
		return err
	})
}

// RemoveRules deletes our chains and every rule referring to them in both
// families but keeps the policy routes: for moving a pod to the other
// backend, which uses the same routes. Idempotent.
func (a *Applier) RemoveRules(netnsPath string) error {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	ctx, cancel := a.bound(context.Background())
	defer cancel()
	st, err := a.router.State(netnsPath)
	if err != nil {
		return err
	}
	return perFamily(func(f ruleset.Family) error {
		err := a.removeFamily(ctx, netnsPath, f, false)
		if err != nil && f == ruleset.IPv6 && !st.IPv6 {
			return nil // ip6tables may be unusable without IPv6; nothing of ours can be there
		}
		return err
	})
}

// HasRules reports whether the namespace holds any chain of ours or any
// rule referring to one, in either family.
func (a *Applier) HasRules(netnsPath string) (bool, error) {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return false, err
	}
	ctx, cancel := a.bound(context.Background())
	defer cancel()
	st, err := a.router.State(netnsPath)
	if err != nil {
		return false, err
	}
	found := make([]bool, len(ruleset.Families))
	err = perFamily(func(f ruleset.Family) error {
		cur, err := a.save(ctx, netnsPath, f)
		if err != nil {
			if f == ruleset.IPv6 && !st.IPv6 {
				return nil
			}
			return err
		}
		found[slices.Index(ruleset.Families, f)] = PlanRemove(cur) != ""
		return nil
	})
	return slices.Contains(found, true), err
}

// removeFamily removes our rules of family f; routing too when routes is set.
func (a *Applier) removeFamily(ctx context.Context, netnsPath string, f ruleset.Family, routes bool) error {
	cur, err := a.save(ctx, netnsPath, f)
	if err != nil {
		return err
	}
	if plan := PlanRemove(cur); plan != "" {
		if err := a.restore(ctx, netnsPath, f, plan); err != nil {
			return err
		}
		a.dropPodTables(netnsPath, f, touchedTables(plan))
		a.log.Debug("rules removed", "netns", netnsPath, "family", f.String())
	}
	if !routes {
		return nil
	}
	if err := a.router.RemovePolicyRoute(netnsPath, f, PodRules(ruleset.PodConfig{}, f).Routing, policyroute.All); err != nil {
		return fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
	}
	return nil
}

// dropOwnedTables deletes the nf_tables tables of family f among tables,
// and the built-in chains in them, that this project created (they carry
// netfilter.OwnerComment) and that the removal left empty, so the
// namespace's ruleset is what it was before us.
// The kernel checks emptiness in the same transaction as the deletion, so
// a rule another tool added meanwhile keeps its table; a table that was
// there before us is never deleted. Failure costs only an empty, inert
// table, so it is logged, not returned. Legacy tables cannot be deleted.
func (a *Applier) dropOwnedTables(netnsPath string, f ruleset.Family, tables []string) {
	a.dropTables(netnsPath, f, tables, false)
}

// dropPodTables is dropOwnedTables in a pod, where a table our removal
// left inert (nothing but built-in chains without rules, policy accept)
// goes too, whoever made it: the tables of a pod istio-cni captured are
// its iptables-nft's, ours wrote into them, and once they are empty they
// only cost every packet a hook call per chain.
func (a *Applier) dropPodTables(netnsPath string, f ruleset.Family, tables []string) {
	a.dropTables(netnsPath, f, tables, true)
}

func (a *Applier) dropTables(netnsPath string, f ruleset.Family, tables []string, inert bool) {
	if a.backend != BackendNFT || len(tables) == 0 {
		return
	}
	refs := make([]netfilter.TableRef, len(tables))
	for i, t := range tables {
		refs[i] = nftTable(f, t)
	}
	del := a.tables.DeleteOwned
	if inert {
		del = a.tables.DeleteInert
	}
	if _, err := del(netnsPath, refs); err != nil {
		a.log.Debug("empty tables left in place", "netns", netnsPath, "tables", refs, "err", err)
	}
}
