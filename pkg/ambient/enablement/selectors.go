package enablement

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// SelectorEntry is one entry of Istio's enablement selector list
// (istio-cni's ambient.enablementSelectors): a pod is enabled by the entry
// when its labels match PodSelector and its namespace's labels match
// NamespaceSelector. An empty selector matches everything.
type SelectorEntry struct {
	PodSelector       metav1.LabelSelector `json:"podSelector"`
	NamespaceSelector metav1.LabelSelector `json:"namespaceSelector"`
}

// DefaultSelectorEntries is Istio's default list: a pod labelled ambient
// anywhere, and every pod not labelled none in a namespace labelled ambient.
func DefaultSelectorEntries() []SelectorEntry {
	ambientLabel := map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
	return []SelectorEntry{
		{PodSelector: metav1.LabelSelector{MatchLabels: ambientLabel}},
		{
			PodSelector: metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
				{Key: ambient.DataplaneModeLabel, Operator: metav1.LabelSelectorOpNotIn, Values: []string{ambient.DataplaneModeNone}},
			}},
			NamespaceSelector: metav1.LabelSelector{MatchLabels: ambientLabel},
		},
	}
}

// maxSelectorBytes bounds the setting: it is an environment variable.
const maxSelectorBytes = 64 << 10

// compiledEntry is one entry ready to match.
type compiledEntry struct {
	pod, ns labels.Selector
	// anyNamespace: the namespace selector is empty, so only the pod's
	// own labels decide.
	anyNamespace bool
	// needsPodLabels: the pod selector does not match a pod without
	// labels, so a pod is enabled by this entry only by labels of its own.
	needsPodLabels bool
}

// Selectors is a compiled enablement selector list. The zero value and nil
// are Istio's default list.
type Selectors struct {
	entries []compiledEntry
	// nsKeys are the label keys any namespace selector reads.
	nsKeys []string
	// builtin: the list is Istio's default, whose reasons name its labels.
	builtin bool
	set     bool
}

var defaultSelectors = mustCompile(DefaultSelectorEntries())

func mustCompile(entries []SelectorEntry) *Selectors {
	s, err := CompileSelectors(entries)
	if err != nil {
		panic(err)
	}
	return s
}

// CompileSelectors checks and compiles a selector list. An empty list
// enables no pod, as in Istio.
func CompileSelectors(entries []SelectorEntry) (*Selectors, error) {
	s := &Selectors{set: true, builtin: reflect.DeepEqual(entries, DefaultSelectorEntries())}
	keys := map[string]bool{}
	for i, e := range entries {
		pod, err := metav1.LabelSelectorAsSelector(&e.PodSelector)
		if err != nil {
			return nil, fmt.Errorf("enablement selector %d: podSelector: %w", i+1, err)
		}
		ns, err := metav1.LabelSelectorAsSelector(&e.NamespaceSelector)
		if err != nil {
			return nil, fmt.Errorf("enablement selector %d: namespaceSelector: %w", i+1, err)
		}
		reqs, _ := ns.Requirements()
		for _, r := range reqs {
			keys[r.Key()] = true
		}
		s.entries = append(s.entries, compiledEntry{
			pod: pod, ns: ns, anyNamespace: ns.Empty(), needsPodLabels: !pod.Matches(labels.Set{}),
		})
	}
	s.nsKeys = slices.Sorted(maps.Keys(keys))
	return s, nil
}

// ParseSelectors reads the setting: a YAML (or JSON) list of entries, each
// with podSelector and namespaceSelector as Kubernetes label selectors
// (matchLabels, matchExpressions). Unlike Istio, a field it does not know
// (a misspelt matchExpressions, say) is an error, not silently an empty
// selector that matches every pod.
func ParseSelectors(b []byte) (*Selectors, error) {
	if len(b) > maxSelectorBytes {
		return nil, fmt.Errorf("enablement selectors: %d bytes, more than %d", len(b), maxSelectorBytes)
	}
	if strings.TrimSpace(string(b)) == "" {
		return nil, errors.New("enablement selectors: empty; want a list of {podSelector, namespaceSelector}")
	}
	var entries []SelectorEntry
	if err := yaml.UnmarshalStrict(b, &entries); err != nil {
		return nil, fmt.Errorf("enablement selectors: want a YAML list of {podSelector, namespaceSelector} label selectors: %w", err)
	}
	return CompileSelectors(entries)
}

func (s *Selectors) orDefault() *Selectors {
	if s == nil || !s.set {
		return defaultSelectors
	}
	return s
}

// match returns the 1-based index of the first entry matching the pod's
// and namespace's labels, or 0.
func (s *Selectors) match(podLabels, nsLabels map[string]string) int {
	for i, e := range s.orDefault().entries {
		if e.pod.Matches(labels.Set(podLabels)) && e.ns.Matches(labels.Set(nsLabels)) {
			return i + 1
		}
	}
	return 0
}

// MayEnableNamespace reports whether a pod of a namespace with these
// labels may be enabled whatever its own labels say, as far as the plugin
// (which knows no pod labels) can tell: some entry selects the namespace by
// its labels, or selects every namespace and also pods without labels.
// Entries that select every namespace but need pod labels are pod-level
// enablement (PodLevel), which the snapshot carries node-wide.
func (s *Selectors) MayEnableNamespace(nsLabels map[string]string) bool {
	for _, e := range s.orDefault().entries {
		if e.ns.Matches(labels.Set(nsLabels)) && (!e.anyNamespace || !e.needsPodLabels) {
			return true
		}
	}
	return false
}

// PodLevel reports whether a pod with these labels is enabled by an entry
// that selects every namespace by pod labels alone (Istio's default: the
// pod's own ambient label).
func (s *Selectors) PodLevel(podLabels map[string]string) bool {
	for _, e := range s.orDefault().entries {
		if e.anyNamespace && e.needsPodLabels && e.pod.Matches(labels.Set(podLabels)) {
			return true
		}
	}
	return false
}

// NamespaceLabelKeys lists, sorted, the namespace label keys the
// selectors read. A requirement of a label selector reads its own key
// only, so a namespace's labels cut down to these keys match every entry
// exactly as the full set does: a cache of namespaces may keep these and
// drop the rest.
func (s *Selectors) NamespaceLabelKeys() []string {
	return slices.Clone(s.orDefault().nsKeys)
}

// NamespaceChangeMatters reports whether a namespace's labels changed in a
// key some namespace selector reads, so decisions of its pods may change.
func (s *Selectors) NamespaceChangeMatters(old, new map[string]string) bool {
	for _, k := range s.orDefault().nsKeys {
		ov, op := old[k]
		nv, np := new[k]
		if ov != nv || op != np {
			return true
		}
	}
	return false
}
