// Package ci tests the scripts make check runs: hack/stages.sh, which runs
// its stages (some in the background) and times them, and
// hack/kube-tools.sh, which builds the tools. Stand-ins for make and go
// (small shell scripts) keep the tests to seconds: they prove the
// scripts' logic, not the builds.
package ci

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// script returns the path of a repository script.
func script(t *testing.T, name string) string {
	t.Helper()
	root, err := kubeenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "hack", name)
}

// writeExe writes an executable script into dir.
func writeExe(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}
