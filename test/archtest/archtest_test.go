// Package archtest checks the import rules of the architecture: which
// project packages may import which.
package archtest

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/ambient-cni/ambient-cni/"

// root is the repository's top, two levels above this package.
func root(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// imports lists the project packages pkg (a path relative to the module)
// imports from its non-test files, directly.
func imports(t *testing.T, top, pkg string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(top, pkg, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		af, err := parser.ParseFile(token.NewFileSet(), f, src, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, is := range af.Imports {
			p, err := strconv.Unquote(is.Path.Value)
			if err != nil {
				t.Fatal(err)
			}
			if rel, ok := strings.CutPrefix(p, module); ok && !slices.Contains(out, rel) {
				out = append(out, rel)
			}
		}
	}
	return out
}

// deps lists every project package pkg depends on, transitively, with
// the chain that leads to each.
func deps(t *testing.T, top, pkg string) map[string][]string {
	t.Helper()
	via := map[string][]string{}
	queue := [][]string{{pkg}}
	for len(queue) > 0 {
		chain := queue[0]
		queue = queue[1:]
		for _, d := range imports(t, top, chain[len(chain)-1]) {
			if _, seen := via[d]; seen || d == pkg {
				continue
			}
			next := append(slices.Clone(chain), d)
			via[d] = next
			queue = append(queue, next)
		}
	}
	return via
}

// TestBackendsAreSiblings: the two rules backends never import each other,
// directly or through another project package; only pkg/rulesbackend knows
// both.
func TestBackendsAreSiblings(t *testing.T) {
	top := root(t)
	pairs := [][2]string{{"pkg/iptables", "pkg/nftables"}, {"pkg/nftables", "pkg/iptables"}}
	for _, p := range pairs {
		if chain, ok := deps(t, top, p[0])[p[1]]; ok {
			t.Errorf("%s imports %s: %s", p[0], p[1], strings.Join(chain, " -> "))
		}
	}
	// The check must see real imports, or it proves nothing.
	if _, ok := deps(t, top, "pkg/rulesbackend")["pkg/nftables"]; !ok {
		t.Error("pkg/rulesbackend does not seem to import pkg/nftables: the import scan is broken")
	}
}
