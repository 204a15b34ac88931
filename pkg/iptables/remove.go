package iptables

import (
	"context"
	"fmt"
	"slices"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Taking a pod's rules out, and the tables that go with them.

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
