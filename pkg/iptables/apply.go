package iptables

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Putting a pod's rules in: one plan per family, applied in one batch and
// undone whole on failure.

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
