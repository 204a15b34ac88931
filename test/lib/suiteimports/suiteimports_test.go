// Package suiteimports checks that the suites under test/ share code only
// through test/lib: a suite imports the libraries and its own packages
// (test/bench/cmd/bench imports test/bench), never another suite, so a
// suite can change without breaking the others.
package suiteimports

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestSuitesImportOnlyLibraries(t *testing.T) {
	// go test runs in the package's directory (runtime.Caller's path is
	// module-relative under -trimpath, as make builds).
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	module, err := goList(root, "list", "-m")
	if err != nil {
		t.Fatal(err)
	}
	module = strings.TrimSpace(module)
	// -test adds the test packages' imports; the realnode tag the suite
	// behind it.
	listing, err := goList(root, "list", "-test", "-tags", "realnode",
		"-f", `{{.ImportPath}} {{join .Imports " "}} {{join .TestImports " "}} {{join .XTestImports " "}}`, "./test/...")
	if err != nil {
		t.Fatal(err)
	}
	prefix := module + "/test/"
	checked, seen := 0, map[string]bool{}
	for line := range strings.SplitSeq(strings.TrimSpace(listing), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		// "p [p.test]" and "p.test" are p's test variants.
		from, _, _ := strings.Cut(f[0], " ")
		from = strings.TrimSuffix(from, ".test")
		if !strings.HasPrefix(from, prefix) {
			continue
		}
		checked++
		for _, imp := range f[1:] {
			if strings.HasPrefix(imp, "[") {
				continue
			}
			if seen[from+" "+imp] {
				continue
			}
			seen[from+" "+imp] = true
			if err := allowed(strings.TrimPrefix(from, prefix), imp, prefix); err != "" {
				t.Errorf("%s imports %s: %s", from, imp, err)
			}
		}
	}
	if checked == 0 {
		t.Fatalf("go list named no package under test/:\n%s", listing)
	}
}

// allowed says why a package at from (relative to test/) may not import
// imp, or "" when it may.
func allowed(from, imp, prefix string) string {
	rel, ok := strings.CutPrefix(imp, prefix)
	if !ok {
		return ""
	}
	suite, _, _ := strings.Cut(from, "/")
	target, _, _ := strings.Cut(rel, "/")
	if target == "lib" || target == suite {
		return ""
	}
	return "a suite imports only test/lib and its own packages; move what they share to test/lib"
}

func goList(dir string, args ...string) (string, error) {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); ok {
		return "", &listError{args: args, stderr: string(ee.Stderr), err: err}
	}
	return string(out), err
}

type listError struct {
	args   []string
	stderr string
	err    error
}

func (e *listError) Error() string {
	return "go " + strings.Join(e.args, " ") + ": " + e.err.Error() + "\n" + e.stderr
}

func TestAllowed(t *testing.T) {
	const p = "m/test/"
	for _, c := range []struct {
		from, imp string
		ok        bool
	}{
		{"chaos", "m/test/lib/procstat", true},
		{"bench/cmd/bench", "m/test/bench", true},
		{"lib/simnode", "m/test/lib/kubeenv", true},
		{"chaos", "m/test/bench", false},
		{"lib/simnode", "m/test/bench", false},
		{"chaos", "m/pkg/nodeagent", true},
		{"chaos", "fmt", true},
	} {
		if got := allowed(c.from, c.imp, p) == ""; got != c.ok {
			t.Errorf("allowed(%s, %s) = %v, want %v", c.from, c.imp, got, c.ok)
		}
	}
}
