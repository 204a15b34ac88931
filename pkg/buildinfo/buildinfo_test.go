package buildinfo

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func TestUnstamped(t *testing.T) {
	if Version() != "dev" || Commit() != "unknown" {
		t.Fatalf("unstamped build: version %q commit %q, want dev and unknown", Version(), Commit())
	}
	if got, want := String("prog"), "prog dev (commit unknown, "+runtime.Version()+")"; got != want {
		t.Fatalf("String = %q, want %q", got, want)
	}
}

func TestIsVersionFlag(t *testing.T) {
	for _, c := range []struct {
		args []string
		want bool
	}{
		{nil, false}, {[]string{"--version"}, true}, {[]string{"-version"}, true},
		{[]string{"--version", "x"}, false}, {[]string{"version"}, false}, {[]string{"--versionx"}, false},
	} {
		if got := IsVersionFlag(c.args); got != c.want {
			t.Errorf("IsVersionFlag(%q) = %v, want %v", c.args, got, c.want)
		}
	}
}

// TestStampedBinaries builds the three shipped binaries with the linker
// flags the Makefile uses and checks each answers --version with them.
func TestStampedBinaries(t *testing.T) {
	if testing.Short() {
		t.Skip("builds binaries")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	const v, c = "v9.8.7-test", "0123456789abcdef0123456789abcdef01234567"
	ldflags := "-X github.com/ambient-cni/ambient-cni/pkg/buildinfo.version=" + v +
		" -X github.com/ambient-cni/ambient-cni/pkg/buildinfo.commit=" + c
	pkgs := map[string]string{"install-cni": "./cmd/install-cni", "ambient-cni-uninstall": "./cmd/ambient-cni-uninstall", "ambient-cni": "./cmd/cni-plugin", "kubectl-ambient_cni": "./cmd/kubectl-ambient_cni"}
	for name, pkg := range pkgs {
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", ldflags, "-o", filepath.Join(out, name), pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", pkg, err, b)
		}
		got, err := exec.Command(filepath.Join(out, name), "--version").CombinedOutput()
		if err != nil {
			t.Fatalf("%s --version: %v\n%s", name, err, got)
		}
		want := name + " " + v + " (commit " + c + ", "
		if !strings.HasPrefix(string(got), want) {
			t.Errorf("%s --version = %q, want prefix %q", name, got, want)
		}
	}
}
