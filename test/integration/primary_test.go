package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// TestExclusivePrimaryReported: a primary that writes its config again,
// without our entry, each time the directory changes (Cilium with
// cni.exclusive=true) gets the entry back every time; after the third
// removal within a minute the agent says what to set, in a Warning Event
// on its own pod and in /readyz, which fails meanwhile.
func TestExclusivePrimaryReported(t *testing.T) {
	n := newNode(t, nodeOptions{})
	path := filepath.Join(n.confDir, simnode.PrimaryConf)
	for i := range 4 {
		if err := os.WriteFile(path, n.sim.Primary, 0o644); err != nil {
			t.Fatal(err)
		}
		poll.Within(t, waitLong, fmt.Sprintf("the entry back after removal %d", i+1), func() bool {
			b, err := os.ReadFile(path)
			return err == nil && bytes.Contains(b, []byte(`"`+cnibin.PluginName+`"`))
		})
	}
	ev := n.agentEvent("PrimaryCNIRemovesEntry")
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, "cni.exclusive=false") || !strings.Contains(ev.Message, simnode.PrimaryConf) {
		t.Errorf("event %s %s: %q; want a Warning naming the file and Cilium's setting", ev.Type, ev.Reason, ev.Message)
	}
	t.Logf("event: %s %s: %s", ev.Type, ev.Reason, ev.Message)
	code, body := n.get("/readyz")
	if code == http.StatusOK || !strings.Contains(body, "cni.exclusive=false") {
		t.Errorf("/readyz while the primary keeps removing the entry: %d %s", code, body)
	}
}
