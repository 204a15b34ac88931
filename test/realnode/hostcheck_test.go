//go:build realnode

package realnode

import (
	"context"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// startNodeTest is how every real-node test begins: root and the node's
// tools are required, what an earlier killed run left is reaped (it is not
// this run's to report), and the host's state is recorded. The check that
// the host is as the test found it runs as the test's last cleanup, after
// every node's Down.
func startNodeTest(t *testing.T) (context.Context, *lineWriter, Tools) {
	t.Helper()
	testnet.RequireRoot(t)
	tools, err := FindTools()
	if err != nil {
		testnet.Missing(t, err.Error())
	}
	ctx := context.Background()
	out := &lineWriter{t: t}
	if err := Reap(ctx, out); err != nil {
		t.Fatal(err)
	}
	before, err := TakeHostSnapshot()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		after, err := TakeHostSnapshot()
		if err != nil {
			t.Error(err)
			return
		}
		diff := after.Diff(before)
		if rel := Relevant(diff); len(rel) > 0 {
			t.Errorf("the host is not as the test found it:\n%s", strings.Join(rel, "\n"))
		}
		if len(diff) > 0 {
			t.Logf("host changes not attributable to the node (other programs on this machine):\n%s", strings.Join(diff, "\n"))
		}
	})
	return ctx, out, tools
}

// testNoEgress fails if the node's egress guard counted a connection
// attempt off the machine.
func testNoEgress(n *Node) func(*testing.T) {
	return func(t *testing.T) {
		hits, err := n.GuardHits()
		if err != nil {
			t.Fatal(err)
		}
		if len(hits) > 0 {
			t.Errorf("the egress guard counted connection attempts off the machine: %v", hits)
		}
	}
}
