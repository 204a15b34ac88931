// Command walk measures how far one event travels through a package's
// files: from an entry function (Agent.Capture for a CNI ADD,
// Agent.RemoveSandbox for a CNI DEL...), every function of the package it
// calls, directly or not, is visited; the figures are the files those
// functions are in, and the climbs back: calls from one file to another
// that the package's doc.go lists on the same line or above it (doc.go
// lists the files callers first, so a call should only go down the list).
//
// A call is a static one: a function or a method of the package named in
// the body (closures in it included), called or passed as a value. Calls
// through interfaces (the rules backend, ztunnel) leave the package and
// are not followed. Each climb counts once per pair of functions.
//
// Run it from the repository root: go run ./hack/walk (it measures
// pkg/nodeagent's events); its test holds a DEL's walk to an ADD's.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// Events are pkg/nodeagent's events and the function each starts at.
var Events = []Event{
	{"ADD", "Agent.Capture"},
	{"DEL", "Agent.RemoveSandbox"},
	{"replayed DEL", "delQueue.drain"},
	{"GC", "Agent.GC"},
	{"unenroll", "Agent.Unenroll"},
	{"release", "Agent.Release"},
	{"uninstall", "Agent.ReleaseAll"},
}

// Event is an event's name and its entry function: "Func" or
// "Type.Method".
type Event struct {
	Name, Entry string
}

func main() {
	dir := flag.String("pkg", "./pkg/nodeagent", "the package directory")
	verbose := flag.Bool("v", false, "list each walk's files and climbs")
	flag.Parse()
	p, err := Load(*dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "walk:", err)
		os.Exit(1)
	}
	for _, ev := range Events {
		w, err := p.Walk(ev.Entry)
		if err != nil {
			fmt.Fprintln(os.Stderr, "walk:", err)
			os.Exit(1)
		}
		fmt.Printf("%-13s %-22s %2d files, %d climbs back\n", ev.Name, ev.Entry, len(w.Files), len(w.Climbs))
		if *verbose {
			fmt.Printf("    files: %s\n", strings.Join(w.Files, " "))
			for _, c := range w.Climbs {
				fmt.Printf("    climb: %s\n", c)
			}
		}
	}
	all := p.Climbs()
	fmt.Printf("%-13s %-22s           %d climbs back\n", "every call", "", len(all))
	if *verbose {
		for _, c := range all {
			fmt.Printf("    climb: %s\n", c)
		}
	}
	if missing := p.Unlisted(); len(missing) > 0 {
		fmt.Printf("not in doc.go's order: %s\n", strings.Join(missing, " "))
	}
}

// Package is one package's functions, the calls between them, and its
// doc.go's file order.
type Package struct {
	// rank is each file's line in doc.go's list (0 first); a file not
	// listed has none.
	rank map[string]int
	// files are the package's (non-test) files.
	files []string
	funcs map[string]*fn
}

type fn struct {
	name  string
	file  string
	calls []string // the package functions it names, by name
}

// Walk is what one event's walk came to.
type Walk struct {
	// Files are the files visited, in the order first visited.
	Files []string
	// Climbs are the calls that go up (or sideways) in doc.go's order:
	// "caller (file) -> callee (file)".
	Climbs []string
}

// Walk walks the call tree from entry.
func (p *Package) Walk(entry string) (Walk, error) {
	if p.funcs[entry] == nil {
		return Walk{}, fmt.Errorf("no function %s in the package", entry)
	}
	var w Walk
	seenFile := map[string]bool{}
	seen := map[string]bool{}
	var visit func(name string)
	visit = func(name string) {
		if seen[name] {
			return
		}
		seen[name] = true
		f := p.funcs[name]
		if !seenFile[f.file] {
			seenFile[f.file] = true
			w.Files = append(w.Files, f.file)
		}
		for _, c := range f.calls {
			g := p.funcs[c]
			if g.file != f.file && p.climbs(f.file, g.file) {
				w.Climbs = append(w.Climbs, fmt.Sprintf("%s (%s) -> %s (%s)", f.name, f.file, g.name, g.file))
			}
			visit(c)
		}
	}
	visit(entry)
	return w, nil
}

// Climbs are every call of the package that breaks doc.go's order, on
// any walk.
func (p *Package) Climbs() []string {
	var out []string
	for _, f := range p.funcs {
		for _, c := range f.calls {
			if g := p.funcs[c]; g.file != f.file && p.climbs(f.file, g.file) {
				out = append(out, fmt.Sprintf("%s (%s) -> %s (%s)", f.name, f.file, g.name, g.file))
			}
		}
	}
	sort.Strings(out)
	return out
}

// climbs reports whether a call from file from to file to breaks doc.go's
// order: to is on from's line or above it, or either is not listed.
func (p *Package) climbs(from, to string) bool {
	rf, okf := p.rank[from]
	rt, okt := p.rank[to]
	return !okf || !okt || rt <= rf
}

// Unlisted are the package's files doc.go's order does not list.
func (p *Package) Unlisted() []string {
	var out []string
	for _, f := range p.files {
		if _, ok := p.rank[f]; !ok && f != "doc.go" {
			out = append(out, f)
		}
	}
	return out
}

// Load type-checks the package in dir (its imports from the build cache's
// export data, as go list -export gives them) and reads its doc.go.
func Load(dir string) (*Package, error) {
	exports, err := exportData(dir)
	if err != nil {
		return nil, err
	}
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	var files []*ast.File
	p := &Package{funcs: map[string]*fn{}}
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, n, nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
		p.files = append(p.files, filepath.Base(n))
		if filepath.Base(n) == "doc.go" {
			p.rank = fileOrder(f.Doc.Text())
		}
	}
	if p.rank == nil {
		return nil, fmt.Errorf("%s: no doc.go listing the files", dir)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}, Defs: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(f)
	})}
	pkg, err := conf.Check(dir, fset, files, info)
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		file := filepath.Base(fset.Position(f.Pos()).Filename)
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			obj := info.Defs[fd.Name].(*types.Func)
			g := &fn{name: funcName(obj), file: file}
			seen := map[string]bool{}
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				id, ok := n.(*ast.Ident)
				if !ok {
					return true
				}
				callee, ok := info.Uses[id].(*types.Func)
				if !ok || callee.Pkg() != pkg {
					return true
				}
				if sig := callee.Signature(); sig.Recv() != nil && types.IsInterface(sig.Recv().Type()) {
					return true // an interface's method: not a static call
				}
				name := funcName(callee.Origin())
				if !seen[name] && name != g.name {
					seen[name] = true
					g.calls = append(g.calls, name)
				}
				return true
			})
			p.funcs[g.name] = g
		}
	}
	for _, g := range p.funcs {
		g.calls = slicesFilter(g.calls, func(c string) bool { return p.funcs[c] != nil })
		sort.Strings(g.calls)
	}
	return p, nil
}

func slicesFilter(s []string, keep func(string) bool) []string {
	out := s[:0]
	for _, x := range s {
		if keep(x) {
			out = append(out, x)
		}
	}
	return out
}

// funcName is "Func" or "Type.Method".
func funcName(f *types.Func) string {
	recv := f.Signature().Recv()
	if recv == nil {
		return f.Name()
	}
	t := recv.Type()
	if ptr, ok := t.(*types.Pointer); ok {
		t = ptr.Elem()
	}
	if named, ok := t.(*types.Named); ok {
		return named.Obj().Name() + "." + f.Name()
	}
	return f.Name()
}

// listed matches a line of doc.go's list: "  - a.go, b.go: what they hold".
var listed = regexp.MustCompile(`^\s*-\s+([a-z0-9_]+\.go(?:\s*,\s*[a-z0-9_]+\.go)*)\s*:`)

// fileOrder reads the list of files in a package comment: each item's
// files share a rank, items first to last.
func fileOrder(doc string) map[string]int {
	rank := map[string]int{}
	line := 0
	sc := bufio.NewScanner(strings.NewReader(doc))
	for sc.Scan() {
		m := listed.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		for _, f := range strings.Split(m[1], ",") {
			rank[strings.TrimSpace(f)] = line
		}
		line++
	}
	return rank
}

// exportData maps the import paths dir's package depends on to their
// export data files.
func exportData(dir string) (map[string]string, error) {
	goCmd := os.Getenv("GO")
	if goCmd == "" {
		goCmd = "go"
	}
	cmd := exec.Command(goCmd, "list", "-deps", "-export", "-json=ImportPath,Export", ".")
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list -export in %s: %w: %s", dir, err, stderr.String())
	}
	m := map[string]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var p struct{ ImportPath, Export string }
		if err := dec.Decode(&p); err != nil {
			return nil, err
		}
		if p.Export != "" {
			m[p.ImportPath] = p.Export
		}
	}
	return m, nil
}
