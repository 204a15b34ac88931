package integration

import (
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The startup taint leaves the node only once the agent can capture: the
// agent's pod is ready (/readyz) before a ztunnel connects, the taint
// stays until the stand-in acked its snapshot. Other taints are kept. On
// a shutdown where the DaemonSet lives on, the taint comes back only with
// restoreOnShutdown; on an uninstall never (it would keep pods off the
// node for good).
func TestStartupTaint(t *testing.T) {
	for name, tc := range map[string]struct {
		upgrade, restore, wantBack bool
	}{
		"upgrade":                        {upgrade: true},
		"upgrade, restore on shutdown":   {upgrade: true, restore: true, wantBack: true},
		"uninstall, restore on shutdown": {restore: true},
	} {
		t.Run(name, func(t *testing.T) {
			n := newNode(t, nodeOptions{NoStandIn: true, Upgrade: tc.upgrade, StartupTaint: true, StartupTaintOnShutdown: tc.restore})
			failed := n.d.CaptureReady()
			if len(failed) != 1 || !strings.HasPrefix(failed[0], "ztunnel:") {
				t.Fatalf("ready without a ztunnel: CaptureReady() = %q, want only the ztunnel check", failed)
			}
			if startup, other := n.taints(); !startup || !other {
				t.Fatalf("startup taint %v, other taint %v before a ztunnel acked its snapshot; want both", startup, other)
			}
			n.startStandIn(ztunnel.Faults{})
			poll.Within(t, waitLong, "the startup taint to go", func() bool { startup, _ := n.taints(); return !startup })
			if _, other := n.taints(); !other {
				t.Error("the other taint went with ours")
			}
			n.stopDaemon()
			if startup, other := n.taints(); startup != tc.wantBack || !other {
				t.Errorf("after shutdown: startup taint %v (want %v), other taint %v (want true)", startup, tc.wantBack, other)
			}
		})
	}
}
