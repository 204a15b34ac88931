package iptables

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	dt "github.com/ambient-cni/ambient-cni/test/lib/dataplanetest"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The traffic scenarios of both backends live in pkg/rulesbackend (one
// matrix); the tests here cover what is specific to iptables.

// requireBackend skips unless b's binaries (and what the tests use) exist.
func requireBackend(t *testing.T, b Backend) {
	t.Helper()
	testnet.RequireRoot(t)
	cmds := []string{"ip"}
	for _, f := range ruleset.Families {
		cmds = append(cmds, b.Cmd(f), b.SaveCmd(f), b.RestoreCmd(f))
	}
	if b == BackendNFT {
		cmds = append(cmds, "nft")
	}
	testnet.RequireCommands(t, cmds...)
}

func testLogger(t *testing.T) *slog.Logger { return dt.Logger(t) }

// run runs a command inside the namespace and returns its stdout.
func run(t *testing.T, netnsPath string, name string, args ...string) string {
	t.Helper()
	return dt.Run(t, netnsPath, name, args...)
}

// snapshot is everything an apply or removal may change, as text.
func snapshot(t *testing.T, netnsPath string) string {
	t.Helper()
	return dt.Snapshot(t, netnsPath)
}

// hostSnapshot adds the ipsets to snapshot.
func hostSnapshot(t *testing.T, path string) string {
	t.Helper()
	return strings.Join([]string{dt.Snapshot(t, path), dt.Run(t, path, "ipset", "list", "-n")}, "== ipset list -n\n")
}
