package enablement

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

func mustParse(t *testing.T, s string) *Selectors {
	t.Helper()
	sel, err := ParseSelectors([]byte(s))
	if err != nil {
		t.Fatalf("parse %q: %v", s, err)
	}
	return sel
}

func TestParseSelectorsErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", "empty"},
		{"  \n", "empty"},
		{"podSelector: {}", "want a YAML list"},
		{"- podSelector:\n    matchExpression: [{key: a, operator: Exists}]", "unknown field"},
		{"- podSelector: {}\n  nsSelector: {}", "unknown field"},
		{"- podSelector:\n    matchExpressions: [{key: a, operator: Equals, values: [b]}]", "selector 1: podSelector"},
		{"- {}\n- namespaceSelector:\n    matchLabels: {\"bad key!\": x}", "selector 2: namespaceSelector"},
		{"- podSelector:\n    matchExpressions: [{key: a, operator: Exists, values: [x]}]", "selector 1: podSelector"},
		{"- podSelector:\n    matchExpressions: [{key: a, operator: In}]", "selector 1: podSelector"},
		{strings.Repeat("#", maxSelectorBytes+1), "more than"},
	} {
		if _, err := ParseSelectors([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseSelectors(%.40q) = %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

// The default list spelt as Istio's chart spells it is the default, with
// the default's reasons.
func TestParseIstioDefault(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "seeds", "FuzzParseSelectors", "istio-default.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := ParseSelectors(b)
	if err != nil {
		t.Fatal(err)
	}
	if !s.builtin {
		t.Fatal("Istio's chart default is not recognised as the default list")
	}
	p := Policy{Selectors: s}
	if d := p.Decide(pod("shop"), namespace("shop", true)); d != (Decision{Enroll: true, Reason: ReasonNamespaceLabel, Selector: 2}) {
		t.Errorf("decision %+v", d)
	}
}

func TestSelectorsDecide(t *testing.T) {
	mesh := mustParse(t, `
- namespaceSelector:
    matchLabels: {mesh: "yes"}
- podSelector:
    matchExpressions:
    - {key: team, operator: In, values: [a, b]}
`)
	labelled := func(name string, kv ...string) map[string]string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	cases := []struct {
		name     string
		sel      *Selectors
		pod, ns  map[string]string
		want     Decision
		mayNS    bool
		podLevel bool
	}{
		{"mesh namespace", mesh, nil, labelled("", "mesh", "yes"), Decision{true, ReasonNamespaceSelector, 1}, true, false},
		// The opt-out label means nothing unless the list says so, as in Istio.
		{"none label in a mesh namespace", mesh, labelled("", ambient.DataplaneModeLabel, "none"), labelled("", "mesh", "yes"), Decision{true, ReasonNamespaceSelector, 1}, true, false},
		{"default label does not enable", mesh, nil, labelled("", ambient.DataplaneModeLabel, "ambient"), Decision{false, ReasonNotSelected, 0}, false, false},
		{"pod label does not enable", mesh, labelled("", ambient.DataplaneModeLabel, "ambient"), nil, Decision{false, ReasonNotSelected, 0}, false, false},
		{"team pod anywhere", mesh, labelled("", "team", "b"), nil, Decision{true, ReasonPodSelector, 2}, false, true},
		{"other team", mesh, labelled("", "team", "c"), nil, Decision{false, ReasonNotSelected, 0}, false, false},
		{"empty list enables nothing", mustParse(t, "[]"), nil, labelled("", "mesh", "yes"), Decision{false, ReasonNotSelected, 0}, false, false},
		{"empty entry enables every pod", mustParse(t, "- {}"), nil, nil, Decision{true, ReasonNamespaceSelector, 1}, true, false},
		{"opt-out entry", mustParse(t, `
- namespaceSelector: {matchLabels: {mesh: "yes"}}
  podSelector: {matchExpressions: [{key: mesh, operator: NotIn, values: ["no"]}]}`),
			labelled("", "mesh", "no"), labelled("", "mesh", "yes"), Decision{false, ReasonPodNotSelected, 0}, true, false},
		{"every namespace, unlabelled pods", mustParse(t, `[{podSelector: {matchExpressions: [{key: x, operator: DoesNotExist}]}}]`),
			nil, nil, Decision{true, ReasonNamespaceSelector, 1}, true, false},
		{"default: pod label", nil, labelled("", ambient.DataplaneModeLabel, "ambient"), nil, Decision{true, ReasonPodLabel, 1}, false, true},
		{"default: namespace", nil, nil, labelled("", ambient.DataplaneModeLabel, "ambient"), Decision{true, ReasonNamespaceLabel, 2}, true, false},
		{"default: opt-out", nil, labelled("", ambient.DataplaneModeLabel, "none"), labelled("", ambient.DataplaneModeLabel, "ambient"), Decision{false, ReasonPodOptOut, 0}, true, false},
		{"default: nothing", nil, nil, nil, Decision{false, ReasonNotEnabled, 0}, false, false},
	}
	for _, tc := range cases {
		if got := tc.sel.decide(tc.pod, tc.ns); got != tc.want {
			t.Errorf("%s: decide = %+v, want %+v", tc.name, got, tc.want)
		}
		if got := tc.sel.MayEnableNamespace(tc.ns); got != tc.mayNS {
			t.Errorf("%s: MayEnableNamespace = %v, want %v", tc.name, got, tc.mayNS)
		}
		if got := tc.sel.PodLevel(tc.pod); got != tc.podLevel {
			t.Errorf("%s: PodLevel = %v, want %v", tc.name, got, tc.podLevel)
		}
	}
}

// Exclusions come before the selectors, whatever they select.
func TestSelectorsAfterExclusions(t *testing.T) {
	p := DefaultPolicy()
	p.Selectors = mustParse(t, "- {}")
	for name, want := range map[string]Reason{"kube-system": ReasonExcludedNamespace, "shop": ReasonNamespaceSelector} {
		if d := p.Decide(pod(name), namespace(name, false)); d.Reason != want {
			t.Errorf("%s: %+v, want %s", name, d, want)
		}
	}
	if d := p.Decide(pod("shop", hostNet), nil); d.Enroll || d.Reason != ReasonHostNetwork {
		t.Errorf("hostNetwork pod: %+v", d)
	}
	if d := p.Decide(pod("shop", withAnn(ambient.SidecarStatusAnnotation, "{}")), nil); d.Enroll {
		t.Errorf("sidecar pod: %+v", d)
	}
	if p.MayEnableNamespace(namespace("kube-system", false)) || !p.MayEnableNamespace(namespace("shop", false)) {
		t.Error("MayEnableNamespace ignores the excluded namespaces")
	}
}

func TestNamespaceChangeMatters(t *testing.T) {
	mesh := mustParse(t, `[{namespaceSelector: {matchExpressions: [{key: mesh, operator: Exists}]}}]`)
	for _, tc := range []struct {
		sel      *Selectors
		old, new map[string]string
		want     bool
	}{
		{nil, map[string]string{"a": "1"}, map[string]string{"a": "2"}, false},
		{nil, nil, map[string]string{ambient.DataplaneModeLabel: "ambient"}, true},
		{mesh, nil, map[string]string{"mesh": ""}, true},
		{mesh, map[string]string{"mesh": "x"}, map[string]string{"mesh": "x", "b": "c"}, false},
		{mesh, map[string]string{ambient.DataplaneModeLabel: "ambient"}, nil, false},
	} {
		if got := tc.sel.NamespaceChangeMatters(tc.old, tc.new); got != tc.want {
			t.Errorf("%v -> %v: %v, want %v", tc.old, tc.new, got, tc.want)
		}
	}
}

func FuzzParseSelectors(f *testing.F) {
	fuzzseed.Add(f, "FuzzParseSelectors")
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseSelectors(b)
		if err != nil {
			if s != nil {
				t.Fatal("selectors returned with an error")
			}
			return
		}
		// Whatever was accepted evaluates without panicking.
		s.decide(map[string]string{"a": "b"}, nil)
		s.MayEnableNamespace(map[string]string{ambient.DataplaneModeLabel: "ambient"})
		s.PodLevel(nil)
	})
}

// TestNamespaceLabelKeys: the keys are those the namespace selectors
// read, never a pod selector's, and a namespace's labels cut down to them
// decide every pod, the namespace's enablement and whether a change
// matters exactly as the full labels do, whatever else the namespace
// carries.
func TestNamespaceLabelKeys(t *testing.T) {
	custom := mustParse(t, `
- podSelector:
    matchLabels: {app: web}
  namespaceSelector:
    matchExpressions:
    - {key: kubernetes.io/metadata.name, operator: In, values: [shop, bank]}
    - {key: tier, operator: NotIn, values: [legacy]}
- podSelector: {}
  namespaceSelector:
    matchExpressions:
    - {key: mesh, operator: Exists}
    - {key: quarantine, operator: DoesNotExist}
- podSelector:
    matchLabels: {pod-only: "yes"}
  namespaceSelector: {}
`)
	for _, tc := range []struct {
		name string
		sel  *Selectors
		want []string
	}{
		{"default", nil, []string{ambient.DataplaneModeLabel}},
		{"custom", custom, []string{"kubernetes.io/metadata.name", "mesh", "quarantine", "tier"}},
		{"empty list", mustCompile(nil), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := tc.sel.NamespaceLabelKeys()
			if !slices.Equal(keys, tc.want) {
				t.Fatalf("keys %q, want %q", keys, tc.want)
			}
			if len(keys) > 0 {
				keys[0] = "mutated"
			}
			if slices.Contains(tc.sel.NamespaceLabelKeys(), "mutated") {
				t.Fatal("the caller's slice aliases the selectors' keys")
			}
			values := []string{"", "ambient", "none", "shop", "bank", "legacy", "x"}
			project := func(m map[string]string) map[string]string {
				out := map[string]string{}
				for _, k := range tc.sel.NamespaceLabelKeys() {
					if v, ok := m[k]; ok {
						out[k] = v
					}
				}
				return out
			}
			// Every namespace labelled with a subset of the interesting
			// keys (each with each value), plus many labels no selector
			// reads.
			interesting := append(tc.sel.NamespaceLabelKeys(), ambient.DataplaneModeLabel, "other")
			var nsSets []map[string]string
			for mask := range 1 << len(interesting) {
				for vi := range values {
					m := map[string]string{}
					for i, k := range interesting {
						if mask&(1<<i) != 0 {
							m[k] = values[(vi+i)%len(values)]
						}
					}
					for i := range 300 {
						m[fmt.Sprintf("noise.example.com/k%d", i)] = "v"
					}
					nsSets = append(nsSets, m)
				}
			}
			pods := []map[string]string{nil, {"app": "web"}, {"pod-only": "yes"}, {ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}, {ambient.DataplaneModeLabel: ambient.DataplaneModeNone}}
			for i, full := range nsSets {
				cut := project(full)
				if a, b := tc.sel.MayEnableNamespace(cut), tc.sel.MayEnableNamespace(full); a != b {
					t.Fatalf("namespace %d: MayEnableNamespace %v cut, %v full", i, a, b)
				}
				for _, pl := range pods {
					if a, b := tc.sel.decide(pl, cut), tc.sel.decide(pl, full); a != b {
						t.Fatalf("namespace %d, pod %v: %+v cut, %+v full", i, pl, a, b)
					}
				}
				prev := nsSets[(i+7)%len(nsSets)]
				if a, b := tc.sel.NamespaceChangeMatters(project(prev), cut), tc.sel.NamespaceChangeMatters(prev, full); a != b {
					t.Fatalf("namespace %d: change matters %v cut, %v full", i, a, b)
				}
			}
		})
	}
}
