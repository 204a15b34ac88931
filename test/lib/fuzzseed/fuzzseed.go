// Package fuzzseed feeds committed seed inputs to the fuzz tests of the
// parsers (pkg/ambient, its nodefiles, pkg/plugin, pkg/zds, pkg/netns).
package fuzzseed

import (
	"os"
	"path/filepath"
	"testing"
)

// Add adds every file in testdata/seeds/<name> as a seed, and fails when
// there is none; go test also replays testdata/fuzz/<name> on its own.
func Add(f *testing.F, name string) {
	f.Helper()
	AddDir(f, filepath.Join("testdata", "seeds", name))
}

// AddDir adds every file in dir as a seed, and fails when there is none:
// for seeds that are also the inputs of table tests (pkg/netns's
// testdata/cgroups).
func AddDir(f *testing.F, dir string) {
	f.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "*"))
	if len(files) == 0 {
		f.Fatalf("no seeds in %s", dir)
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
}
