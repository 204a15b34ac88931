package installer

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

var update = flag.Bool("update", false, "rewrite golden files under testdata/chain")

const testType = "ambient-cni"

// testEntry is what the agent would pass: no "type", so ChainInto adds it.
var testEntry = json.RawMessage(`{
  "socket": "/var/run/ambient-cni/agent.sock",
  "timeout": "5s",
  "log_level": "info",
  "excluded_namespaces": ["kube-system"]
}`)

// goldenCase is one directory of testdata/chain.
type goldenCase struct {
	name   string
	inPath string
	in     []byte
}

func loadGoldenCases(t testing.TB) []goldenCase {
	t.Helper()
	dirs, err := os.ReadDir(filepath.Join("testdata", "chain"))
	if err != nil {
		t.Fatal(err)
	}
	var cases []goldenCase
	for _, d := range dirs {
		if !d.IsDir() {
			continue
		}
		ins, _ := filepath.Glob(filepath.Join("testdata", "chain", d.Name(), "in.*"))
		if len(ins) != 1 {
			t.Fatalf("%s: want exactly one in.* file, have %v", d.Name(), ins)
		}
		b, err := os.ReadFile(ins[0])
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, goldenCase{name: d.Name(), inPath: ins[0], in: b})
	}
	if len(cases) < 10 {
		t.Fatalf("only %d golden cases found", len(cases))
	}
	return cases
}

func compareGolden(t *testing.T, path string, got []byte) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read golden (run with -update to create): %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs\n--- got ---\n%s\n--- want ---\n%s", path, got, want)
	}
}

// pluginsOf returns the compacted plugin objects of a list, in order.
func pluginsOf(t testing.TB, conf []byte) [][]byte {
	t.Helper()
	var doc struct {
		Plugins []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal(conf, &doc); err != nil {
		t.Fatalf("decode plugins: %v\n%s", err, conf)
	}
	out := make([][]byte, len(doc.Plugins))
	for i, p := range doc.Plugins {
		out[i] = compact(p)
	}
	return out
}

func TestChainIntoGolden(t *testing.T) {
	for _, c := range loadGoldenCases(t) {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Dir(c.inPath)
			inName := filepath.Base(c.inPath)
			out, newName, err := ChainInto(c.in, inName, testEntry, testType)
			if err != nil {
				t.Fatalf("ChainInto: %v", err)
			}
			if newName != "in.conflist" {
				t.Errorf("new file name %q, want in.conflist", newName)
			}
			compareGolden(t, filepath.Join(dir, "want.conflist"), out)

			// The runtime loads it, and the chain ends with exactly one of us.
			list, err := libcni.NetworkConfFromBytes(out)
			if err != nil {
				t.Fatalf("libcni rejects the result: %v", err)
			}
			n := 0
			for _, p := range list.Plugins {
				if p.Network.Type == testType {
					n++
				}
			}
			if n != 1 || list.Plugins[len(list.Plugins)-1].Network.Type != testType {
				t.Fatalf("want exactly one %s entry, last; got %d", testType, n)
			}

			// Idempotent: chaining the output again changes nothing, so
			// the installer's own write does not trigger another one.
			again, _, err := ChainInto(out, newName, testEntry, testType)
			if err != nil || !bytes.Equal(again, out) {
				t.Errorf("second ChainInto not a fixpoint (err %v)\n%s", err, again)
			}

			// Round trip: Unchain gives back the primary's plugins.
			un, err := Unchain(out, testType)
			if err != nil {
				t.Fatalf("Unchain: %v", err)
			}
			if filepath.Ext(inName) == ConflistExt {
				inClean, err := Unchain(c.in, testType)
				if err != nil {
					t.Fatal(err)
				}
				// Byte for byte: our splice in and out touches nothing else.
				if !bytes.Equal(un, inClean) {
					t.Errorf("Unchain(ChainInto(x)) != Unchain(x)\n--- got ---\n%s\n--- want ---\n%s", un, inClean)
				}
				if !strings.Contains(string(c.in), `"`+testType+`"`) && !bytes.Equal(un, c.in) {
					t.Errorf("Unchain(ChainInto(x)) != x for a file without our entry")
				}
				wantPlugins := nonOurs(t, c.in)
				if got := pluginsOf(t, un); !equalPlugins(got, wantPlugins) {
					t.Errorf("plugins after round trip:\n%s\nwant\n%s", bytes.Join(got, []byte("\n")), bytes.Join(wantPlugins, []byte("\n")))
				}
			} else {
				// A converted single config: the list's only primary plugin
				// is the original object, same content and key order.
				got := pluginsOf(t, un)
				if len(got) != 1 || !bytes.Equal(got[0], compact(c.in)) {
					t.Errorf("converted plugin %s\nwant %s", got, compact(c.in))
				}
				var in, outTop struct{ Name, CNIVersion string }
				_ = json.Unmarshal(c.in, &in)
				_ = json.Unmarshal(out, &outTop)
				if in != outTop {
					t.Errorf("list name/version %+v, want the original's %+v", outTop, in)
				}
			}
		})
	}
}

// nonOurs lists the compacted plugins of conf that are not ours.
func nonOurs(t testing.TB, conf []byte) [][]byte {
	var out [][]byte
	for _, p := range pluginsOf(t, conf) {
		if typ, _ := pluginTypeOf(p); typ != testType {
			out = append(out, p)
		}
	}
	return out
}

func equalPlugins(a, b [][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

func TestChainIntoUnknownFieldsSurvive(t *testing.T) {
	in, err := os.ReadFile(filepath.Join("testdata", "chain", "unknown-fields", "in.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := ChainInto(in, "x.conflist", testEntry, testType)
	if err != nil {
		t.Fatal(err)
	}
	// Everything up to the end of the last primary plugin and everything
	// after it is the input verbatim; only our entry sits in between.
	info, err := inspectList(in, testType)
	if err != nil {
		t.Fatal(err)
	}
	cut := info.plugins.elems[len(info.plugins.elems)-1].end
	if !bytes.HasPrefix(out, in[:cut]) || !bytes.HasSuffix(out, in[cut:]) {
		t.Fatalf("bytes outside our entry changed:\n%s", out)
	}
	for _, s := range []string{`"zz-vendor-top": {"b": 2, "a": 1`, `"weird\u002dnet"`, `1.50, 1e3, -0, 12345678901234567890`, `\u00e9\u2028`, `"aaa-after-plugins"`} {
		if !strings.Contains(string(out), s) {
			t.Errorf("output lost %s", s)
		}
	}
}

func TestChainIntoEntryHandling(t *testing.T) {
	base := []byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`)
	tests := []struct {
		name    string
		entry   string
		want    string
		wantErr error
	}{
		{"type added first", `{"socket":"/s"}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"ambient-cni","socket":"/s"}]}`, nil},
		{"empty entry", ``, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"ambient-cni"}]}`, nil},
		{"empty object", `{ }`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"ambient-cni"}]}`, nil},
		{"own type kept in place", `{"a":1,"type":"ambient-cni"}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"a":1,"type":"ambient-cni"}]}`, nil},
		{"other type", `{"type":"bridge"}`, ``, ErrInvalidEntry},
		{"not an object", `["type"]`, ``, ErrInvalidEntry},
		{"malformed", `{"a":`, ``, ErrInvalidEntry},
		{"empty type overrides", `{"type":"ambient-cni","Type":""}`, ``, ErrInvalidEntry},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, _, err := ChainInto(base, "a.conflist", json.RawMessage(tt.entry), testType)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err %v, want %v", err, tt.wantErr)
			}
			if err == nil && string(out) != tt.want {
				t.Errorf("got  %s\nwant %s", out, tt.want)
			}
		})
	}
}

func TestChainIntoHostileInput(t *testing.T) {
	huge := append([]byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge","pad":"`), bytes.Repeat([]byte("x"), MaxConfigSize)...)
	huge = append(huge, `"}]}`...)
	deep := strings.Repeat("[", 5000) + strings.Repeat("]", 5000)
	tests := []struct {
		name    string
		file    string
		conf    string
		wantErr error
		wantMsg string
	}{
		{"malformed", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}`, ErrInvalidConfig, "malformed JSON"},
		{"trailing garbage", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]} x`, ErrInvalidConfig, "malformed JSON"},
		{"empty file", "a.conflist", ``, ErrInvalidConfig, "malformed JSON"},
		{"top-level array", "a.conflist", `[{"type":"bridge"}]`, ErrInvalidConfig, "top level is an array"},
		{"plugins not an array", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":{"type":"bridge"}}`, ErrInvalidConfig, "plugins"},
		{"plugins empty", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":[]}`, ErrInvalidConfig, "no plugins"},
		{"plugins missing", "a.conflist", `{"cniVersion":"1.0.0","name":"n"}`, ErrInvalidConfig, "no inline"},
		{"plugins twice", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}],"plugins":[{"type":"b"}]}`, ErrInvalidConfig, "ambiguous"},
		{"plugin not an object", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":["bridge"]}`, ErrInvalidConfig, "plugin"},
		{"plugin without type", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":[{"bridge":"cni0"}]}`, ErrInvalidConfig, "type"},
		{"no name", "a.conflist", `{"cniVersion":"1.0.0","plugins":[{"type":"bridge"}]}`, ErrInvalidConfig, "no name"},
		{"only ours", "a.conflist", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"ambient-cni"}]}`, ErrNoPrimaryPlugin, ""},
		{"old version", "a.conflist", `{"cniVersion":"0.2.0","name":"n","plugins":[{"type":"bridge"}]}`, ErrUnsupportedVersion, "0.2.0"},
		{"no version", "a.conflist", `{"name":"n","plugins":[{"type":"bridge"}]}`, ErrUnsupportedVersion, "no cniVersion"},
		{"bad version", "a.conflist", `{"cniVersion":"one","name":"n","plugins":[{"type":"bridge"}]}`, ErrInvalidConfig, "one"},
		{"huge", "a.conflist", string(huge), ErrConfigTooLarge, ""},
		{"deep nesting", "a.conflist", deep, ErrInvalidConfig, ""},
		{"conf without type", "a.conf", `{"cniVersion":"1.0.0","name":"n","bridge":"cni0"}`, ErrInvalidConfig, "missing 'type'"},
		{"conf that is ours", "a.conf", `{"cniVersion":"1.0.0","name":"n","type":"ambient-cni"}`, ErrNoPrimaryPlugin, ""},
		{"conf malformed", "a.conf", `{"type":`, ErrInvalidConfig, "malformed"},
		{"conf is a list", "a.conf", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`, ErrInvalidConfig, "missing 'type'"},
		{"conf null", "a.json", `null`, ErrInvalidConfig, "top level is null"},
		{"wrong extension", "a.yaml", `{}`, ErrInvalidConfig, "not a .conf"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := []byte(tt.conf)
			keep := bytes.Clone(in)
			out, _, err := ChainInto(in, tt.file, testEntry, testType)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err %v, want %v", err, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q does not mention %q", err, tt.wantMsg)
			}
			if out != nil {
				t.Errorf("output on error: %q", out)
			}
			if !bytes.Equal(in, keep) {
				t.Error("input buffer was modified")
			}
			if filepath.Ext(tt.file) == ConflistExt {
				if _, err := Unchain(in, testType); err == nil {
					t.Error("Unchain accepted it")
				}
			}
		})
	}
}

func TestUnchain(t *testing.T) {
	tests := []struct {
		name, in, want string
		wantErr        error
	}{
		{"absent: unchanged", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}]}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}]}`, nil},
		{"last", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}, {"type":"ambient-cni"}]}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}]}`, nil},
		{"first", `{"cniVersion":"1.0.0","name":"n","plugins":[ {"type":"ambient-cni"} ,{"type":"a"}]}`, `{"cniVersion":"1.0.0","name":"n","plugins":[ {"type":"a"}]}`, nil},
		{"middle and last", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"},{"type":"ambient-cni"},{"type":"b"},{"type":"ambient-cni"}]}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"},{"type":"b"}]}`, nil},
		{"two at the end", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"},{"type":"ambient-cni"},{"type":"ambient-cni"}]}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}]}`, nil},
		{"only ours", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"ambient-cni"},{"type":"ambient-cni"}]}`, ``, ErrNoPrimaryPlugin},
		{"a type string elsewhere is not an entry", `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a","ipam":{"type":"ambient-cni"}}]}`, `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a","ipam":{"type":"ambient-cni"}}]}`, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Unchain([]byte(tt.in), testType)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err %v, want %v", err, tt.wantErr)
			}
			if string(got) != tt.want {
				t.Errorf("got  %s\nwant %s", got, tt.want)
			}
		})
	}
}
