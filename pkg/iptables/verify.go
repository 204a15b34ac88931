package iptables

import (
	"context"
	"fmt"
	"slices"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Verifying a pod's rules: what is in the pod against what the agent applied.

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
