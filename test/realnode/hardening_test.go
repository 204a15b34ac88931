//go:build realnode

package realnode

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/test/lib/nodefilemodes"
)

// The chart's defaults on containerd: the agent runs under the runtime's
// default seccomp profile, with no_new_privs, exactly the capabilities
// docs/deploy.md lists and a read-only root, and everything it wrote on
// the node is as private as docs/deploy.md says. The rest of the test
// (capture, alerts) proves the agent works so confined.
func (e *e2e) testConfined(t *testing.T) {
	agent := e.oneAgent(t)
	pid := e.containerPID(t, agent.Namespace, agent.Name)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	field := func(name string) string {
		for l := range strings.SplitSeq(string(status), "\n") {
			if v, ok := strings.CutPrefix(l, name+":"); ok {
				return strings.TrimSpace(v)
			}
		}
		return ""
	}
	// 2: SECCOMP_MODE_FILTER, a profile is loaded (0 is Unconfined).
	if got := field("Seccomp"); got != "2" {
		t.Errorf("agent Seccomp: %q, want 2 (a filter)", got)
	}
	if got := field("NoNewPrivs"); got != "1" {
		t.Errorf("agent NoNewPrivs: %q, want 1", got)
	}
	var want uint64
	for _, c := range []uint{unix.CAP_NET_ADMIN, unix.CAP_NET_RAW, unix.CAP_SYS_ADMIN, unix.CAP_SYS_PTRACE, unix.CAP_DAC_READ_SEARCH} {
		want |= 1 << c
	}
	for _, set := range []string{"CapEff", "CapBnd"} {
		if got, err := strconv.ParseUint(field(set), 16, 64); err != nil || got != want {
			t.Errorf("agent %s: %q, want %016x", set, field(set), want)
		}
	}
	mounts, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	rootRO := false
	for l := range strings.SplitSeq(string(mounts), "\n") {
		// id parent major:minor root mountpoint options ...
		if f := strings.Fields(l); len(f) > 5 && f[4] == "/" {
			rootRO = strings.HasPrefix(f[5], "ro,") || f[5] == "ro"
		}
	}
	if !rootRO {
		t.Errorf("the agent's root filesystem is not mounted read-only")
	}

	for _, p := range nodefilemodes.Problems(nodefilemodes.Node{
		Private:    []string{e.n.AgentSocketDir(), e.n.AgentStateDir()},
		ConfDir:    filepath.Dir(e.n.CNIConfFile),
		PluginType: installer.DefaultPluginName,
		// test/realnode writes the primary's conflist 0644.
		Primary: e.n.CNIConfFile, PrimaryMode: 0o644,
		Binaries: []string{filepath.Join(e.n.CNIBinDir, installer.DefaultPluginName)},
	}) {
		t.Error(p)
	}
}
