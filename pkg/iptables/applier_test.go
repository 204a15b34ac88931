package iptables

import (
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// byFamily splits a command log into the IPv4 and IPv6 sequences (the
// families run concurrently) and counts the rest (nft table deletions).
func byFamily(log []string) (v4, v6 []string, other int) {
	for _, c := range log {
		switch {
		case strings.HasPrefix(c, "iptables"):
			v4 = append(v4, c)
		case strings.HasPrefix(c, "ip6tables"):
			v6 = append(v6, c)
		default:
			other++
		}
	}
	return
}

// wantLog checks both families ran exactly the given steps in order.
func wantLog(t *testing.T, log []string, b Backend, steps []string, other int) {
	t.Helper()
	v4, v6, n := byFamily(log)
	var w4, w6 []string
	for _, s := range steps {
		w4 = append(w4, "iptables-"+string(b)+"-"+s)
		w6 = append(w6, "ip6tables-"+string(b)+"-"+s)
	}
	if !reflect.DeepEqual(v4, w4) || !reflect.DeepEqual(v6, w6) || n != other {
		t.Fatalf("ran %v; want per family %v and %d other commands", log, steps, other)
	}
}

func fakeApplier(b Backend) (*Applier, *fakeHost) {
	h := newFakeHost(b)
	return NewApplier(nil, b, WithExecutor(h), WithRouter(h), WithTableOwner(h)), h
}

func TestApplierFlowWithFake(t *testing.T) {
	a, h := fakeApplier(BackendNFT)
	const pod = "/run/netns/pod"
	if err := a.Apply(pod, ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	// One call creates the missing tables of both families, marked ours.
	wantLog(t, h.takeLog(), BackendNFT, []string{"save", "restore"}, 1)
	if d, err := a.Verify(pod, ruleset.PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify after apply: %v\n%s", err, d)
	}
	h.takeLog()
	// Converged: a second apply only reads.
	if err := a.Apply(pod, ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	wantLog(t, h.takeLog(), BackendNFT, []string{"save"}, 0)
	// Verify against other options names the difference.
	d, err := a.Verify(pod, ruleset.PodConfig{DNSCapture: true})
	if err != nil || d.Empty() || !strings.Contains(d.String(), "ipv4 raw: missing chain ISTIO_PRERT") {
		t.Fatalf("verify with DNS: %v\n%s", err, d)
	}
	// Lost routing is drift too.
	h.ns[pod].rule[ruleset.IPv6] = false
	d, _ = a.Verify(pod, ruleset.PodConfig{})
	if !strings.Contains(d.String(), "ipv6: missing ip rule") {
		t.Fatalf("routing drift not reported:\n%s", d)
	}

	h.takeLog()
	if err := a.Remove(pod); err != nil {
		t.Fatal(err)
	}
	// The tables (mangle, nat) of each family were created by the apply
	// and are deleted once empty.
	wantLog(t, h.takeLog(), BackendNFT, []string{"save", "restore"}, 2)
	n := h.ns[pod]
	for _, f := range ruleset.Families {
		if len(n.saves[f].Tables) != 0 || n.rule[f] || n.route[f] {
			t.Fatalf("%s not restored: rule=%v route=%v\n%s", f, n.rule[f], n.route[f], n.saves[f])
		}
	}
	// Removing again is a read-only no-op.
	if err := a.Remove(pod); err != nil {
		t.Fatal(err)
	}
	wantLog(t, h.takeLog(), BackendNFT, []string{"save"}, 0)
}

func TestApplierLegacyKeepsTables(t *testing.T) {
	a, h := fakeApplier(BackendLegacy)
	if err := a.Apply("p", ruleset.PodConfig{DNSCapture: true}); err != nil {
		t.Fatal(err)
	}
	h.takeLog()
	if err := a.Remove("p"); err != nil {
		t.Fatal(err)
	}
	for _, c := range h.takeLog() {
		if c == "nft" {
			t.Fatal("legacy backend ran nft")
		}
	}
}

func TestApplierIPv6Disabled(t *testing.T) {
	a, h := fakeApplier(BackendNFT)
	h.get("p").noIPv6 = true
	if err := a.Apply("p", ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	n := h.ns["p"]
	if len(n.saves[ruleset.IPv6].Tables) != 0 || n.rule[ruleset.IPv6] {
		t.Fatal("IPv6 programmed in a namespace without IPv6")
	}
	if d, err := a.Verify("p", ruleset.PodConfig{}); err != nil || !d.Empty() {
		t.Fatalf("verify: %v %s", err, d)
	}
	// Leftovers from when IPv6 was on are removed by the next apply.
	n.noIPv6 = false
	if err := a.Apply("p", ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	n.noIPv6 = true
	if d, _ := a.Verify("p", ruleset.PodConfig{}); !strings.Contains(d.String(), "ipv6 nat: extra chain ISTIO_OUTPUT") {
		t.Fatalf("leftovers not reported:\n%s", d)
	}
	if err := a.Apply("p", ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	if d, _ := a.Verify("p", ruleset.PodConfig{}); !d.Empty() {
		t.Fatalf("leftovers not removed:\n%s", d)
	}
}

func TestApplierErrors(t *testing.T) {
	a, h := fakeApplier(BackendNFT)
	h.failOn = "iptables-nft-restore"
	err := a.Apply("/run/netns/x", ruleset.PodConfig{})
	if err == nil || !strings.Contains(err.Error(), "apply ipv4 rules in netns /run/netns/x") || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("restore failure: %v", err)
	}
	h.failOn = "iptables-nft-save"
	if _, err := a.Verify("/run/netns/x", ruleset.PodConfig{}); err == nil {
		t.Fatal("save failure not reported by Verify")
	}
	if err := a.Remove("/run/netns/x"); err == nil {
		t.Fatal("save failure not reported by Remove")
	}
	if err := a.Apply("p", ruleset.PodConfig{ProbeSNATv4: PodRules(ruleset.PodConfig{}, ruleset.IPv6).Routing.Local.Addr()}); err == nil {
		t.Fatal("invalid config accepted")
	}
}

// TestApplierConcurrentSamePod: callers racing to converge one pod (CNI
// ADD and the informer, say) never duplicate a jump.
func TestApplierConcurrentSamePod(t *testing.T) {
	a, h := fakeApplier(BackendNFT)
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := 0; i < 40; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cfg := ruleset.PodConfig{DNSCapture: i%2 == 0}
			if i == 39 {
				cfg = ruleset.PodConfig{}
			}
			errs <- a.Apply("p", cfg)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range ruleset.Families {
		s := h.ns["p"].saves[f]
		for _, tbl := range s.Tables {
			for _, c := range tbl.Chains {
				seen := map[string]bool{}
				for _, r := range c.Rules {
					if isOurChain(r.Target()) && seen[r.Spec()] {
						t.Fatalf("%s %s %s: duplicate %q\n%s", f, tbl.Name, c.Name, r.Spec(), s)
					}
					seen[r.Spec()] = true
				}
			}
		}
	}
}
