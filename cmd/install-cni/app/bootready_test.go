package app

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestBootReadyMarker: on a node whose plugin is not yet this agent's,
// chained (a first install), the start marks the boot ready before the
// installer chains it, so the node's CNI STATUS never starts failing
// under a helm install. On a node where it is (after a reboot), the start
// leaves the marker absent, and the agent writes it only once every
// readiness check passes; a later start on the same boot finds it.
func TestBootReadyMarker(t *testing.T) {
	a := testApp(t)
	l := a.layout
	marked := func() bool { return nodefiles.BootReady(l, nodefiles.BootIDFile) == nil }

	if err := a.markBootBeforeChaining(t.Context()); err != nil {
		t.Fatal(err)
	}
	if !marked() {
		t.Fatal("first install: the boot is not marked ready before the plugin is chained")
	}

	// The plugin already chained, this agent's binary in the bin dir: a
	// reboot (the run directory emptied).
	c := a.cfg
	bin, err := os.ReadFile(c.PluginBinary)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{c.CNIBinDir, c.CNIConfDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(c.CNIBinDir, c.PluginType), bin, 0o755); err != nil {
		t.Fatal(err)
	}
	list := `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"` + c.PluginType + `"}]}`
	if err := os.WriteFile(filepath.Join(c.CNIConfDir, "10-k8s.conflist"), []byte(list), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(l.Dir()); err != nil {
		t.Fatal(err)
	}
	if err := a.markBootBeforeChaining(t.Context()); err != nil {
		t.Fatal(err)
	}
	if marked() {
		t.Fatal("after a reboot, the plugin chained: the boot is marked ready before the agent is")
	}

	// Readiness as the agent's pod reports it, made to fail until told.
	var ready atomic.Bool
	var asked atomic.Int32
	a.health = health.New()
	a.health.AddCheck("test", func() error {
		asked.Add(1)
		if !ready.Load() {
			return errors.New("not yet")
		}
		return nil
	})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.markBootReady(ctx) }()
	poll.Until(t, "the agent asking its readiness", func() bool { return asked.Load() >= 3 })
	if marked() {
		t.Fatal("marked before the agent was ready")
	}
	ready.Store(true)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(poll.Deadline):
		t.Fatal("the agent ready, the boot never marked")
	}
	if !marked() {
		t.Fatal("markBootReady returned without marking the boot")
	}
	// A restart on the same boot: nothing to wait for.
	if err := a.markBootReady(t.Context()); err != nil || !marked() {
		t.Fatalf("restart on the same boot: %v, marked %v", err, marked())
	}
}
