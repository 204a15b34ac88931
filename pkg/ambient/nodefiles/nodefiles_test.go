package nodefiles

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

// TestPaths: the run directory's files are where the plugin, the agent,
// the chart and the docs expect them; changing one is an upgrade hazard.
func TestPaths(t *testing.T) {
	d := Default()
	for got, want := range map[string]string{
		d.Dir():            "/var/run/ambient-cni",
		d.AgentSocket():    "/var/run/ambient-cni/agent.sock",
		d.DebugSocket():    "/var/run/ambient-cni/debug.sock",
		d.Snapshot():       "/var/run/ambient-cni/enablement.json",
		d.Heartbeat():      "/var/run/ambient-cni/agent-alive",
		d.DelSpool():       "/var/run/ambient-cni/pending-del",
		d.AddSpool():       "/var/run/ambient-cni/pending-add",
		d.Records():        "/var/run/ambient-cni/captured",
		d.NodeDirsLedger(): "/var/run/ambient-cni/node-dirs.json",
		d.InstallerState(): "/var/run/ambient-cni/installer-state.json",
	} {
		if got != want {
			t.Errorf("got %s, want %s", got, want)
		}
	}
	if got := ForSocket("/run/a/x.sock").DelSpool(); got != "/run/a/pending-del" {
		t.Errorf("spool dir %s", got)
	}
	if got := InDir("/run/a").AgentSocket(); got != "/run/a/agent.sock" {
		t.Errorf("socket in dir %s", got)
	}
	if Default() != ForSocket(ambient.DefaultAgentSocket) {
		t.Error("Default is not the layout of the default socket")
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
		"CHECK":          {Command: ambient.CommandCheck, SandboxID: "a", PodName: "a", PodNamespace: "b", Netns: "/x"},
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

// TestAddSpool: the ADD spool holds ADDs only; a DEL is not read from it
// nor an ADD from the DEL spool.
func TestAddSpool(t *testing.T) {
	dir := t.TempDir()
	ev := ambient.PodEvent{Command: ambient.CommandAdd, SandboxID: "sb-2", PodUID: "u2", PodName: "web", PodNamespace: "shop", Netns: "/var/run/netns/x", IPs: []string{"10.0.0.2"}}
	if err := Spool(dir, ev); err != nil {
		t.Fatal(err)
	}
	entries, err := ListAdds(dir)
	if err != nil || len(entries) != 1 || entries[0].Err != nil {
		t.Fatalf("ListAdds = %+v, %v", entries, err)
	}
	if diff := cmp.Diff(&ev, entries[0].Event); diff != "" {
		t.Errorf("ListAdds (-want +got):\n%s", diff)
	}
	if entries, _ := List(dir); len(entries) != 1 || entries[0].Err == nil {
		t.Errorf("List read an ADD as a DEL: %+v", entries)
	}
}

// TestHeartbeat: touched at a time, read back as that time; missing and
// special files are errors, never a block.
func TestHeartbeat(t *testing.T) {
	dir := t.TempDir()
	p := InDir(filepath.Join(dir, "sub")).Heartbeat()
	if _, err := LastAlive(p); err == nil {
		t.Error("missing heartbeat read")
	}
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, at := range []time.Time{t0, t0.Add(time.Minute)} {
		if err := TouchHeartbeat(p, at); err != nil {
			t.Fatal(err)
		}
		if got, err := LastAlive(p); err != nil || !got.Equal(at) {
			t.Errorf("LastAlive = %v, %v; want %v", got, err, at)
		}
	}
	if err := RemoveHeartbeat(p); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LastAlive(p); err == nil {
		t.Error("FIFO heartbeat read")
	}
	if err := RemoveHeartbeat(p); err != nil {
		t.Fatal(err)
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
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo.json"), 0o600); err != nil {
		t.Fatal(err)
	}
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
	if len(entries) != 7 {
		t.Fatalf("got %d entries, want 7 (temp file skipped): %+v", len(entries), entries)
	}
	for _, e := range entries {
		if e.Err == nil {
			t.Errorf("%s accepted as %+v", e.Path, e.Event)
		}
	}
}

// TestUninstallMarker: the marker is written (state directory created
// root-only), found, replaced, and cleared once; clearing none is fine.
func TestUninstallMarker(t *testing.T) {
	l := ForSocket(filepath.Join(t.TempDir(), "run", "agent.sock")).WithStateDir(filepath.Join(t.TempDir(), "state", "nested"))
	if had, err := ClearUninstalling(l); had || err != nil {
		t.Fatalf("clear with none: %v, %v", had, err)
	}
	for _, note := range []string{"first", "second"} {
		if err := MarkUninstalling(l, note); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(l.Uninstalling())
		if err != nil || string(b) != note+"\n" {
			t.Fatalf("marker holds %q, %v", b, err)
		}
	}
	if fi, err := os.Stat(l.StateDir()); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("state dir: %v, %v; want 0700", fi, err)
	}
	if fi, err := os.Stat(l.Uninstalling()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("marker: %v, %v; want 0600", fi, err)
	}
	if had, err := ClearUninstalling(l); !had || err != nil {
		t.Fatalf("clear: %v, %v", had, err)
	}
	if _, err := os.Lstat(l.Uninstalling()); !os.IsNotExist(err) {
		t.Errorf("marker left after clear: %v", err)
	}
}

// The spools are the plugin's files the agent reads: whatever one holds,
// an entry it takes is a valid event of the spool's command, and writing
// that event again reads back the same.
func FuzzReadSpoolEntry(f *testing.F) {
	fuzzseed.Add(f, "FuzzReadSpoolEntry")
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "x"+spoolSuffix)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		for _, cmd := range []ambient.Command{ambient.CommandDel, ambient.CommandAdd} {
			ev, err := readEntry(p, cmd)
			if err != nil {
				continue
			}
			if ev.Command != cmd {
				t.Fatalf("the %s spool took a %s", cmd, ev.Command)
			}
			if err := ev.Validate(); err != nil {
				t.Fatalf("took an invalid event: %v", err)
			}
			again := filepath.Join(dir, "again")
			if err := Spool(again, *ev); err != nil {
				continue // a sandbox id no plugin could have spooled
			}
			back, err := readEntry(filepath.Join(again, ev.SandboxID+spoolSuffix), cmd)
			if err != nil || !cmp.Equal(back, ev) {
				t.Fatalf("round trip: %+v, %v; want %+v", back, err, ev)
			}
			if err := os.RemoveAll(again); err != nil {
				t.Fatal(err)
			}
		}
	})
}
