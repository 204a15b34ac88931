package installer

import (
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// The takeover from istio-cni: refused while istio-cni's node agent
// answers on its plugin event socket, then, once nothing does, istio-cni's
// entry is replaced by ours in one write, and an uninstall puts back the
// primary's config without istio-cni.
func TestTakesOverFromIstioCNIOnceItsAgentIsGone(t *testing.T) {
	e := newEnv(t)
	run := t.TempDir()
	// istio-cni's entry names the run directory its plugin uses.
	chained := strings.Replace(istioChained, "/var/run/istio-cni", run, 1)
	e.write(t, "10-containerd-net.conflist", chained, 0o644)
	sock := filepath.Join(run, ambient.IstioCNIEventSocket)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	// The listener's file stays behind when it closes, as a killed
	// agent's does: a refused connection is gone too.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	var refused []error
	i := e.installer(t, func(c *Config) {
		c.IstioCNIGone = IstioCNIAgentGone(run)
		c.OnRefused = func(err error) { refused = append(refused, err) }
	})

	err = i.Install(t.Context())
	if !errors.Is(err, ErrIstioCNIChained) || !strings.Contains(err.Error(), "still answers") {
		t.Fatalf("Install while istio-cni's agent answers: %v, want ErrIstioCNIChained saying it still answers", err)
	}
	if got := e.read(t, "10-containerd-net.conflist"); got != chained {
		t.Fatalf("the config was changed while istio-cni's agent answers:\n%s", got)
	}
	if len(refused) != 1 {
		t.Errorf("OnRefused calls: %v, want one", refused)
	}

	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("the socket file should stay: %v", err)
	}
	if err := i.Install(t.Context()); err != nil {
		t.Fatalf("Install once istio-cni's agent is gone: %v", err)
	}
	got := e.read(t, "10-containerd-net.conflist")
	list, err := libcni.ConfListFromBytes([]byte(got))
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	if strings.Join(types, ",") != "bridge,"+DefaultPluginName {
		t.Fatalf("plugins after the takeover: %v, want bridge then ours:\n%s", types, got)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check after the takeover: %v", err)
	}

	// The uninstall restores the primary's config as istio-cni found it,
	// without istio-cni: its agent is gone, its entry would fail pods.
	if err := i.Shutdown(t.Context(), false); err != nil {
		t.Fatal(err)
	}
	want, err := Unchain([]byte(chained), IstioCNIType)
	if err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "10-containerd-net.conflist"); got != string(want) {
		t.Errorf("after the uninstall:\n%s\nwant:\n%s", got, want)
	}
}

// No socket at all (istio-cni's run directory empty or never made) is
// gone too; a socket that cannot be judged is not, nor an entry whose
// plugin uses another directory than the one looked at.
func TestIstioCNIAgentGone(t *testing.T) {
	d := t.TempDir()
	if err := IstioCNIAgentGone(d)(d); err != nil {
		t.Errorf("no socket: %v, want gone", err)
	}
	if err := IstioCNIAgentGone(d)("/var/run/istio-cni"); err == nil || !strings.Contains(err.Error(), "migration.fromIstioCNI.runDir") {
		t.Errorf("an entry with another run directory: %v, want an error naming the value", err)
	}
	f := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// A file as the run directory: ENOTDIR, which says nothing.
	if err := IstioCNIAgentGone(f)(f); err == nil {
		t.Error("a run directory that is a file: gone, want an error")
	}
}

// The takeover looks at the run directory istio-cni's entry names; with
// none named, istio-cni's default.
func TestIstioRunDirs(t *testing.T) {
	dirs, err := istioRunDirs([]byte(istioChained))
	if err != nil || len(dirs) != 1 || dirs[0] != "/var/run/istio-cni" {
		t.Errorf("run dirs %v (%v), want [/var/run/istio-cni]", dirs, err)
	}
	none := strings.Replace(istioChained, `"cni_agent_run_dir": "/var/run/istio-cni", `, "", 1)
	dirs, err = istioRunDirs([]byte(none))
	if err != nil || len(dirs) != 1 || dirs[0] != IstioCNIDefaultRunDir {
		t.Errorf("run dirs without cni_agent_run_dir %v (%v), want the default", dirs, err)
	}
}

// Without IstioCNIGone the refusal stands, as before.
func TestNoTakeoverUnlessAsked(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-containerd-net.conflist", istioChained, 0o644)
	i := e.installer(t, nil)
	if err := i.Install(t.Context()); !errors.Is(err, ErrIstioCNIChained) {
		t.Fatalf("Install: %v, want ErrIstioCNIChained", err)
	}
}

// istio-cni with istioOwnedCNIConfig leaves the primary's config alone and
// the runtime loads its copy, 02-istio-cni.conflist, the primary's list
// with istio-cni's entry added. While its agent answers, nothing changes;
// once it is gone, ours is chained into the primary's own config and the
// copy removed after, so the runtime goes from istio-cni's copy (failing
// pods without its agent) straight to the primary's list with ours. A
// config with istio-cni chained that is no copy of the next one is the
// primary, taken over in place as before.
func TestTakesOverFromIstioCNIsOwnedConfig(t *testing.T) {
	const primary = `{"cniVersion": "1.0.0", "name": "containerd-net", "plugins": [
  {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]]}}]}`
	e := newEnv(t)
	run := t.TempDir()
	e.write(t, "10-containerd-net.conflist", primary, 0o644)
	istioCopy := strings.Replace(istioChained, "/var/run/istio-cni", run, 1)
	e.write(t, "02-istio-cni.conflist", istioCopy, 0o600)
	ln, err := net.Listen("unix", filepath.Join(run, ambient.IstioCNIEventSocket))
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	i := e.installer(t, func(c *Config) { c.IstioCNIGone = IstioCNIAgentGone(run) })

	err = i.Install(t.Context())
	if !errors.Is(err, ErrIstioCNIChained) || !strings.Contains(err.Error(), "02-istio-cni.conflist") {
		t.Fatalf("Install while istio-cni's agent answers: %v, want ErrIstioCNIChained naming its copy", err)
	}
	if err := i.IstioCNIHolds(); err == nil {
		t.Error("IstioCNIHolds while istio-cni's agent answers: nil")
	}
	if e.read(t, "02-istio-cni.conflist") != istioCopy || e.read(t, "10-containerd-net.conflist") != primary {
		t.Fatal("a config was changed while istio-cni's agent answers")
	}

	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if err := i.IstioCNIHolds(); err != nil {
		t.Errorf("IstioCNIHolds once istio-cni's agent is gone: %v", err)
	}
	if err := i.Install(t.Context()); err != nil {
		t.Fatalf("Install once istio-cni's agent is gone: %v", err)
	}
	if _, err := os.Stat(e.path("02-istio-cni.conflist")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("istio-cni's copy is still there (%v)", err)
	}
	if name, ours := e.runtimeChoice(t); name != "10-containerd-net.conflist" || !ours {
		t.Errorf("the runtime loads %s (ours in it: %v), want the primary's with ours", name, ours)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check after the takeover: %v", err)
	}

	// The primary named (cni.confName): istio-cni's copy, which the
	// runtime loads first, holds the node all the same, and goes too.
	e3 := newEnv(t)
	e3.write(t, "10-containerd-net.conflist", primary, 0o644)
	e3.write(t, "02-istio-cni.conflist", istioCopy, 0o600)
	_ = os.Remove(filepath.Join(run, ambient.IstioCNIEventSocket))
	ln, err = net.Listen("unix", filepath.Join(run, ambient.IstioCNIEventSocket))
	if err != nil {
		t.Fatal(err)
	}
	i3 := e3.installer(t, func(c *Config) {
		c.IstioCNIGone = IstioCNIAgentGone(run)
		c.PrimaryConfName = "10-containerd-net.conflist"
	})
	if err := i3.IstioCNIHolds(); err == nil || !strings.Contains(err.Error(), "02-istio-cni.conflist") {
		t.Errorf("IstioCNIHolds with the primary named, istio-cni's agent answering: %v, want its copy named", err)
	}
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if err := i3.Install(t.Context()); err != nil {
		t.Fatal(err)
	}
	if name, ours := e3.runtimeChoice(t); name != "10-containerd-net.conflist" || !ours {
		t.Errorf("with the primary named, the runtime loads %s (ours in it: %v), want the primary's with ours", name, ours)
	}

	// Not a copy: another network with istio-cni chained, sorting first,
	// is the primary, whether or not its plugins are the next one's.
	e2 := newEnv(t)
	other := strings.Replace(istioCopy, "containerd-net", "other", 1)
	e2.write(t, "02-other.conflist", other, 0o644)
	e2.write(t, "10-containerd-net.conflist", primary, 0o644)
	i2 := e2.installer(t, func(c *Config) { c.IstioCNIGone = IstioCNIAgentGone(run) })
	if err := i2.Install(t.Context()); err != nil {
		t.Fatal(err)
	}
	if name, ours := e2.runtimeChoice(t); name != "02-other.conflist" || !ours {
		t.Errorf("the runtime loads %s (ours in it: %v), want 02-other.conflist taken over in place", name, ours)
	}
	if e2.read(t, "10-containerd-net.conflist") != primary {
		t.Error("the config after the primary was changed")
	}
}

// TestWithdrawLeavesTheInstallerUsable: the next agent, standing by
// behind istio-cni, withdraws the entry a give-back left chained in front
// of istio-cni's: ours and the binary go, istio-cni's stays; a second
// Withdraw finds nothing to do; and the installer still installs (the
// node switched back to us), which Shutdown's installer refuses.
func TestWithdrawLeavesTheInstallerUsable(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	if err := e.installer(t, nil).Install(t.Context()); err != nil {
		t.Fatal(err)
	}
	var list map[string]any
	if err := json.Unmarshal([]byte(e.read(t, "10-bridge.conflist")), &list); err != nil {
		t.Fatal(err)
	}
	list["plugins"] = append(list["plugins"].([]any), map[string]any{"type": IstioCNIType, "cni_agent_run_dir": IstioCNIDefaultRunDir})
	b, err := json.Marshal(list)
	if err != nil {
		t.Fatal(err)
	}
	e.write(t, "10-bridge.conflist", string(b), 0o644)

	i := e.installer(t, nil)
	took, err := i.Withdraw(t.Context())
	if err != nil || !took {
		t.Fatalf("Withdraw = %v, %v; want true, nil", took, err)
	}
	got := e.read(t, "10-bridge.conflist")
	if strings.Contains(got, `"`+testType+`"`) || !strings.Contains(got, `"`+IstioCNIType+`"`) {
		t.Errorf("after Withdraw, want istio-cni's entry alone:\n%s", got)
	}
	if _, err := os.Stat(filepath.Join(e.bin, testType)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the binary is still there: %v", err)
	}
	if took, err := i.Withdraw(t.Context()); err != nil || took {
		t.Errorf("second Withdraw = %v, %v; want false, nil", took, err)
	}
	// istio-cni gone again, its entry with it.
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	if err := i.Install(t.Context()); err != nil {
		t.Fatalf("Install after Withdraw: %v", err)
	}
	if !strings.Contains(e.read(t, "10-bridge.conflist"), `"`+testType+`"`) {
		t.Error("Install after Withdraw chained nothing")
	}
}
