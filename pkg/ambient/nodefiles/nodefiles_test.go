package nodefiles

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

func TestPaths(t *testing.T) {
	if SnapshotPath(ambient.DefaultAgentSocket) != "/var/run/ambient-cni/enablement.json" {
		t.Errorf("default snapshot path %s", SnapshotPath(ambient.DefaultAgentSocket))
	}
	if SpoolDir("/run/a/agent.sock") != "/run/a/pending-del" {
		t.Errorf("spool dir %s", SpoolDir("/run/a/agent.sock"))
	}
}

func TestSpoolRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "spool")
	ev := ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "abc-1", PodUID: "u1", PodName: "web", PodNamespace: "shop"}
	if err := Spool(dir, ev); err != nil {
		t.Fatal(err)
	}
	if err := Spool(dir, ev); err != nil { // same sandbox: overwritten
		t.Fatal(err)
	}
	st, err := os.Stat(dir)
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("spool dir mode %v, %v", st.Mode(), err)
	}
	entries, err := List(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []Entry{{Path: filepath.Join(dir, "abc-1.json"), Event: &ev}}
	if diff := cmp.Diff(want, entries); diff != "" {
		t.Fatalf("List (-want +got):\n%s", diff)
	}
	if err := Remove(entries[0].Path); err != nil {
		t.Fatal(err)
	}
	if err := Remove(entries[0].Path); err != nil {
		t.Errorf("removing twice: %v", err)
	}
	if entries, err := List(filepath.Join(dir, "missing")); err != nil || len(entries) != 0 {
		t.Errorf("missing spool: %v, %v", entries, err)
	}
}

func TestSpoolRejects(t *testing.T) {
	dir := t.TempDir()
	for name, ev := range map[string]ambient.PodEvent{
		"not DEL":        {Command: ambient.CommandAdd, SandboxID: "a", PodName: "a", PodNamespace: "b", Netns: "/x"},
		"no sandbox":     {Command: ambient.CommandDel},
		"dot sandbox":    {Command: ambient.CommandDel, SandboxID: ".."},
		"slash sandbox":  {Command: ambient.CommandDel, SandboxID: "a/b"},
		"invalid fields": {Command: ambient.CommandDel, SandboxID: "a", PodName: "../x"},
	} {
		if err := Spool(dir, ev); err == nil {
			t.Errorf("%s: spooled", name)
		}
	}
	if des, _ := os.ReadDir(dir); len(des) != 0 {
		t.Errorf("rejected entries left files: %v", des)
	}
}

func TestListHostileEntries(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(t.TempDir(), "secret.json")
	if err := os.WriteFile(secret, []byte(`{"command":"DEL","sandboxID":"stolen"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("garbage.json", "{{{")
	write("add.json", `{"command":"ADD","sandboxID":"a","podName":"a","podNamespace":"b","netns":"/x"}`)
	write("big.json", `{"command":"DEL","sandboxID":"a","podName":"`+strings.Repeat("a", maxEntryBytes)+`"}`)
	write("invalid.json", `{"command":"DEL","sandboxID":""}`)
	write(".x.json.1234.tmp", `{"command":"DEL","sandboxID":"half"}`)
	if err := os.Symlink(secret, filepath.Join(dir, "link.json")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "dir.json"), 0o700); err != nil {
		t.Fatal(err)
	}
	entries, err := List(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 6 {
		t.Fatalf("got %d entries, want 6 (temp file skipped): %+v", len(entries), entries)
	}
	for _, e := range entries {
		if e.Err == nil {
			t.Errorf("%s accepted as %+v", e.Path, e.Event)
		}
	}
}
