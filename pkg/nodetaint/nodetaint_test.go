package nodetaint

import (
	"encoding/json"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

var other = corev1.Taint{Key: "example.com/dedicated", Value: "mesh", Effect: corev1.TaintEffectNoSchedule}

func decodeOps(t *testing.T, b []byte) []map[string]any {
	t.Helper()
	var ops []map[string]any
	if err := json.Unmarshal(b, &ops); err != nil {
		t.Fatalf("patch %s: %v", b, err)
	}
	return ops
}

func asJSON(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// Removal tests the whole list as read, then removes only the startup
// taint (every copy, from the end so indexes stay right); another effect
// under the same key is someone else's.
func TestRemovePatch(t *testing.T) {
	noExecute := corev1.Taint{Key: Key, Effect: corev1.TaintEffectNoExecute}
	withValue := corev1.Taint{Key: Key, Value: "x", Effect: Effect}
	for name, tc := range map[string]struct {
		taints  []corev1.Taint
		removes []string // paths, in patch order
	}{
		"none":           {nil, nil},
		"others only":    {[]corev1.Taint{other, noExecute}, nil},
		"alone":          {[]corev1.Taint{Taint}, []string{"/spec/taints/0"}},
		"among others":   {[]corev1.Taint{other, Taint, noExecute}, []string{"/spec/taints/1"}},
		"twice, a value": {[]corev1.Taint{Taint, other, withValue}, []string{"/spec/taints/2", "/spec/taints/0"}},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := RemovePatch(tc.taints)
			if err != nil {
				t.Fatal(err)
			}
			if tc.removes == nil {
				if b != nil {
					t.Fatalf("patch %s for taints without ours", b)
				}
				return
			}
			ops := decodeOps(t, b)
			if ops[0]["op"] != "test" || ops[0]["path"] != "/spec/taints" || !reflect.DeepEqual(ops[0]["value"], asJSON(t, tc.taints)) {
				t.Errorf("first op %v, want a test of the taints as read", ops[0])
			}
			var removes []string
			for _, o := range ops[1:] {
				if o["op"] != "remove" {
					t.Errorf("op %v, want remove", o)
				}
				removes = append(removes, o["path"].(string))
			}
			if !reflect.DeepEqual(removes, tc.removes) {
				t.Errorf("removes %v, want %v", removes, tc.removes)
			}
		})
	}
}

// Adding appends after a test of the list, or, on a node without taints,
// after a test of the resourceVersion read; nothing when it is there.
func TestAddPatch(t *testing.T) {
	if b, err := AddPatch([]corev1.Taint{other, Taint}, "7"); err != nil || b != nil {
		t.Errorf("AddPatch with the taint present = %s, %v; want nothing", b, err)
	}
	ops := decodeOps(t, must(AddPatch([]corev1.Taint{other}, "7")))
	want := []map[string]any{
		{"op": "test", "path": "/spec/taints", "value": asJSON(t, []corev1.Taint{other})},
		{"op": "add", "path": "/spec/taints/-", "value": asJSON(t, Taint)},
	}
	if !reflect.DeepEqual(ops, want) {
		t.Errorf("AddPatch among others = %v, want %v", ops, want)
	}
	ops = decodeOps(t, must(AddPatch(nil, "7")))
	want = []map[string]any{
		{"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
		{"op": "add", "path": "/spec/taints", "value": asJSON(t, []corev1.Taint{Taint})},
	}
	if !reflect.DeepEqual(ops, want) {
		t.Errorf("AddPatch on a node without taints = %v, want %v", ops, want)
	}
	if _, err := AddPatch(nil, ""); err == nil {
		t.Error("AddPatch without taints and resourceVersion: want an error")
	}
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}
