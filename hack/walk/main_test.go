package main

import (
	"strings"
	"testing"
)

// The limits a DEL's walk is held to: no longer than an ADD's, which
// itself stays within them.
const (
	maxFiles  = 7
	maxClimbs = 3
)

// TestNodeagentWalks holds pkg/nodeagent to its doc.go: every file listed,
// no call against the order, and a DEL's walk (live or found by GC) no
// longer than an ADD's, both within maxFiles and maxClimbs.
func TestNodeagentWalks(t *testing.T) {
	p, err := Load("../../pkg/nodeagent")
	if err != nil {
		t.Fatal(err)
	}
	if missing := p.Unlisted(); len(missing) > 0 {
		t.Errorf("doc.go's file order does not list %v", missing)
	}
	if climbs := p.Climbs(); len(climbs) > 0 {
		t.Errorf("calls against doc.go's order (callers first):\n  %s", strings.Join(climbs, "\n  "))
	}
	walk := func(entry string) Walk {
		w, err := p.Walk(entry)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d files %v, %d climbs back", entry, len(w.Files), w.Files, len(w.Climbs))
		return w
	}
	add := walk("Agent.Capture")
	if len(add.Files) > maxFiles || len(add.Climbs) > maxClimbs {
		t.Errorf("an ADD's walk: %d files, %d climbs back; want at most %d and %d", len(add.Files), len(add.Climbs), maxFiles, maxClimbs)
	}
	for _, entry := range []string{"Agent.RemoveSandbox", "Agent.GC"} {
		del := walk(entry)
		if len(del.Files) > min(maxFiles, len(add.Files)) || len(del.Climbs) > min(maxClimbs, len(add.Climbs)) {
			t.Errorf("%s's walk: %d files %v, %d climbs back %v; want no more than an ADD's (%d, %d) within %d and %d",
				entry, len(del.Files), del.Files, len(del.Climbs), del.Climbs, len(add.Files), len(add.Climbs), maxFiles, maxClimbs)
		}
	}
	// Every event's entry is still there to measure.
	for _, ev := range Events {
		walk(ev.Entry)
	}
}

// TestFileOrder reads a doc.go list: one rank per item, files of an item
// sharing it.
func TestFileOrder(t *testing.T) {
	doc := "Files, callers first:\n\n  - a.go, b.go: the top\n    continued: not an item\n  - c.go: below\n  - not a file: skipped\n"
	got := fileOrder(doc)
	want := map[string]int{"a.go": 0, "b.go": 0, "c.go": 1}
	if len(got) != len(want) {
		t.Fatalf("fileOrder = %v, want %v", got, want)
	}
	for f, r := range want {
		if got[f] != r {
			t.Errorf("fileOrder = %v, want %v", got, want)
		}
	}
}
