package controller

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
)

// The path handed to the Enroller opens the very file the scanner checked,
// and stops naming it once the controller closes it.
func TestHeldPath(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "ns"))
	if err != nil {
		t.Fatal(err)
	}
	found := podnetns.Found{File: f}
	path := heldPath(found)
	a, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	b, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(a, b) {
		t.Fatalf("%s is not the held file", path)
	}
	if err := found.Close(); err != nil {
		t.Fatal(err)
	}
	if p := heldPath(found); p == path {
		t.Fatalf("closed file still named %s", p)
	}
}
