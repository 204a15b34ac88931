package integration

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/nodefilemodes"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
)

// Everything a whole install writes on the node is as private as
// docs/deploy.md's node files table says (nodefilemodes): the chained
// conflist, the plugin binary, the plugin's credential (and the fallback
// binary where the image has one), the agent's sockets, snapshot, heartbeat, capture records,
// ledger and installer state, and a DEL the plugin spooled while the agent
// was down. The files of an older version left group- and world-readable
// are closed by the next agent.
func TestNodeFileModes(t *testing.T) {
	n := newNode(t, nodeOptions{PluginCredential: true, Upgrade: true})
	ctx := context.Background()
	// The plugin's token is bound to the Node object.
	if _, err := n.env.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.env.Client.CoreV1().Nodes().Delete(context.Background(), n.Name, metav1.DeleteOptions{}) })
	layout := n.cfg.Layout()
	poll.Until(t, "the plugin's credential written", func() bool {
		_, err := os.Stat(layout.PluginCredential())
		return err == nil
	})
	shop := n.namespace("shop", ambientLabel)
	p := n.runPod(podSpec(shop, "p", nil, nil))
	n.waitEnrolled(waitLong, p)
	for _, f := range []string{layout.Snapshot(), layout.StateSnapshot(), layout.Heartbeat(), layout.NodeDirsLedger(), layout.InstallerState()} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("expected node file: %v", err)
		}
	}
	if ents, err := os.ReadDir(layout.Records()); err != nil || len(ents) == 0 {
		t.Errorf("no capture record: %v", err)
	}
	check := func(when string) {
		t.Helper()
		for _, p := range nodefilemodes.Problems(nodefilemodes.Node{
			Private:    []string{layout.Dir(), layout.StateDir()},
			ConfDir:    n.confDir,
			PluginType: cnibin.PluginName,
			// simnode writes the primary's conflist 0644.
			Primary: filepath.Join(n.confDir, simnode.PrimaryConf), PrimaryMode: 0o644,
			Binaries: []string{filepath.Join(n.binDir, n.cfg.PluginType)},
		}) {
			t.Errorf("%s: %s", when, p)
		}
	}
	check("installed, a pod captured")

	// The plugin spools the DEL it cannot hand the agent.
	n.stopDaemon()
	if err := n.kube.CNI.DelNetworkList(ctx, n.kube.Conf, rt(p)); err != nil {
		t.Fatalf("DEL while the agent is down: %v", err)
	}
	if spooled, _ := nodefiles.List(layout.DelSpool()); len(spooled) != 1 {
		t.Fatalf("spooled DELs: %+v", spooled)
	}
	check("a DEL spooled")

	// An older version's files left open to all: the next agent closes
	// what it writes again.
	for _, f := range []string{layout.Snapshot(), layout.StateSnapshot(), layout.PluginCredential(), layout.InstallerState()} {
		if err := os.Chmod(f, 0o644); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	for _, d := range []string{layout.Dir(), layout.StateDir()} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.startDaemon()
	poll.Until(t, "the agent ready again", func() bool { return len(n.d.Ready()) == 0 })
	poll.Until(t, "the replayed DEL handled", func() bool {
		spooled, _ := nodefiles.List(layout.DelSpool())
		return len(spooled) == 0
	})
	check("after an agent restart over an older version's modes")
}
