package iptables

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

func readFixture(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "saves", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestParseSaveFixture(t *testing.T) {
	s, err := ParseSave(readFixture(t, "others-and-ours.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Tables) != 3 || s.Table("nat") == nil || s.Table("raw") != nil {
		t.Fatalf("tables: %v", s.String())
	}
	nat := s.Table("nat")
	if c := nat.Chain("CNI-HOSTPORT-DNAT"); c == nil || len(c.Rules) != 1 {
		t.Fatalf("CNI-HOSTPORT-DNAT: %+v", c)
	} else {
		r := c.Rules[0]
		want := []string{"-p", "tcp", "-m", "comment", "--comment", `dnat name: "cbr0" id: "abc"`, "-m", "tcp", "--dport", "8443", "-j", "DNAT", "--to-destination", "10.1.0.5:443"}
		if !reflect.DeepEqual(r.Args, want) {
			t.Errorf("quoted args: %q", r.Args)
		}
		if r.Target() != "DNAT" {
			t.Errorf("target %q", r.Target())
		}
	}
	if p := s.Table("filter").Chain("FORWARD").Policy; p != "DROP" {
		t.Errorf("FORWARD policy %q", p)
	}
	// A comment mentioning our chain is not a reference to it.
	if tg := s.Table("filter").Chain("INPUT").Rules[0].Target(); tg != "ACCEPT" {
		t.Errorf("comment confused the target: %q", tg)
	}
	// The fixture holds exactly the default rule set next to others' rules.
	if d := PodRules(ruleset.PodConfig{}, ruleset.IPv4).Diff(s); !d.Empty() {
		t.Errorf("drift on fixture:\n%s", d)
	}
	// Round trip through String.
	again, err := ParseSave(s.String())
	if err != nil || again.String() != s.String() {
		t.Fatalf("round trip: %v\n%s", err, again.String())
	}
}

func TestParseSaveCounters(t *testing.T) {
	s, err := ParseSave(readFixture(t, "counters-legacy.txt"))
	if err != nil {
		t.Fatal(err)
	}
	out := s.Table("nat").Chain("OUTPUT")
	if len(out.Rules) != 3 || out.Rules[2].Spec() != "-p tcp -j ISTIO_OUTPUT" {
		t.Fatalf("OUTPUT rules: %v", out.Rules)
	}
}

func TestParseSaveHostile(t *testing.T) {
	long := strings.Repeat("x", maxSaveLine+10)
	cases := map[string]string{
		"rule outside table":    "-A OUTPUT -j ACCEPT\n",
		"chain outside table":   ":OUTPUT ACCEPT [0:0]\n",
		"commit outside table":  "COMMIT\n",
		"nested tables":         "*nat\n*mangle\nCOMMIT\nCOMMIT\n",
		"uncommitted":           "*nat\n:OUTPUT ACCEPT [0:0]\n",
		"duplicate table":       "*nat\nCOMMIT\n*nat\nCOMMIT\n",
		"duplicate chain":       "*nat\n:A - [0:0]\n:A - [0:0]\nCOMMIT\n",
		"undeclared chain":      "*nat\n-A OUTPUT -j X\nCOMMIT\n",
		"not -A":                "*nat\n:OUTPUT ACCEPT [0:0]\n-I OUTPUT -j X\nCOMMIT\n",
		"bare -A":               "*nat\n-A\nCOMMIT\n",
		"unterminated quote":    "*nat\n:A - [0:0]\n-A A -m comment --comment \"oops\nCOMMIT\n",
		"dangling backslash":    "*nat\n:A - [0:0]\n-A A -m comment --comment \"oops\\\nCOMMIT\n",
		"NUL byte":              "*nat\x00\nCOMMIT\n",
		"empty table name":      "*\nCOMMIT\n",
		"quote in table name":   "*na\"t\nCOMMIT\n",
		"long chain name":       "*nat\n:" + strings.Repeat("A", 65) + " - [0:0]\nCOMMIT\n",
		"bad chain decl":        "*nat\n:A\nCOMMIT\n",
		"too many decl fields":  "*nat\n:A - [0:0] extra\nCOMMIT\n",
		"bad counters":          "*nat\n:A - [x:0]\nCOMMIT\n",
		"overlong line":         "*nat\n:A - [0:0]\n-A A " + long + "\nCOMMIT\n",
		"garbage":               "\x01\x02\x03 hello\n",
		"control char in chain": "*nat\n:A\x07 - [0:0]\nCOMMIT\n",
		"bad policy":            "*nat\n:OUTPUT MAYBE [0:0]\nCOMMIT\n",
		"our chain as built-in": "*nat\n:ISTIO_OUTPUT ACCEPT [0:0]\nCOMMIT\n",
	}
	for name, in := range cases {
		if s, err := ParseSave(in); err == nil {
			t.Errorf("%s: accepted:\n%s", name, s.String())
		}
	}
	if _, err := ParseSave(strings.Repeat("#", maxSaveBytes+1)); err == nil {
		t.Error("oversized input accepted")
	}
	// Empty and comment-only dumps are valid: a fresh namespace.
	for _, in := range []string{"", "# nothing\n", "\n\n"} {
		if s, err := ParseSave(in); err != nil || len(s.Tables) != 0 {
			t.Errorf("%q: %v %v", in, s, err)
		}
	}
}

func TestSplitJoinArgs(t *testing.T) {
	for in, want := range map[string][]string{
		`-A X -j Y`:                  {"-A", "X", "-j", "Y"},
		`  -A   X	-j Y  `:            {"-A", "X", "-j", "Y"},
		`--comment "a b" -j Y`:       {"--comment", "a b", "-j", "Y"},
		`--comment "a \"q\" \\ b"`:   {"--comment", `a "q" \ b`},
		`--comment ""`:               {"--comment", ""},
		`--log-prefix "x"y -j LOG`:   {"--log-prefix", "xy", "-j", "LOG"},
		`--comment "-j ISTIO_PRERT"`: {"--comment", "-j ISTIO_PRERT"},
	} {
		got, err := splitArgs(in)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("splitArgs(%q) = %q, %v; want %q", in, got, err, want)
			continue
		}
		again, err := splitArgs(joinArgs(got))
		if err != nil || !reflect.DeepEqual(again, got) {
			t.Errorf("join/split round trip of %q: %q %v", in, again, err)
		}
	}
}

// FuzzParseSave: arbitrary input never panics; whatever parses survives a
// round trip, and planning against it converges: applying the plan (in the
// restore model) leaves no drift, a second plan is empty, and removal
// leaves nothing of ours behind.
func FuzzParseSave(f *testing.F) {
	seeds, _ := filepath.Glob(filepath.Join("testdata", "seeds", "FuzzParseSave", "*"))
	for _, p := range seeds {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(string(b))
	}
	cfgs := []ruleset.PodConfig{{}, {DNSCapture: true}, {BypassInbound: true}}
	f.Fuzz(func(t *testing.T, in string) {
		s, err := ParseSave(in)
		if err != nil {
			return
		}
		text := s.String()
		again, err := ParseSave(text)
		if err != nil || again.String() != text {
			t.Fatalf("round trip failed: %v\n%s\n---\n%s", err, text, again)
		}
		for _, cfg := range cfgs {
			rs := PodRules(cfg, ruleset.IPv4)
			plan := PlanApply(rs, s)
			applied, err := simulateRestore(s, plan)
			if err != nil {
				t.Fatalf("plan rejected: %v\nstate:\n%s\nplan:\n%s", err, text, plan)
			}
			if d := rs.Diff(applied); !d.Empty() {
				t.Fatalf("drift after plan:\n%s\nstate:\n%s\nplan:\n%s", d, text, plan)
			}
			if p2 := PlanApply(rs, applied); p2 != "" {
				t.Fatalf("second plan not empty:\n%s", p2)
			}
			rm := PlanRemove(applied)
			removed, err := simulateRestore(applied, rm)
			if err != nil {
				t.Fatalf("removal rejected: %v\nplan:\n%s", err, rm)
			}
			if d := (RuleSet{Family: ruleset.IPv4}).Diff(removed); !d.Empty() {
				t.Fatalf("left behind after removal:\n%s", d)
			}
		}
	})
}
