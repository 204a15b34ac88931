package realnode

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
)

// The node's runtime restarted and rebooted in place: what the lifecycle
// end-to-end tests do to a running node.

// isMountPoint reports whether dir is a mount point in this namespace.
func isMountPoint(dir string) bool {
	mounts, err := mountPoints()
	if err != nil {
		return false
	}
	return slices.ContainsFunc(mounts, func(m mountInfo) bool { return m.Point == dir })
}

// dropProc stops the daemon named name (grace, then SIGKILL) and forgets
// it, so that checkProcs does not count its exit as a failure.
func (n *Node) dropProc(name string, grace time.Duration) {
	p := n.proc(name)
	if p == nil {
		return
	}
	_ = p.Stop(grace)
	n.procs = slices.DeleteFunc(n.procs, func(q *childproc.Proc) bool { return q == p })
}

// RestartContainerd stops containerd (its shims and containers keep
// running, as they do under systemd) and starts it again.
func (n *Node) RestartContainerd(ctx context.Context) error {
	n.dropProc("containerd", 15*time.Second)
	return n.startContainerd(ctx)
}

// RestartKubelet stops kubelet (pods keep running) and starts it again,
// waiting until the Node is Ready.
func (n *Node) RestartKubelet(ctx context.Context) error {
	n.dropProc("kubelet", 15*time.Second)
	return n.startKubelet(ctx)
}

// Reboot simulates a reboot without drain: kubelet and containerd stop,
// every pod process is killed, and what a reboot loses is removed — the
// pod network namespaces, containerd's and runc's state, the agent's and
// ztunnel's run directories (tmpfs on a real node), the pods' cgroups and
// the agent's host rules (kernel state). The node's disk (kubelet's root,
// containerd's root, the CNI config and plugins) stays. Then containerd
// and kubelet start again; kubelet brings the pods back in new sandboxes.
// whileDown, if not nil, runs while the node is down.
func (n *Node) Reboot(ctx context.Context, whileDown func()) error {
	n.dropProc("kubelet", 15*time.Second)
	n.dropProc("containerd", 15*time.Second)
	for _, pid := range pidsWithArg(n.ContainerdSocket) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	for _, c := range kubeletCgroups() {
		if slices.Contains(n.st.Before.Kubepods, c) {
			continue
		}
		if err := removeCgroupTree(c); err != nil {
			return fmt.Errorf("reboot: pod processes: %w", err)
		}
	}
	state := filepath.Join(n.Dir, "containerd", "state")
	if err := unmountUnder(state); err != nil {
		return fmt.Errorf("reboot: %w", err)
	}
	for _, d := range []string{state, filepath.Join(n.Dir, "containerd", "runc"), n.AgentSocketDir(), n.ZtunnelSocketDir()} {
		if err := os.RemoveAll(d); err != nil {
			return fmt.Errorf("reboot: %w", err)
		}
	}
	for _, f := range iptablesFlavours {
		if errs := removeChains(f, []string{iptables.ChainProbeSNAT}, n.st.Before.Chains[f]); len(errs) > 0 {
			return fmt.Errorf("reboot: host rules: %v", errs)
		}
	}
	if sets, err := ipsetNames(); err == nil {
		for _, s := range sets {
			if (s == ruleset.ProbeSetV4 || s == ruleset.ProbeSetV6) && !slices.Contains(n.st.Before.IPSets, s) {
				if out, err := exec.Command("ipset", "destroy", s).CombinedOutput(); err != nil {
					return fmt.Errorf("reboot: ipset destroy %s: %v: %s", s, err, out)
				}
			}
		}
	}
	if !slices.Contains(n.st.Before.NftTables, "inet "+nftables.TableHost) {
		_ = exec.Command("nft", "delete", "table", "inet", nftables.TableHost).Run()
	}
	if whileDown != nil {
		whileDown()
	}
	if err := n.startContainerd(ctx); err != nil {
		return fmt.Errorf("reboot: %w", err)
	}
	// Its CRI service recovers every sandbox it knew before it answers:
	// kubelet exits on a runtime not initialized yet.
	if err := n.poll(ctx, "containerd's CRI service", n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := n.crictl(ctx, "version")
		return err == nil, err
	}); err != nil {
		return fmt.Errorf("reboot: %w", err)
	}
	if err := n.startKubelet(ctx); err != nil {
		return fmt.Errorf("reboot: %w", err)
	}
	return nil
}
