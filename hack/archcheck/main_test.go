package main

import (
	"strings"
	"testing"
)

const table = `intro

| package | holds | may import |
|---|---|---|
| ` + "`cmd/...`" + ` | mains | anything |
| ` + "`pkg/a`" + ` | a | — |
| ` + "`pkg/b`" + ` | b | ` + "`pkg/a`" + ` |
| ` + "`pkg/c/...`" + ` | c | ` + "`pkg/b`, `pkg/a`" + ` |

| other | table | here |
|---|---|---|
| ` + "`pkg/z`" + ` | not | read |
`

func TestParseTable(t *testing.T) {
	rules, err := parseTable(strings.NewReader(table))
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) != 4 {
		t.Fatalf("got %d rules, want 4 (the second table is not the package table): %+v", len(rules), rules)
	}
	if !rules[0].anything || len(rules[1].allowed) != 0 || rules[3].allowed[1] != "pkg/a" {
		t.Fatalf("rules parsed wrong: %+v", rules)
	}
}

func TestParseTableRejectsMalformed(t *testing.T) {
	for name, doc := range map[string]string{
		"no table":         "just prose\n",
		"bare dependency":  "| package | holds | may import |\n|---|---|---|\n| `pkg/a` | a | pkg/b |\n",
		"two packages":     "| package | holds | may import |\n|---|---|---|\n| `pkg/a` `pkg/b` | a | — |\n",
		"empty backticks":  "| package | holds | may import |\n|---|---|---|\n| `pkg/a` | a | `` |\n",
		"unquoted package": "| package | holds | may import |\n|---|---|---|\n| pkg a | a | — |\n",
	} {
		if _, err := parseTable(strings.NewReader(doc)); err == nil {
			t.Errorf("%s: parsed without error", name)
		}
	}
}

func TestCheck(t *testing.T) {
	rules, err := parseTable(strings.NewReader(table))
	if err != nil {
		t.Fatal(err)
	}
	good := map[string][]string{
		"cmd/x":     {"pkg/c/d", "pkg/a"},
		"pkg/a":     nil,
		"pkg/b":     {"pkg/a"},
		"pkg/c/d":   {"pkg/b"},
		"pkg/c":     {"pkg/a"},
		"pkg/c/d/e": nil,
	}
	if p := check(rules, good); len(p) != 0 {
		t.Fatalf("a graph that follows the table was refused: %v", p)
	}
	bad := map[string][]string{
		"pkg/a":   {"pkg/b"},
		"pkg/c/d": {"pkg/c"},
		"pkg/new": nil,
	}
	p := strings.Join(check(rules, bad), "\n")
	for _, want := range []string{
		"pkg/a imports pkg/b",
		"pkg/c/d imports pkg/c",
		"pkg/new is not in the package table",
		"the table lists pkg/b, which does not exist",
	} {
		if !strings.Contains(p, want) {
			t.Errorf("problems lack %q:\n%s", want, p)
		}
	}
}

func TestParseListing(t *testing.T) {
	g, err := parseListing("example.com/m/pkg/a fmt example.com/m/pkg/b k8s.io/api\nexample.com/m/cmd/x\n", "example.com/m")
	if err != nil {
		t.Fatal(err)
	}
	if len(g) != 2 || len(g["pkg/a"]) != 1 || g["pkg/a"][0] != "pkg/b" {
		t.Fatalf("graph = %v", g)
	}
	if _, err := parseListing("other.org/x fmt\n", "example.com/m"); err == nil {
		t.Fatal("a package outside the module was accepted")
	}
}

func TestUnusedAllowances(t *testing.T) {
	rules, err := parseTable(strings.NewReader(table))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		graph map[string][]string
		want  []string // the allowances reported, as "row allows dep"
	}{
		{
			name:  "every allowance used",
			graph: map[string][]string{"pkg/a": nil, "pkg/b": {"pkg/a"}, "pkg/c": {"pkg/a"}, "pkg/c/d": {"pkg/b"}},
		},
		{
			name:  "a subtree row's allowance used by a package below it",
			graph: map[string][]string{"pkg/b": {"pkg/a"}, "pkg/c/d/e": {"pkg/a", "pkg/b"}},
		},
		{
			name:  "nothing imported",
			graph: map[string][]string{"pkg/a": nil, "pkg/b": nil, "pkg/c": nil},
			want:  []string{"pkg/b allows pkg/a", "pkg/c/... allows pkg/b", "pkg/c/... allows pkg/a"},
		},
		{
			name:  "one of a row's two allowances unused",
			graph: map[string][]string{"pkg/b": {"pkg/a"}, "pkg/c": {"pkg/b"}},
			want:  []string{"pkg/c/... allows pkg/a"},
		},
		{
			name:  "an import by an anything row uses no allowance",
			graph: map[string][]string{"cmd/x": {"pkg/a", "pkg/b"}, "pkg/c": {"pkg/a", "pkg/b"}},
			want:  []string{"pkg/b allows pkg/a"},
		},
		{
			name:  "a disallowed import uses no allowance",
			graph: map[string][]string{"pkg/b": {"pkg/c"}, "pkg/c": {"pkg/a", "pkg/b"}},
			want:  []string{"pkg/b allows pkg/a"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := unusedAllowances(rules, tc.graph)
			if len(got) != len(tc.want) {
				t.Fatalf("got %d reports, want %d:\n%s", len(got), len(tc.want), strings.Join(got, "\n"))
			}
			for i, w := range tc.want {
				row, dep, _ := strings.Cut(w, " allows ")
				if want := "the row of " + row + " allows " + dep + ","; !strings.HasPrefix(got[i], want) {
					t.Errorf("report %d = %q, want it to start with %q", i, got[i], want)
				}
			}
		})
	}
}
