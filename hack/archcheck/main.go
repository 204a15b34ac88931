// Command archcheck fails when the import graph of the production packages
// breaks the package table of docs/architecture.md: a package the table does
// not list, a project import its "may import" column does not allow, or an
// allowance in that column that no import of the row's packages uses (a stale
// allowance would let a later import in unseen).
//
// The table is the one source of the import rules, so the documentation and
// the build cannot drift apart. `make lint` runs it from the repository root.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
)

func main() {
	doc := flag.String("doc", "docs/architecture.md", "the architecture page holding the package table")
	flag.Parse()
	if err := run(*doc, flag.Args(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "archcheck:", err)
		os.Exit(1)
	}
}

func run(docPath string, patterns []string, out io.Writer) error {
	if len(patterns) == 0 {
		patterns = []string{"./pkg/...", "./cmd/..."}
	}
	f, err := os.Open(docPath)
	if err != nil {
		return err
	}
	rules, err := parseTable(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", docPath, err)
	}
	module, err := goOutput("list", "-m")
	if err != nil {
		return err
	}
	module = strings.TrimSpace(module)
	listing, err := goOutput(append([]string{"list", "-f", "{{.ImportPath}} {{join .Imports \" \"}}"}, patterns...)...)
	if err != nil {
		return err
	}
	graph, err := parseListing(listing, module)
	if err != nil {
		return err
	}
	problems := check(rules, graph)
	if len(problems) > 0 {
		return fmt.Errorf("the import graph breaks %s:\n  %s", docPath, strings.Join(problems, "\n  "))
	}
	fmt.Fprintf(out, "archcheck: %d packages follow %s\n", len(graph), docPath)
	return nil
}

// rule is one row of the table: a package (or a subtree, "x/...") and what
// it may import; anything means no restriction.
type rule struct {
	pkg      string
	anything bool
	allowed  []string
}

// parseTable reads the rows of the markdown table whose header's first
// column is "package" and third column "may import".
func parseTable(r io.Reader) ([]rule, error) {
	var rules []rule
	inTable := false
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if !strings.HasPrefix(line, "|") {
			inTable = false
			continue
		}
		cells := splitRow(line)
		if len(cells) < 3 {
			continue
		}
		if strings.EqualFold(cells[0], "package") && strings.EqualFold(cells[2], "may import") {
			inTable = true
			continue
		}
		if !inTable || strings.HasPrefix(cells[0], "---") {
			continue
		}
		pkg := strings.Trim(cells[0], "`")
		if pkg == "" || strings.ContainsAny(pkg, " `") {
			return nil, fmt.Errorf("table row %q: first column must be one package path in backticks", line)
		}
		ru := rule{pkg: pkg}
		switch deps := cells[2]; deps {
		case "anything":
			ru.anything = true
		case "—", "-", "":
		default:
			for _, d := range strings.Split(deps, ",") {
				d = strings.TrimSpace(d)
				if !strings.HasPrefix(d, "`") || !strings.HasSuffix(d, "`") || len(d) < 3 {
					return nil, fmt.Errorf("table row for %s: %q is not a package path in backticks", pkg, d)
				}
				ru.allowed = append(ru.allowed, strings.Trim(d, "`"))
			}
		}
		rules = append(rules, ru)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(rules) == 0 {
		return nil, fmt.Errorf("no package table (header: | package | holds | may import |)")
	}
	return rules, nil
}

func splitRow(line string) []string {
	line = strings.TrimSuffix(strings.TrimPrefix(line, "|"), "|")
	cells := strings.Split(line, "|")
	for i := range cells {
		cells[i] = strings.TrimSpace(cells[i])
	}
	return cells
}

// parseListing turns `go list` lines into package → project imports, with
// paths relative to the module root.
func parseListing(listing, module string) (map[string][]string, error) {
	graph := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(listing), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		pkg, ok := relative(fields[0], module)
		if !ok {
			return nil, fmt.Errorf("package %s is outside module %s", fields[0], module)
		}
		var deps []string
		for _, imp := range fields[1:] {
			if rel, ok := relative(imp, module); ok {
				deps = append(deps, rel)
			}
		}
		graph[pkg] = deps
	}
	return graph, nil
}

func relative(path, module string) (string, bool) {
	if rest, ok := strings.CutPrefix(path, module+"/"); ok {
		return rest, true
	}
	return "", false
}

// matches reports whether pattern (a path, or "x/..." for x and below)
// names pkg.
func matches(pattern, pkg string) bool {
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == base || strings.HasPrefix(pkg, base+"/")
	}
	return pattern == pkg
}

// ruleFor picks the row for pkg: its exact row, else the longest subtree row.
func ruleFor(rules []rule, pkg string) (rule, bool) {
	best, found := rule{}, false
	for _, ru := range rules {
		if ru.pkg == pkg {
			return ru, true
		}
		if matches(ru.pkg, pkg) && (!found || len(ru.pkg) > len(best.pkg)) {
			best, found = ru, true
		}
	}
	return best, found
}

func check(rules []rule, graph map[string][]string) []string {
	var problems []string
	pkgs := make([]string, 0, len(graph))
	for p := range graph {
		pkgs = append(pkgs, p)
	}
	sort.Strings(pkgs)
	for _, pkg := range pkgs {
		ru, ok := ruleFor(rules, pkg)
		if !ok {
			problems = append(problems, fmt.Sprintf("%s is not in the package table: add a row saying what it holds and may import", pkg))
			continue
		}
		if ru.anything {
			continue
		}
		for _, dep := range graph[pkg] {
			allowed := false
			for _, a := range ru.allowed {
				if matches(a, dep) {
					allowed = true
					break
				}
			}
			if !allowed {
				problems = append(problems, fmt.Sprintf("%s imports %s, which its row (%s) does not allow", pkg, dep, ru.pkg))
			}
		}
	}
	for _, ru := range rules {
		if ru.anything || strings.HasSuffix(ru.pkg, "/...") {
			continue
		}
		if _, ok := graph[ru.pkg]; !ok {
			problems = append(problems, fmt.Sprintf("the table lists %s, which does not exist: remove or rename its row", ru.pkg))
		}
	}
	return append(problems, unusedAllowances(rules, graph)...)
}

// unusedAllowances reports each entry of a row's "may import" column that no
// import of the packages the row governs matches. The graph must be the whole
// module's production packages, as it is for check.
func unusedAllowances(rules []rule, graph map[string][]string) []string {
	used := map[string]map[string]bool{} // row → allowance → used
	for pkg, deps := range graph {
		ru, ok := ruleFor(rules, pkg)
		if !ok || ru.anything {
			continue
		}
		for _, dep := range deps {
			for _, a := range ru.allowed {
				if matches(a, dep) {
					if used[ru.pkg] == nil {
						used[ru.pkg] = map[string]bool{}
					}
					used[ru.pkg][a] = true
				}
			}
		}
	}
	var problems []string
	for _, ru := range rules {
		for _, a := range ru.allowed {
			if !used[ru.pkg][a] {
				problems = append(problems, fmt.Sprintf("the row of %s allows %s, which none of its imports uses: remove the allowance", ru.pkg, a))
			}
		}
	}
	return problems
}

// goOutput runs the go command that make uses ($GO, else go on PATH).
func goOutput(args ...string) (string, error) {
	goCmd := os.Getenv("GO")
	if goCmd == "" {
		goCmd = "go"
	}
	cmd := exec.Command(goCmd, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}
