package iptables

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"
)

// Applier installs, verifies and removes the in-pod rule set. It holds no
// per-namespace state, so one Applier serves every pod and is safe for
// concurrent use.
type Applier struct {
	log      *slog.Logger
	backend  Backend
	exec     Executor
	router   Router
	sets     IPSets
	lockWait time.Duration
	timeout  time.Duration
	// stripes serialise Apply and Remove per namespace path, so two
	// callers converging the same pod cannot both add a missing jump.
	stripes [64]sync.Mutex
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
		sets:     NetlinkIPSets{},
		lockWait: 10 * time.Second,
		timeout:  60 * time.Second,
	}
	for _, o := range opts {
		o(a)
	}
	return a
}

// Backend returns the backend the Applier drives.
func (a *Applier) Backend() Backend { return a.backend }

func (a *Applier) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || a.timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, a.timeout)
}

// podNetns refuses an empty path: for the Executor it means "the caller's
// namespace", which for the node agent is the host's, never a pod's.
func podNetns(path string) error {
	if path == "" {
		return errors.New("pod netns path is empty")
	}
	return nil
}

// save reads and parses the family's current state in the namespace.
func (a *Applier) save(ctx context.Context, netnsPath string, f Family) (*Save, error) {
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
func (a *Applier) restore(ctx context.Context, netnsPath string, f Family, plan string) error {
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

// Apply installs cfg's rules in the namespace: for each family one
// iptables-restore --noflush transaction (skipped when nothing differs)
// and the policy route. IPv6 is programmed only when the namespace has
// IPv6 enabled; leftovers of ours in a disabled family are removed.
func (a *Applier) Apply(netnsPath string, cfg PodConfig) error {
	return a.ApplyContext(context.Background(), netnsPath, cfg)
}

// ApplyContext is Apply with a context.
func (a *Applier) ApplyContext(ctx context.Context, netnsPath string, cfg PodConfig) error {
	if err := podNetns(netnsPath); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	ctx, cancel := a.bound(ctx)
	defer cancel()
	v6, err := a.router.IPv6Enabled(netnsPath)
	if err != nil {
		return err
	}
	return perFamily(func(f Family) error {
		if f == IPv6 && !v6 {
			if err := a.removeFamily(ctx, netnsPath, f, false); err != nil {
				a.log.Debug("no IPv6 leftovers removed", "netns", netnsPath, "err", err)
			}
			return nil
		}
		return a.applyFamily(ctx, netnsPath, PodRules(cfg, f))
	})
}

// perFamily runs fn for both families at once (they share nothing, and
// each costs a few process executions) and joins their errors.
func perFamily(fn func(Family) error) error {
	errs := make([]error, len(Families))
	var wg sync.WaitGroup
	for i, f := range Families {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(f)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// applyFamily converges one family: restore only when the plan is not
// empty, then the policy route.
func (a *Applier) applyFamily(ctx context.Context, netnsPath string, rs RuleSet) error {
	f := rs.Family
	cur, err := a.save(ctx, netnsPath, f)
	if err != nil {
		return err
	}
	plan := PlanApply(rs, cur)
	if plan != "" {
		if err := a.restore(ctx, netnsPath, f, plan); err != nil {
			return err
		}
	}
	if err := a.router.EnsurePolicyRoute(netnsPath, f, rs.Routing); err != nil {
		return fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
	}
	a.log.Debug("rules applied", "netns", netnsPath, "family", f.String(), "changed", plan != "")
	return nil
}

// Verify compares the namespace with cfg's desired state and returns the
// drift; an empty Drift means the rules are exactly in place.
func (a *Applier) Verify(netnsPath string, cfg PodConfig) (Drift, error) {
	return a.VerifyContext(context.Background(), netnsPath, cfg)
}

// VerifyContext is Verify with a context.
func (a *Applier) VerifyContext(ctx context.Context, netnsPath string, cfg PodConfig) (Drift, error) {
	if err := podNetns(netnsPath); err != nil {
		return Drift{}, err
	}
	if err := cfg.Validate(); err != nil {
		return Drift{}, err
	}
	ctx, cancel := a.bound(ctx)
	defer cancel()
	v6, err := a.router.IPv6Enabled(netnsPath)
	if err != nil {
		return Drift{}, err
	}
	drifts := make([][]DriftItem, len(Families))
	err = perFamily(func(f Family) error {
		i := slices.Index(Families, f)
		rs := PodRules(cfg, f)
		if f == IPv6 && !v6 {
			// Only leftovers can drift in a disabled family.
			if cur, err := a.save(ctx, netnsPath, f); err == nil {
				drifts[i] = RuleSet{Family: f}.Diff(cur).Items
			}
			return nil
		}
		cur, err := a.save(ctx, netnsPath, f)
		if err != nil {
			return err
		}
		rule, route, err := a.router.PolicyRouteState(netnsPath, f, rs.Routing)
		if err != nil {
			return fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
		}
		drifts[i] = append(rs.Diff(cur).Items, routingDrift(f, rs.Routing, rule, route)...)
		return nil
	})
	if err != nil {
		return Drift{}, err
	}
	var d Drift
	for _, items := range drifts {
		d.Items = append(d.Items, items...)
	}
	return d, nil
}

// routingDrift reports a missing rule or route.
func routingDrift(f Family, p PolicyRoute, rule, route bool) []DriftItem {
	var items []DriftItem
	if !rule {
		items = append(items, DriftItem{Family: f, Kind: DriftMissing, Object: "ip rule",
			Want: fmt.Sprintf("pref %d fwmark %#x/%#x lookup %d", p.Priority, p.Mark, p.Mask, p.Table)})
	}
	if !route {
		items = append(items, DriftItem{Family: f, Kind: DriftMissing, Object: "route",
			Want: fmt.Sprintf("local %s dev lo table %d", p.Local, p.Table)})
	}
	return items
}

// Remove deletes everything Apply installed in the namespace, whatever
// options it was applied with: our chains, every rule referring to them,
// the policy rule and route. With the nft backend a table left empty by the
// removal is deleted too, since iptables-nft created it for us (legacy
// tables cannot be unregistered, and an empty one has no effect). It is
// idempotent and safe when nothing is installed.
func (a *Applier) Remove(netnsPath string) error {
	return a.RemoveContext(context.Background(), netnsPath)
}

// RemoveContext is Remove with a context.
func (a *Applier) RemoveContext(ctx context.Context, netnsPath string) error {
	if err := podNetns(netnsPath); err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	ctx, cancel := a.bound(ctx)
	defer cancel()
	v6, err := a.router.IPv6Enabled(netnsPath)
	if err != nil {
		return err
	}
	return perFamily(func(f Family) error {
		err := a.removeFamily(ctx, netnsPath, f, f == IPv4 || v6)
		if err != nil && f == IPv6 && !v6 {
			// ip6tables may be unusable without IPv6; nothing of ours can be there.
			a.log.Debug("skipping IPv6 removal", "netns", netnsPath, "err", err)
			return nil
		}
		return err
	})
}

// removeFamily removes our rules of family f; routing too when routes is set.
func (a *Applier) removeFamily(ctx context.Context, netnsPath string, f Family, routes bool) error {
	cur, err := a.save(ctx, netnsPath, f)
	if err != nil {
		return err
	}
	if plan := PlanRemove(cur); plan != "" {
		if err := a.restore(ctx, netnsPath, f, plan); err != nil {
			return err
		}
		if a.backend == BackendNFT {
			a.dropEmptyTables(ctx, netnsPath, f, podScope, cur, touchedTables(plan))
		}
		a.log.Debug("rules removed", "netns", netnsPath, "family", f.String())
	}
	if !routes {
		return nil
	}
	if err := a.router.RemovePolicyRoute(netnsPath, f, PodRules(PodConfig{}, f).Routing); err != nil {
		return fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
	}
	return nil
}

// dropEmptyTables deletes nf_tables tables that held only our rules, so
// the namespace's ruleset is what it was before Apply. Failure only costs
// an empty, inert table, so it is logged, not returned.
func (a *Applier) dropEmptyTables(ctx context.Context, netnsPath string, f Family, sc *scope, before *Save, tables []string) {
	family := "ip"
	if f == IPv6 {
		family = "ip6"
	}
	for _, t := range tables {
		if !emptyAfterRemove(sc, before.Table(t)) {
			continue
		}
		cmd := Cmd{Name: "nft", Args: []string{"delete", "table", family, t}}
		if _, err := a.exec.Run(ctx, netnsPath, cmd); err != nil {
			a.log.Debug("empty table left in place", "netns", netnsPath, "table", family+" "+t, "err", err)
		}
	}
}
