package netns

import (
	"fmt"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// init runs on the main goroutine, on the process's main thread; locking
// keeps TestMain there, so it can switch the thread group leader: the case
// the runtime does not discard a thread for.
func init() { runtime.LockOSThread() }

// mainThreadEnter is what switching the main thread into a new namespace
// and back did to the process's own namespace ("" = nothing, or not run:
// not root).
var mainThreadEnter string

// enterOnMainThread, from TestMain, runs the thread switch on the main
// thread, where /proc/self/ns/net (which the agent takes for the host's)
// resolves.
func enterOnMainThread() {
	if os.Geteuid() == 0 {
		before, _ := os.Readlink("/proc/self/ns/net")
		err := inThread(unshareNet, func() error { return nil })
		runtime.LockOSThread() // it unlocked once; stay on the main thread
		if after, _ := os.Readlink("/proc/self/ns/net"); after != before {
			mainThreadEnter = fmt.Sprintf("/proc/self/ns/net is %s after the switch, was %s (error: %v)", after, before, err)
		}
	}
	runtime.UnlockOSThread()
}

// Run on the main thread, a switch leaves the process's namespace (what
// /proc/self/ns/net names, "the host" to the agent) as it was.
func TestEnterOnTheMainThreadLeavesTheProcessNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	if mainThreadEnter != "" {
		t.Fatal(mainThreadEnter)
	}
}

// Run on any thread, a switch puts that thread back where it was.
func TestEnterLeavesTheThreadWhereItWas(t *testing.T) {
	testnet.RequireRoot(t)
	runtime.LockOSThread()
	before, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	var inside string
	if err := inThread(unshareNet, func() error {
		inside, err = os.Readlink("/proc/thread-self/ns/net")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread() // it unlocked once; read on the same thread
	defer runtime.UnlockOSThread()
	after, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if inside == before {
		t.Errorf("fn ran in the thread's own namespace %s, not a new one", inside)
	}
	if after != before {
		t.Fatalf("the switch left its thread in %s (was %s)", after, before)
	}
}

// Do runs fn inside the namespace, DoInNew in a fresh one; from any
// goroutine, both leave every thread of the process in the namespace the
// process has. A path that is no namespace is an error, and "" is the
// caller's namespace.
func TestDoLeavesNoThreadBehind(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	want := netnsOf(t, pod.Path())
	self, _ := os.Readlink("/proc/self/ns/net")
	for range 20 {
		var got Identity
		if err := Do(pod.Path(), func() error {
			got = netnsOf(t, "/proc/thread-self/ns/net")
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("fn ran in %+v, want the pod's %+v", got, want)
		}
		var fresh string
		if err := DoInNew(func() error {
			var err error
			fresh, err = os.Readlink("/proc/thread-self/ns/net")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if fresh == self {
			t.Fatalf("DoInNew ran fn in the process's namespace %s", fresh)
		}
	}
	if err := Do("/dev/null", func() error { return nil }); err == nil {
		t.Error("Do entered /dev/null")
	}
	if err := Do(filepath.Join(t.TempDir(), "missing"), func() error { return nil }); err == nil {
		t.Error("Do entered a missing path")
	}
	ran := false
	if err := Do("", func() error { ran = true; return nil }); err != nil || !ran {
		t.Errorf(`Do(""): ran %v, %v`, ran, err)
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		ns, err := os.Readlink("/proc/self/task/" + task.Name() + "/ns/net")
		if err == nil && ns != self {
			t.Errorf("thread %s is in %s, the process in %s", task.Name(), ns, self)
		}
	}
}

// enterCalls are the ways of moving a thread into another network
// namespace: the raw syscalls and the helpers of the libraries the module
// uses (containernetworking's ns.Do and ns.WithNetNSPath, vishvananda's
// netns.Set and netlink's handles opened at another namespace).
var enterCalls = []string{"Setns", "Unshare", "WithNetNSPath", "NewHandleAt", "NewHandleAtFrom", "GetNetlinkSocketAt", "LockOSThread"}

// TestOnlyThisPackageEntersNamespaces: outside this package (and tests),
// nothing under pkg/ or cmd/ moves a thread into a namespace, so Do is the
// one audited place where that happens.
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
		// Which local names refer to containernetworking's pkg/ns.
		nsNames := map[string]bool{}
		for _, imp := range file.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if path == "github.com/containernetworking/plugins/pkg/ns" {
				name := "ns"
				if imp.Name != nil {
					name = imp.Name.Name
				}
				nsNames[name] = true
			}
			if path == "github.com/vishvananda/netns" {
				t.Errorf("%s imports %s: enter namespaces with pkg/netns.Do", f, path)
			}
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(src), "\n") {
			code, _, _ := strings.Cut(line, "//")
			for _, call := range enterCalls {
				if strings.Contains(code, "."+call+"(") {
					t.Errorf("%s:%d calls %s: enter namespaces with pkg/netns.Do", f, i+1, call)
				}
			}
			for name := range nsNames {
				if strings.Contains(code, name+".Do(") || strings.Contains(code, ".Do(func("+name+".NetNS)") {
					t.Errorf("%s:%d calls %s.Do: enter namespaces with pkg/netns.Do", f, i+1, name)
				}
			}
		}
	}
	if checked < 50 {
		t.Fatalf("checked only %d production files; the globs no longer find the sources", checked)
	}
}
