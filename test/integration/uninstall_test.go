package integration

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// TestUninstallTellsZtunnelAndLeavesNothing: an agent that stops with no
// DaemonSet (an uninstall) releases every pod and ztunnel gets a Del for
// each on the connection it was added on, before the ZDS socket closes;
// the node's directories are left as they were: the ones the agent
// created are gone with the files in them, a directory that existed keeps
// its mode and whatever else it holds.
func TestUninstallTellsZtunnelAndLeavesNothing(t *testing.T) {
	n := newNode(t, nodeOptions{}) // no DaemonSet: stopping uninstalls
	shop := n.namespace("shop", ambientLabel)
	a := n.runPod(podSpec(shop, "a", nil, nil))
	b := n.runPod(podSpec(shop, "b", nil, nil))
	n.waitEnrolled(waitLong, a, b)
	agentDir, ztDir := filepath.Dir(n.cfg.AgentSocket), filepath.Dir(n.cfg.ZDSSocket)
	for _, d := range []string{agentDir, ztDir} {
		if _, err := os.Stat(d); err != nil {
			t.Fatalf("the agent's directory %s: %v", d, err)
		}
	}

	n.stopDaemon()
	msgs := n.zt.Messages()
	for _, p := range []string{string(a.Obj.UID), string(b.Obj.UID)} {
		add := slices.IndexFunc(msgs, func(m ztunnel.Message) bool {
			return m.UID == p && (m.Kind == ztunnel.KindAdd) && m.AckError == ""
		})
		if add < 0 {
			t.Fatalf("ztunnel never got pod %s: %+v", p, msgs)
		}
		conn := msgs[add].Conn
		if !slices.ContainsFunc(msgs[add:], func(m ztunnel.Message) bool {
			return m.UID == p && m.Kind == ztunnel.KindDel && m.Conn == conn && m.AckError == ""
		}) {
			t.Errorf("pod %s: no Del on ztunnel connection %d before it closed: %+v", p, conn, msgs)
		}
	}
	if n.hasRules(a) || n.hasRules(b) {
		t.Error("a released pod keeps its rules")
	}
	// The agent created both directories (the node's temp dir had
	// neither): they and everything in them (snapshot, spool, records,
	// state, ledger, sockets) are gone.
	for _, d := range []string{agentDir, ztDir} {
		if des, err := os.ReadDir(d); !os.IsNotExist(err) {
			t.Errorf("directory %s left by the uninstall: %v, %v", d, names(des), err)
		}
	}

	// A directory that existed before the agent (kubelet's hostPath does
	// that) keeps its mode and what else it holds; the agent's files go.
	if err := os.Mkdir(agentDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(agentDir, 0o755); err != nil {
		t.Fatal(err)
	}
	theirs := filepath.Join(agentDir, "theirs")
	if err := os.WriteFile(theirs, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	n.startDaemon()
	if fi, err := os.Stat(agentDir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("running agent's directory: %v, %v; want 0700", fi, err)
	}
	n.stopDaemon()
	fi, err := os.Stat(agentDir)
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("a directory that existed: %v, %v; want it kept with mode 0755", fi, err)
	}
	des, err := os.ReadDir(agentDir)
	if err != nil {
		t.Fatal(err)
	}
	if got := names(des); !slices.Equal(got, []string{"theirs"}) {
		t.Errorf("a directory that existed holds %v after the uninstall, want only what was there (theirs)", got)
	}
	if _, err := os.Stat(n.cfg.Layout().NodeDirsLedger()); !os.IsNotExist(err) {
		t.Errorf("ledger left: %v", err)
	}
}

func names(des []os.DirEntry) []string {
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	return out
}
