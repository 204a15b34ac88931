package netns

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// enterWay is one way of moving a thread, or a process a thread starts,
// into another network namespace, as it appears in source: a name of an
// imported package (function, option, constant), or a field that hands a
// namespace to a library, which then switches a locked thread itself.
type enterWay struct {
	// pkg is the import path.
	pkg string
	// whole: any use of the package is a way in (its purpose is entering
	// or holding namespaces).
	whole bool
	// names are the package's names that enter, or hand over, a namespace.
	names []string
	// fields are keys of the package's struct literals that hand over a
	// namespace (the library dials inside it).
	fields []string
}

// enterWays are all the ways in that the module's dependencies offer, and
// the raw syscalls. Only this package may use them; everyone else calls Do,
// DoInNew or Socket.
var enterWays = []enterWay{
	{pkg: "golang.org/x/sys/unix", names: []string{"Setns", "Unshare", "SYS_SETNS", "SYS_UNSHARE", "CLONE_NEWNET"}},
	{pkg: "syscall", names: []string{"Unshare", "SYS_SETNS", "SYS_UNSHARE", "CLONE_NEWNET"}},
	// Locking the thread is the first step of every switch.
	{pkg: "runtime", names: []string{"LockOSThread"}},
	{pkg: "C", names: []string{"setns", "unshare"}},
	// vishvananda/netns: Set, Setns, NewNamed, Do...
	{pkg: "github.com/vishvananda/netns", whole: true},
	{pkg: "github.com/vishvananda/netlink",
		names:  []string{"NewHandleAt", "NewHandleAtFrom", "LinkSubscribeAt", "AddrSubscribeAt", "RouteSubscribeAt", "NeighSubscribeAt"},
		fields: []string{"Namespace"}},
	{pkg: "github.com/vishvananda/netlink/nl", names: []string{"GetNetlinkSocketAt", "SubscribeAt", "NewNetlinkRequestAt"}},
	// containernetworking's ns: NetNS.Do, NetNS.Set, WithNetNSPath.
	{pkg: "github.com/containernetworking/plugins/pkg/ns", whole: true},
	{pkg: "github.com/containernetworking/plugins/pkg/testutils", whole: true},
	{pkg: "github.com/google/nftables", names: []string{"WithNetNSFd"}, fields: []string{"NetNS"}},
	{pkg: "github.com/mdlayher/netlink", fields: []string{"NetNS"}},
	{pkg: "github.com/mdlayher/genetlink", fields: []string{"NetNS"}},
	{pkg: "github.com/mdlayher/socket", fields: []string{"NetNS"}},
}

// enterFields are field names that hand a namespace to a library, whatever
// the struct: a key in a literal whose type is left out, or an assignment,
// cannot be traced to its package without type checking.
var enterFields = []string{"NetNS"}

// enterTools are commands that start a process in another namespace.
var enterTools = [][]string{{"nsenter"}, {"unshare"}, {"ip", "netns", "exec"}}

// enterSites lists where the parsed file f uses a way into a namespace,
// each as "line: what".
func enterSites(fset *token.FileSet, f *ast.File) []string {
	var sites []string
	at := func(n ast.Node, format string, args ...any) {
		sites = append(sites, fmt.Sprintf("%d: %s", fset.Position(n.Pos()).Line, fmt.Sprintf(format, args...)))
	}
	ways := map[string]enterWay{}   // by local name
	dotted := map[string]enterWay{} // by name, of dot-imported packages
	for _, imp := range f.Imports {
		pkg, _ := strconv.Unquote(imp.Path.Value)
		i := slices.IndexFunc(enterWays, func(w enterWay) bool { return w.pkg == pkg })
		if i < 0 {
			continue
		}
		w := enterWays[i]
		if w.whole {
			at(imp, "imports %s", pkg)
			continue
		}
		name := path.Base(pkg)
		if imp.Name != nil {
			name = imp.Name.Name
		}
		if name == "." {
			for _, n := range w.names {
				dotted[n] = w
			}
			continue
		}
		ways[name] = w
	}
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			if x, ok := n.X.(*ast.Ident); ok {
				if w, ok := ways[x.Name]; ok && slices.Contains(w.names, n.Sel.Name) {
					at(n, "uses %s.%s", w.pkg, n.Sel.Name)
				}
			}
		case *ast.Ident:
			if w, ok := dotted[n.Name]; ok {
				at(n, "uses %s.%s (dot import)", w.pkg, n.Name)
			}
		case *ast.CompositeLit:
			var fields []string
			if sel, ok := n.Type.(*ast.SelectorExpr); ok {
				if x, ok := sel.X.(*ast.Ident); ok {
					fields = ways[x.Name].fields
				}
			}
			for _, e := range n.Elts {
				kv, ok := e.(*ast.KeyValueExpr)
				if !ok {
					continue
				}
				if k, ok := kv.Key.(*ast.Ident); ok && (slices.Contains(fields, k.Name) || slices.Contains(enterFields, k.Name)) {
					at(kv, "passes a namespace in field %s", k.Name)
				}
			}
		case *ast.AssignStmt:
			for _, lhs := range n.Lhs {
				if sel, ok := lhs.(*ast.SelectorExpr); ok && slices.Contains(enterFields, sel.Sel.Name) {
					at(sel, "passes a namespace in field %s", sel.Sel.Name)
				}
			}
		case *ast.CallExpr:
			// exec.Command("nsenter", ...), ("ip", "netns", "exec", ...):
			// the command is the first string argument.
			var words []string
			for _, a := range n.Args {
				if lit, ok := a.(*ast.BasicLit); ok && lit.Kind == token.STRING {
					s, _ := strconv.Unquote(lit.Value)
					words = append(words, s)
				}
			}
			for _, tool := range enterTools {
				if len(words) >= len(tool) && path.Base(words[0]) == tool[0] && slices.Equal(words[1:len(tool)], tool[1:]) {
					at(n, "runs %s", strings.Join(tool, " "))
				}
			}
		}
		return true
	})
	return sites
}

// TestOnlyThisPackageEntersNamespaces: outside this package (and tests),
// nothing under pkg/ or cmd/ moves a thread into a namespace, by syscall or
// by handing a namespace to a library that switches a thread itself, so Do
// is the one audited place where that happens (Socket gives others their
// sockets inside one).
func TestOnlyThisPackageEntersNamespaces(t *testing.T) {
	var files []string
	for _, glob := range []string{"../*/*.go", "../*/*/*.go", "../../cmd/*/*.go", "../../cmd/*/*/*.go"} {
		m, err := filepath.Glob(glob)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") || filepath.Dir(f) == filepath.Join("..", "netns") {
			continue
		}
		checked++
		fset := token.NewFileSet()
		file, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, site := range enterSites(fset, file) {
			t.Errorf("%s:%s: enter namespaces with pkg/netns (Do, or Socket for a socket inside one)", f, site)
		}
	}
	if checked < 50 {
		t.Fatalf("checked only %d production files; the globs no longer find the sources", checked)
	}
}

// The scanner knows every way in: each snippet must be found, and the
// clean one must not.
func TestEnterSitesFindsEveryWay(t *testing.T) {
	for _, tc := range []struct {
		name, imports, body string
		want                bool
	}{
		{"setns", `"golang.org/x/sys/unix"`, `unix.Setns(fd, 0)`, true},
		{"unshare", `"golang.org/x/sys/unix"`, `unix.Unshare(0)`, true},
		{"setns by number", `"golang.org/x/sys/unix"`, `unix.Syscall(unix.SYS_SETNS, 3, 0, 0)`, true},
		{"renamed import", `sys "golang.org/x/sys/unix"`, `f := sys.Setns; _ = f`, true},
		{"dot import", `. "golang.org/x/sys/unix"`, `Setns(3, 0)`, true},
		{"syscall unshare", `"syscall"`, `syscall.Unshare(0)`, true},
		{"process in a new netns", `"os/exec"; "syscall"`, `exec.Command("x").SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNET}`, true},
		{"locked thread", `"runtime"`, `runtime.LockOSThread()`, true},
		{"vishvananda netns", `"github.com/vishvananda/netns"`, `netns.Set(0)`, true},
		{"netlink handle at", `"github.com/vishvananda/netlink"`, `netlink.NewHandleAt(3)`, true},
		{"netlink subscribe at", `"github.com/vishvananda/netlink"`, `netlink.LinkSubscribeWithOptions(nil, nil, netlink.LinkSubscribeOptions{Namespace: h})`, true},
		{"nl socket at", `"github.com/vishvananda/netlink/nl"`, `nl.GetNetlinkSocketAt(3, 4, 0)`, true},
		{"cni ns", `"github.com/containernetworking/plugins/pkg/ns"`, `ns.WithNetNSPath(p, f)`, true},
		{"nftables option", `"github.com/google/nftables"`, `nftables.New(nftables.WithNetNSFd(fd))`, true},
		{"nftables conn field", `"github.com/google/nftables"`, `_ = &nftables.Conn{NetNS: fd}`, true},
		{"mdlayher netlink config", `"github.com/mdlayher/netlink"`, `netlink.Dial(12, &netlink.Config{NetNS: fd})`, true},
		{"config field assigned", `"github.com/mdlayher/netlink"`, `var c netlink.Config; c.NetNS = fd`, true},
		{"config type left out", ``, `_ = []*cfg{{NetNS: fd}}`, true},
		{"mdlayher socket config", `"github.com/mdlayher/socket"`, `socket.Socket(1, 2, 3, "x", &socket.Config{NetNS: fd})`, true},
		{"nsenter", `"os/exec"`, `exec.Command("nsenter", "--net="+p, "x")`, true},
		{"nsenter by path", `"os/exec"`, `exec.Command("/usr/bin/nsenter", "-n")`, true},
		{"ip netns exec", `"os/exec"`, `exec.Command("ip", "netns", "exec", "pod", "x")`, true},
		{"cgo", `"C"`, `C.setns(3, 0)`, true},
		{"the word in a message", `"fmt"`, `_ = fmt.Errorf("unshare network namespace: %w", err)`, false},
		{"clean", `"golang.org/x/sys/unix"; "github.com/mdlayher/netlink"; "os/exec"`,
			`unix.Socket(1, 2, 3); netlink.Dial(12, &netlink.Config{Strict: true}); exec.Command("ip", "link")`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := "package p\nimport (" + tc.imports + ")\nfunc f() {\n" + tc.body + "\n}\n"
			fset := token.NewFileSet()
			file, err := parser.ParseFile(fset, "p.go", src, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			if sites := enterSites(fset, file); (len(sites) > 0) != tc.want {
				t.Errorf("found %q in:\n%s", sites, src)
			}
		})
	}
}
