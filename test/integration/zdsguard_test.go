package integration

import (
	"bytes"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// zdsHolder is another agent serving ztunnel's socket: it accepts
// ztunnel's connections and keeps them, as istio-cni's agent does.
type zdsHolder struct {
	ln    *net.UnixListener
	mu    sync.Mutex
	conns []net.Conn
	done  chan struct{}
}

func holdZDS(t *testing.T, path string) *zdsHolder {
	t.Helper()
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	// Stopped as a killed process stops: its socket file stays.
	ln.SetUnlinkOnClose(false)
	h := &zdsHolder{ln: ln, done: make(chan struct{})}
	go func() { // owner: close, which waits for it
		defer close(h.done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.mu.Lock()
			h.conns = append(h.conns, c)
			h.mu.Unlock()
		}
	}()
	t.Cleanup(h.close)
	return h
}

func (h *zdsHolder) close() {
	_ = h.ln.Close()
	<-h.done
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.conns {
		_ = c.Close()
	}
	h.conns = nil
}

// TestZtunnelSocketServedByAnotherAgent: another agent listens on
// ztunnel's socket when this one starts (istio-cni's, say, as a standalone
// Multus network on OpenShift, where no chain entry shows it). The agent
// binds nothing over it, so ztunnel stays with the other; it says why in a
// Warning Event on its pod and is not ready. Once the other stops (its
// socket file left behind), the agent binds the socket, ztunnel comes to
// it with the node's captured pod, and a new pod is enrolled.
func TestZtunnelSocketServedByAnotherAgent(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "before", nil, nil))
	n.waitEnrolled(waitLong, p)

	n.stopDaemon()
	h := holdZDS(t, n.cfg.ZDSSocket)
	var held syscall.Stat_t
	if err := syscall.Stat(n.cfg.ZDSSocket, &held); err != nil {
		t.Fatal(err)
	}
	n.opts.NoWaitReady = true
	n.startDaemon()
	n.waitDebugSocket()

	ev := n.agentEvent("ZtunnelSocketTaken")
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, n.cfg.ZDSSocket) {
		t.Errorf("event %s %s: %q; want a Warning naming %s", ev.Type, ev.Reason, ev.Message, n.cfg.ZDSSocket)
	}
	t.Logf("event: %s", ev.Message)
	if code, body := n.get("/readyz"); code == http.StatusOK {
		t.Errorf("/readyz while another agent serves ztunnel = %d %s, want not ready", code, body)
	}
	var now syscall.Stat_t
	if err := syscall.Stat(n.cfg.ZDSSocket, &now); err != nil || now.Ino != held.Ino {
		t.Fatalf("ztunnel's socket was replaced while another agent served it (inode %d, was %d; %v)", now.Ino, held.Ino, err)
	}
	if on, err := unixsock.Listened(n.cfg.ZDSSocket); err != nil || !on {
		t.Fatalf("the other agent's socket: listened %v, %v", on, err)
	}

	h.close()
	poll.Within(t, waitLong, "the agent ready once the other agent stopped", func() bool {
		code, _ := n.get("/readyz")
		return code == http.StatusOK
	})
	if err := syscall.Stat(n.cfg.ZDSSocket, &now); err != nil || now.Ino == held.Ino {
		t.Fatalf("ztunnel's socket not bound by the agent (inode %d, the other's %d; %v)", now.Ino, held.Ino, err)
	}
	poll.Within(t, waitLong, "ztunnel back on the agent, with the captured pod", func() bool {
		_, ok := n.zt.Workload(string(p.Obj.UID))
		return n.zt.Ready() && ok
	})
	conf, err := os.ReadFile(filepath.Join(n.confDir, simnode.PrimaryConf))
	if err != nil || !bytes.Contains(conf, []byte(`"`+cnibin.PluginName+`"`)) {
		t.Fatalf("the plugin is not chained once the agent serves (%v):\n%s", err, conf)
	}
	q := n.runPod(podSpec(shop, "after", nil, nil))
	n.waitEnrolled(waitLong, q)
}
