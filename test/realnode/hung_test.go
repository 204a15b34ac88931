//go:build realnode

package realnode

import (
	"context"
	"testing"
)

// The agent hangs (SIGSTOP: its sockets accept, nothing answers). The
// plugin does not wait on it for a pod the API server shows outside the
// mesh: that pod starts, uncaptured, after the plugin's slow-agent wait; a
// pod of an enabled namespace is refused on the API server's word once the
// plugin's timeout has passed, and starts captured when the agent runs
// again (SIGCONT, or kubelet's liveness restart, whichever comes first).
func (e *e2e) testAgentHung(t *testing.T) {
	ctx := context.Background()
	suffix := randHex(4)
	plainNS, meshNS := "hung-plain-"+suffix, "hung-mesh-"+suffix
	e.namespace(t, plainNS, false)
	e.namespace(t, meshNS, true)
	resume := e.freezeAgent(t)

	plain := e.create(t, plainNS, "starts")
	mesh := e.create(t, meshNS, "waits")
	ready, err := e.n.WaitPodReady(ctx, plainNS, plain.Name)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := e.n.released(ctx, ready); !ok {
		t.Errorf("%s/%s, started while the agent hangs: %v", plainNS, plain.Name, err)
	}
	e.waitSandboxError(t, mesh, "the API server shows the pod must be captured")

	resume()
	ready, err = e.n.WaitPodReady(ctx, meshNS, mesh.Name)
	if err != nil {
		t.Fatal(err)
	}
	e.mustCaptured(t, ready)
}
