package installer

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// istioChained is a primary config into which istio-cni has already
// chained itself (its entry as istio-cni's chart writes it, abridged).
const istioChained = `{
  "cniVersion": "1.0.0",
  "name": "containerd-net",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]]}},
    {"type": "istio-cni", "plugin_log_level": "info", "cni_agent_run_dir": "/var/run/istio-cni", "ambient_enabled": true}
  ]
}
`

// With istio-cni in the primary chain the installer chains nothing next to
// it, leaves the file as it was, stays not ready with a message saying what
// to do, and reports the refusal once, however many passes retry it.
func TestRefusesToChainNextToIstioCNI(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-containerd-net.conflist", istioChained, 0o644)
	var refused []error
	i := e.installer(t, func(c *Config) { c.OnRefused = func(err error) { refused = append(refused, err) } })

	for range 3 {
		if err := i.Install(t.Context()); !errors.Is(err, ErrIstioCNIChained) {
			t.Fatalf("Install: %v, want ErrIstioCNIChained", err)
		}
	}
	if got := e.read(t, "10-containerd-net.conflist"); got != istioChained {
		t.Errorf("the primary config was changed:\n%s", got)
	}
	err := i.Check()
	if !errors.Is(err, ErrIstioCNIChained) {
		t.Fatalf("Check: %v, want ErrIstioCNIChained", err)
	}
	for _, want := range []string{"10-containerd-net.conflist", "uninstall istio-cni"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Check's message %q does not mention %q", err, want)
		}
	}
	if len(refused) != 1 || !errors.Is(refused[0], ErrIstioCNIChained) {
		t.Errorf("OnRefused calls: %v, want one with ErrIstioCNIChained", refused)
	}

	// Once istio-cni is gone, the next pass chains and the agent is ready.
	e.write(t, "10-containerd-net.conflist", bridgeList, 0o644)
	if err := i.Install(t.Context()); err != nil {
		t.Fatalf("Install after istio-cni left: %v", err)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check after istio-cni left: %v", err)
	}
}

// A plugin type of istio-cni for our own entry (a drop-in under the old
// name) is ours, not a conflict.
func TestOwnTypeIstioCNIIsNoConflict(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-containerd-net.conflist", bridgeList, 0o644)
	i := e.installer(t, func(c *Config) { c.PluginName = IstioCNIType })
	if err := i.Install(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err != nil {
		t.Fatal(err)
	}
}

// OnOutcome reports what istio-cni counts as istio_cni_installs_total: a
// success each time the plugin became installed (first install, repair;
// not a pass that finds everything in place), a failure per failed pass.
func TestOutcomes(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	var got []Outcome
	i := e.installer(t, func(c *Config) { c.OnOutcome = func(o Outcome) { got = append(got, o) } })
	for range 2 {
		if err := i.Install(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	// Our entry removed: the repair is another success.
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	if err := i.Install(t.Context()); err != nil {
		t.Fatal(err)
	}
	// istio-cni chained in the primary: the config cannot be chained.
	e.write(t, "10-bridge.conflist", istioChained, 0o644)
	if err := i.Install(t.Context()); !errors.Is(err, ErrIstioCNIChained) {
		t.Fatalf("Install: %v, want ErrIstioCNIChained", err)
	}
	if want := []Outcome{OutcomeInstalled, OutcomeInstalled, OutcomeConfigFailed}; !slices.Equal(got, want) {
		t.Errorf("outcomes %v, want %v", got, want)
	}

	// A plugin binary gone after start: the copy fails.
	e2 := newEnv(t)
	e2.write(t, "10-bridge.conflist", bridgeList, 0o644)
	src := filepath.Join(t.TempDir(), "plugin")
	if err := os.WriteFile(src, e2.srcBytes, 0o755); err != nil {
		t.Fatal(err)
	}
	got = nil
	i2 := e2.installer(t, func(c *Config) {
		c.PluginBinary = src
		c.OnOutcome = func(o Outcome) { got = append(got, o) }
	})
	if err := os.Remove(src); err != nil {
		t.Fatal(err)
	}
	if err := i2.Install(t.Context()); err == nil {
		t.Fatal("Install with a missing plugin binary succeeded")
	}
	if want := []Outcome{OutcomeCopyFailed}; !slices.Equal(got, want) {
		t.Errorf("outcomes %v, want %v", got, want)
	}
}
