package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// peerAgent is Istio's istio-cni in one mode, measured as ours: its own
// simulated node, the same reference chain, API server and ztunnel
// stand-in, the same latency blocks against its own baseline blocks.
type peerAgent struct {
	peer                        Peer
	installCNI, plugin, version string
	node                        *istioNode
	// ztStop stops the running stand-in and waits for it.
	ztStop func() error
}

func (a *peerAgent) prepare(ctx context.Context, r *backendRun) error {
	if pf, err := pluginFigures(a.plugin, r.sz.execRuns); err != nil {
		r.logf("peer %s: plugin exec: %v", a.peer.Name, err)
	} else {
		r.res.Plugin = &pf
	}
	chart, err := renderIstioChart(ctx, a.version, a.peer.NativeNftables)
	if err != nil {
		return err
	}
	if u := "system:serviceaccount:" + istioNamespace + ":" + chart.ServiceAccount; u != istioUser {
		return fmt.Errorf("the Istio chart's ServiceAccount is %s, the audit policy logs %s", u, istioUser)
	}
	if a.node, err = prepareIstio(ctx, r, a.installCNI, a.plugin, chart); err != nil {
		return err
	}
	r.agentEnv, r.res.AgentEnv, r.log = a.node.Env, a.node.Env, a.node.LogPath
	r.metricsURL = istioMetricsURL
	r.auditLog = newAuditLogUser(r.audit, istioUser)
	r.netnsDir = a.node.NetnsDir
	r.cni = libcni.NewCNIConfigWithCacheDir([]string{a.node.BinDir}, filepath.Join(r.dir, "cni-cache"),
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: r.pluginLog}, PluginDecoder: version.PluginDecoder{}})
	r.res.Detected = map[bool]string{false: "iptables", true: "nftables"}[a.peer.NativeNftables]
	r.logf("%s: Istio's install-cni with its chart's ambient environment (log %s)", r.res.Name, a.node.LogPath)
	return nil
}

func (a *peerAgent) start(ctx context.Context, r *backendRun) (err error) {
	n := a.node
	if err := n.start(ctx); err != nil {
		return err
	}
	r.agent, r.agentPid = n.proc, n.agentPid
	zt := ztunnel.New(ztunnel.Config{SocketPath: n.ZDSSocket, Logger: slog.New(slog.DiscardHandler)})
	ztCtx, ztCancel := context.WithCancel(context.Background())
	ztDone := make(chan error, 1)
	go func() { ztDone <- zt.Run(ztCtx) }() // owner: this start; stop waits
	a.ztStop = func() error { ztCancel(); return <-ztDone }
	r.zt = zt
	if _, r.chained, err = n.waitChained(ctx, 2*time.Minute); err != nil {
		return err
	}
	r.primary, err = libcni.ConfListFromBytes(n.Primary)
	return err
}

// enroll is not measured for istio-cni: it finds a running pod's netns by
// scanning /host/proc for the pod's cgroup, which the simulated kubelet's
// pods do not have.
func (a *peerAgent) enroll(context.Context, *backendRun) error { return nil }

func (a *peerAgent) stop(*backendRun) error {
	var err error
	if a.ztStop != nil {
		err, a.ztStop = a.ztStop(), nil
	}
	return errors.Join(err, a.node.stop())
}

func (a *peerAgent) close(*backendRun) error {
	if a.node == nil {
		return nil
	}
	return a.node.Close()
}
