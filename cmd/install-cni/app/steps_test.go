package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient/kubeclienttest"
)

// testApp is an App built as install-cni builds it, on paths in a
// temporary directory; New touches nothing on the node.
func testApp(t *testing.T) *App {
	t.Helper()
	dir := t.TempDir()
	plugin := filepath.Join(dir, "ambient-cni")
	if err := os.WriteFile(plugin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg, err := Parse([]string{"--node-name=x", "--plugin-binary=" + plugin,
		"--cni-bin-dir=" + filepath.Join(dir, "bin"), "--cni-conf-dir=" + filepath.Join(dir, "net.d"),
		"--agent-socket=" + filepath.Join(dir, "run", "agent.sock"), "--state-dir=" + filepath.Join(dir, "state"),
		"--zds-socket=" + filepath.Join(dir, "zds", "ztunnel.sock")}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(Options{Config: cfg, Client: kubeclienttest.FromClientset(fake.NewClientset())})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.rules.Close() })
	return a
}

// fakeSteps keeps the shape of a real list (names, which steps have an
// undo, which go on after a failure) with do and undo noting into log;
// step fail fails.
func fakeSteps(real []step, fail string, log *[]string) []step {
	out := make([]step, len(real))
	for i, s := range real {
		f := step{name: s.name, goOn: s.goOn, do: func(context.Context) error {
			*log = append(*log, "do "+s.name)
			if s.name == fail {
				return errors.New("failed: " + s.name)
			}
			return nil
		}}
		if s.undo != nil {
			f.undo = func() { *log = append(*log, "undo "+s.name) }
		}
		out[i] = f
	}
	return out
}

// TestStartStepsFailureUndoesEarlierSteps: in the start list, a failure at
// step k runs steps 1…k, then the undos of steps k-1…1 in reverse, and
// nothing else; the unwind returned then does nothing. Without a failure
// the unwind undoes every step, in reverse.
func TestStartStepsFailureUndoesEarlierSteps(t *testing.T) {
	a := testApp(t)
	real := a.startSteps(newComponents(t.Context(), a.zds, a.log))
	if len(real) < 10 {
		t.Fatalf("the start list has %d steps", len(real))
	}
	for k, s := range real {
		t.Run(s.name, func(t *testing.T) {
			var log []string
			unwind, err := runSteps(t.Context(), fakeSteps(real, s.name, &log), nil)
			if err == nil || !strings.Contains(err.Error(), "failed: "+s.name) {
				t.Fatalf("err = %v; want step %q's", err, s.name)
			}
			var want []string
			for _, d := range real[:k+1] {
				want = append(want, "do "+d.name)
			}
			for i := k - 1; i >= 0; i-- {
				if real[i].undo != nil {
					want = append(want, "undo "+real[i].name)
				}
			}
			if !slices.Equal(log, want) {
				t.Errorf("failure at step %d (%s):\n got %q\nwant %q", k+1, s.name, log, want)
			}
			n := len(log)
			unwind()
			if len(log) != n {
				t.Errorf("the unwind of a failed start undid again: %q", log[n:])
			}
		})
	}
	var log []string
	unwind, err := runSteps(t.Context(), fakeSteps(real, "", &log), nil)
	if err != nil {
		t.Fatal(err)
	}
	log = nil
	unwind()
	var want []string
	for i := len(real) - 1; i >= 0; i-- {
		if real[i].undo != nil {
			want = append(want, "undo "+real[i].name)
		}
	}
	if !slices.Equal(log, want) {
		t.Errorf("unwind after a whole start:\n got %q\nwant %q", log, want)
	}
}

// TestStartStepsStopRequested: a stop asked while a start step waits is
// not a failure: nothing is undone at once, and the unwind covers the
// steps done before.
func TestStartStepsStopRequested(t *testing.T) {
	var log []string
	steps := []step{
		{name: "a", do: func(context.Context) error { log = append(log, "do a"); return nil }, undo: func() { log = append(log, "undo a") }},
		{name: "b", do: func(context.Context) error { log = append(log, "do b"); return errStopRequested }, undo: func() { log = append(log, "undo b") }},
		{name: "c", do: func(context.Context) error { log = append(log, "do c"); return nil }},
	}
	unwind, err := runSteps(t.Context(), steps, nil)
	if !errors.Is(err, errStopRequested) {
		t.Fatalf("err = %v", err)
	}
	if want := []string{"do a", "do b"}; !slices.Equal(log, want) {
		t.Errorf("got %q, want %q", log, want)
	}
	unwind()
	if want := []string{"do a", "do b", "undo a"}; !slices.Equal(log, want) {
		t.Errorf("after the unwind: got %q, want %q", log, want)
	}
}

// TestUninstallStepsGoOnAfterAFailure: in the uninstall list nothing is
// undone (each step leaves a node a kill may leave), and a failure at step
// k is kept while every later step still runs.
func TestUninstallStepsGoOnAfterAFailure(t *testing.T) {
	a := testApp(t)
	cs := newComponents(t.Context(), a.zds, a.log)
	for _, list := range []struct {
		name  string
		steps []step
	}{{"uninstall", a.uninstallSteps(t.Context(), cs)}, {"upgrade", a.upgradeSteps(cs, true)}, {"give back", a.giveBackSteps(cs)}} {
		for _, s := range list.steps {
			if !s.goOn || s.undo != nil {
				t.Errorf("%s step %q: goOn %v, undo %v; want every step to go on, none undone", list.name, s.name, s.goOn, s.undo != nil)
			}
		}
		for _, s := range list.steps {
			t.Run(list.name+"/"+s.name, func(t *testing.T) {
				var log []string
				_, err := runSteps(t.Context(), fakeSteps(list.steps, s.name, &log), nil)
				if err == nil || !strings.Contains(err.Error(), "failed: "+s.name) {
					t.Fatalf("err = %v; want step %q's", err, s.name)
				}
				var want []string
				for _, d := range list.steps {
					want = append(want, "do "+d.name)
				}
				if !slices.Equal(log, want) {
					t.Errorf("failure at %s:\n got %q\nwant %q", s.name, log, want)
				}
			})
		}
	}
}

// mdItems is the numbered list that follows heading in the Markdown file
// at path, one string per item (its lines joined).
func mdItems(t *testing.T, path, heading string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("%s: no %q", path, heading)
	}
	var items []string
	item := regexp.MustCompile(`^\d+\. `)
	for line := range strings.SplitSeq(rest, "\n") {
		switch {
		case item.MatchString(line):
			items = append(items, item.ReplaceAllString(line, ""))
		case len(items) > 0 && strings.HasPrefix(line, "   "):
			items[len(items)-1] += " " + strings.TrimSpace(line)
		case len(items) > 0 && strings.TrimSpace(line) == "":
			return items
		case strings.HasPrefix(line, "## "):
			return items
		}
	}
	return items
}

// TestStartOrderDocumented: docs/how-it-works.md lists the start's steps
// by name in the order startSteps runs them, and docs/reliability.md names
// the steps start-up liveness follows in that order.
func TestStartOrderDocumented(t *testing.T) {
	a := testApp(t)
	real := a.startSteps(newComponents(t.Context(), a.zds, a.log))
	bold := regexp.MustCompile(`^\*\*([^*]+)\*\*`)
	var doc []string
	for _, it := range mdItems(t, filepath.Join("..", "..", "..", "docs", "how-it-works.md"), "## The agent's start") {
		m := bold.FindStringSubmatch(it)
		if m == nil {
			t.Fatalf("docs/how-it-works.md: item %q does not begin with a step's name in bold", it)
		}
		doc = append(doc, m[1])
	}
	if got := stepNames(real); !slices.Equal(doc, got) {
		t.Errorf("docs/how-it-works.md \"The agent's start\" lists\n%q\nthe code runs\n%q", doc, got)
	}

	var live []string
	for _, s := range real {
		if s.live {
			live = append(live, s.name)
		}
	}
	b, err := os.ReadFile(filepath.Join("..", "..", "..", "docs", "reliability.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(string(b)), " ")
	want := fmt.Sprintf("liveness follows the start-up step by step (%s)", strings.Join(live, ", "))
	if !strings.Contains(text, want) {
		t.Errorf("docs/reliability.md does not say %q", want)
	}
}

// TestUninstallOrderDocumented: docs/deploy.md's "Uninstall" lists the
// uninstall in the order uninstallSteps runs it: the marker, the plugin
// unchained, the pods released, the rest, and the marker removed last.
func TestUninstallOrderDocumented(t *testing.T) {
	a := testApp(t)
	real := stepNames(a.uninstallSteps(t.Context(), newComponents(t.Context(), a.zds, a.log)))
	// Each documented item, by how it begins, and the steps that make it.
	want := []struct {
		doc   string
		steps []string
	}{
		{"The uninstall marker", []string{"uninstall marker written"}},
		{"The plugin is unchained", []string{"plugin unchained"}},
		{"The captured pods are released", []string{"pods released"}},
		{"The rest: the host probe SNAT, the agent's node files",
			[]string{"host probe SNAT removed", "node files removed", "node directories put back", "uninstall marker removed"}},
	}
	items := mdItems(t, filepath.Join("..", "..", "..", "docs", "deploy.md"), "## Uninstall")
	if len(items) != len(want) {
		t.Fatalf("docs/deploy.md \"Uninstall\" has %d steps, want %d: %q", len(items), len(want), items)
	}
	last := -1
	for i, w := range want {
		if !strings.HasPrefix(items[i], w.doc) {
			t.Errorf("docs/deploy.md \"Uninstall\" step %d: %q; want it to begin %q", i+1, items[i], w.doc)
		}
		for _, name := range w.steps {
			at := slices.Index(real, name)
			if at <= last {
				t.Errorf("uninstall step %q at %d, after %d: the code does not run %q (step %d of the docs) in the documented order %q", name, at, last, name, i+1, real)
			}
			last = at
		}
	}
	if real[len(real)-1] != "uninstall marker removed" {
		t.Errorf("the uninstall's last step is %q; the docs say the marker goes last", real[len(real)-1])
	}
}
