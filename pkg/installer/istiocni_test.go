package installer

import (
	"errors"
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
