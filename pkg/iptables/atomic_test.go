package iptables

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// Apply is all or nothing across both families and policy routing: these
// tests break one step and check that the namespace is as it was.

// state renders everything an apply may change in a fake namespace.
func (n *fakeNS) state() string {
	on := func(m map[ruleset.Family]bool) string { return fmt.Sprint(m[ruleset.IPv4], m[ruleset.IPv6]) }
	owned := slices.Sorted(maps.Keys(maps.Collect(func(yield func(string, bool) bool) {
		for k, v := range n.owned {
			if v && !yield(k, v) {
				return
			}
		}
	})))
	return fmt.Sprintf("%s\n%s\nrule %s route %s owned %v", sortedChains(n.saves[ruleset.IPv4]), sortedChains(n.saves[ruleset.IPv6]), on(n.rule), on(n.route), owned)
}

// sortedChains renders s with each table's chains in name order: the order
// of chain declarations means nothing to iptables.
func sortedChains(s *Save) string {
	c := cloneSave(s)
	for _, t := range c.Tables {
		slices.SortFunc(t.Chains, func(a, b *SavedChain) int { return strings.Compare(a.Name, b.Name) })
	}
	return c.String()
}

func TestApplierAllOrNothingWithFake(t *testing.T) {
	dns, bypass := ruleset.PodConfig{DNSCapture: true}, ruleset.PodConfig{BypassInbound: true}
	for _, tc := range []struct {
		name   string
		before *ruleset.PodConfig // applied first, nil for a fresh namespace
		breakf func(h *fakeHost, n *fakeNS)
	}{
		{"ipv6 route refused", nil, func(_ *fakeHost, n *fakeNS) {
			n.routeErr[ruleset.IPv6] = errors.New("IPv6 is disabled on nexthop device")
		}},
		{"ipv6 restore fails", nil, func(h *fakeHost, _ *fakeNS) { h.failOn = "ip6tables-nft-restore" }},
		{"ipv4 restore fails", nil, func(h *fakeHost, _ *fakeNS) { h.failOn = "iptables-nft-restore" }},
		{"ipv6 restore fails over other options", &dns, func(h *fakeHost, _ *fakeNS) { h.failOn = "ip6tables-nft-restore" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, h := fakeApplier(BackendNFT)
			n := h.get("p")
			if tc.before != nil {
				if err := a.Apply("p", *tc.before); err != nil {
					t.Fatal(err)
				}
			}
			was := n.state()
			tc.breakf(h, n)
			if err := a.Apply("p", bypass); err == nil {
				t.Fatal("apply succeeded")
			}
			h.failOn = ""
			if now := n.state(); now != was {
				t.Fatalf("failed apply left changes:\nbefore %s\nafter  %s", was, now)
			}
		})
	}
	t.Run("lo down", func(t *testing.T) {
		a, h := fakeApplier(BackendNFT)
		h.get("p").loDown = true
		if err := a.Apply("p", ruleset.PodConfig{}); err == nil || !strings.Contains(err.Error(), "lo is down") {
			t.Fatalf("apply with lo down: %v", err)
		}
		if log := h.takeLog(); len(log) != 0 {
			t.Fatalf("ran %v", log)
		}
	})
	t.Run("IPv6 off on lo", func(t *testing.T) {
		a, h := fakeApplier(BackendNFT)
		n := h.get("p")
		n.noLoV6 = true
		if err := a.Apply("p", ruleset.PodConfig{}); err != nil {
			t.Fatal(err)
		}
		if n.saves[ruleset.IPv6].Table("nat") == nil || n.rule[ruleset.IPv6] || n.route[ruleset.IPv6] || !n.rule[ruleset.IPv4] {
			t.Fatalf("want IPv6 rules without IPv6 routing: rule %v route %v\n%s", n.rule, n.route, n.saves[ruleset.IPv6])
		}
		if d, err := a.Verify("p", ruleset.PodConfig{}); err != nil || !d.Empty() {
			t.Fatalf("verify: %v\n%s", err, d)
		}
	})
}

// failingExec makes one command fail and runs the rest for real.
type failingExec struct {
	Executor
	fail string
}

func (e failingExec) Run(ctx context.Context, netnsPath string, cmd Cmd) ([]byte, error) {
	if cmd.Name == e.fail {
		return nil, fmt.Errorf("%s: injected failure", cmd.Name)
	}
	return e.Executor.Run(ctx, netnsPath, cmd)
}

// failingRouter refuses one family's policy route and routes the rest for
// real.
type failingRouter struct {
	Router
	fail ruleset.Family
}

func (r failingRouter) EnsurePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (policyroute.Parts, error) {
	if f == r.fail {
		return policyroute.Parts{}, fmt.Errorf("%s route: injected failure", f)
	}
	return r.Router.EnsurePolicyRoute(netnsPath, f, want)
}

func TestApplyAtomicDataplane(t *testing.T) {
	testnet.RequireRoot(t)
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		t.Run(string(b), func(t *testing.T) {
			requireBackend(t, b)
			// lo down and IPv6 off on lo: pkg/rulesbackend's matrix.
			t.Run("injected failures", func(t *testing.T) { injectedFailures(t, b) })
		})
	}
}

// injectedFailures: real iptables and netlink, one step made to fail;
// the namespace must be exactly as before, fresh or with earlier rules.
func injectedFailures(t *testing.T, b Backend) {
	for _, before := range []*ruleset.PodConfig{nil, {DNSCapture: true}} {
		for _, tc := range []struct {
			name string
			opts []Option
		}{
			{"ipv6 restore", []Option{WithExecutor(failingExec{NetnsExecutor{}, b.RestoreCmd(ruleset.IPv6)})}},
			{"ipv4 restore", []Option{WithExecutor(failingExec{NetnsExecutor{}, b.RestoreCmd(ruleset.IPv4)})}},
			{"ipv6 route", []Option{WithRouter(failingRouter{NetlinkRouter{}, ruleset.IPv6})}},
		} {
			t.Run(fmt.Sprintf("%s/after %v", tc.name, before != nil), func(t *testing.T) {
				pair := testnet.NewPair(t)
				A := pair.A.NS.Path()
				if before != nil {
					if err := NewApplier(testLogger(t), b).Apply(A, *before); err != nil {
						t.Fatal(err)
					}
				}
				was := snapshot(t, A)
				broken := NewApplier(testLogger(t), b, tc.opts...)
				if err := broken.Apply(A, ruleset.PodConfig{BypassInbound: true}); err == nil || !strings.Contains(err.Error(), "injected") {
					t.Fatalf("apply: %v", err)
				}
				if now := snapshot(t, A); now != was {
					t.Fatalf("failed apply left changes:\nbefore:\n%s\nafter:\n%s", was, now)
				}
			})
		}
	}
}
