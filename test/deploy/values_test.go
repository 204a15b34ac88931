package deploy

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// schemaNode is the part of a JSON schema the coverage walk needs.
type schemaNode struct {
	Type                 any                    `json:"type"`
	Properties           map[string]*schemaNode `json:"properties"`
	AdditionalProperties any                    `json:"additionalProperties"`
	// Ref is set on Istio's keys (definitions.istio): accepted for istio-cni
	// values files, they have no default here (istio_values_test.go).
	Ref string `json:"$ref"`
	// Description starting "Removed:" marks a key kept only so stored
	// values files still install: it has no default and no effect
	// (TestRemovedPodLevelEnablement).
	Description string `json:"description"`
}

// fixed reports whether the node is an object whose keys the chart defines
// (as opposed to a free-form map such as resources or nodeSelector).
func (n *schemaNode) fixed() bool {
	return len(n.Properties) > 0 && n.AdditionalProperties == false
}

func readYAML(t testing.TB, rel string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	return m
}

func readSchema(t testing.TB) *schemaNode {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s schemaNode
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("values.schema.json: %v", err)
	}
	return &s
}

// knobs walks the schema and returns the path of every setting: a
// property whose value is a scalar, a list or a free-form map.
func knobs(n *schemaNode, prefix string) []string {
	var out []string
	for name, p := range n.Properties {
		path := strings.TrimPrefix(prefix+"."+name, ".")
		if p.Ref != "" || strings.HasPrefix(p.Description, "Removed:") {
			continue
		}
		if p.fixed() {
			out = append(out, knobs(p, path)...)
			continue
		}
		out = append(out, path)
	}
	slices.Sort(out)
	return out
}

func lookup(m map[string]any, path string) (any, bool) {
	var cur any = m
	for key := range strings.SplitSeq(path, ".") {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = mm[key]; !ok {
			return nil, false
		}
	}
	return cur, true
}

// Every knob the schema defines has a default in values.yaml, and the
// all-values file sets each to something else: a new value cannot be added
// without being proven to render (TestAllValuesReachTheDaemonSet).
func TestAllValuesCoverEveryKnob(t *testing.T) {
	schema := readSchema(t)
	if !schema.fixed() {
		t.Fatal("values.schema.json must refuse unknown top-level keys (additionalProperties: false)")
	}
	defaults := readYAML(t, filepath.Join(chartDir, "values.yaml"))
	all := readYAML(t, allValues)
	ks := knobs(schema, "")
	if len(ks) < 40 {
		t.Fatalf("only %d knobs found in the schema: %v", len(ks), ks)
	}
	for _, k := range ks {
		def, ok := lookup(defaults, k)
		if !ok {
			t.Errorf("%s: in values.schema.json but not in values.yaml", k)
			continue
		}
		v, ok := lookup(all, k)
		if !ok {
			t.Errorf("%s: not set in %s", k, allValues)
			continue
		}
		if reflect.DeepEqual(def, v) {
			t.Errorf("%s: %s sets it to its default %v", k, allValues, v)
		}
	}
}

// leaves returns every string and number in a value tree, as text.
func leaves(v any) []string {
	switch x := v.(type) {
	case map[string]any:
		var out []string
		for _, e := range x {
			out = append(out, leaves(e)...)
		}
		return out
	case []any:
		var out []string
		for _, e := range x {
			out = append(out, leaves(e)...)
		}
		return out
	case string:
		return []string{x}
	case float64:
		b, _ := json.Marshal(x)
		return []string{string(b)}
	}
	return nil // booleans: checked through the parsed configuration
}

// Every string and number of the all-values file shows up in the rendered
// objects: no value is silently ignored.
func TestAllValuesReachTheOutput(t *testing.T) {
	out := string(render(t, "all", "all-values-ns", "-f", allValues))
	for _, l := range leaves(readYAML(t, allValues)) {
		if !strings.Contains(out, l) {
			t.Errorf("%q from %s does not appear in the rendered manifest", l, allValues)
		}
	}
}

// TestRemovedPodLevelEnablement: agent.assumePodLevelEnablement changed
// nothing once the plugin stopped reading it; a values file that turns it
// on is refused with what to set instead, and one that keeps it off (the
// old default, as a stored release's values hold it) still installs.
func TestRemovedPodLevelEnablement(t *testing.T) {
	if _, msg := renderValues(t, "agent:\n  assumePodLevelEnablement: true\n"); !strings.Contains(msg, "agent.assumePodLevelEnablement was removed") ||
		!strings.Contains(msg, "cni.agentUnreachable=fail-closed") {
		t.Errorf("assumePodLevelEnablement true: %q, want the removal and what to set instead", msg)
	}
	out, msg := renderValues(t, "agent:\n  assumePodLevelEnablement: false\n")
	if msg != "" {
		t.Fatalf("assumePodLevelEnablement false: %s", msg)
	}
	if bytes.Contains(out, []byte("POD_LEVEL")) {
		t.Error("the removed setting still reaches the agent's environment")
	}
}
