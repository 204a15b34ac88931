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
	peer                      Peer
	installCNI, plugin, chart string
	node                      *istioNode
	// chained is the primary conflist with istio-cni chained, as its
	// install-cni wrote it on the latest start.
	chained []byte
	// ztStop stops the running stand-in and waits for it.
	ztStop func() error
}

func (a *peerAgent) prepare(ctx context.Context, r *backendRun) error {
	if pf, err := pluginFigures(a.plugin, r.sz.execRuns); err != nil {
		r.logf("peer %s: plugin exec: %v", a.peer.Name, err)
	} else {
		r.res.Plugin = &pf
	}
	chart, err := renderIstioChart(ctx, a.chart, a.peer.NativeNftables)
	if err != nil {
		return err
	}
	if u := "system:serviceaccount:" + istioNamespace + ":" + chart.ServiceAccount; u != istioUser {
		return fmt.Errorf("the Istio chart's ServiceAccount is %s, the audit policy logs %s", u, istioUser)
	}
	if a.node, err = prepareIstio(ctx, istioPlace{env: r.env, dir: r.dir, name: r.res.Node, refPlugins: r.refPlugins}, a.installCNI, a.plugin, chart); err != nil {
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
	if a.chained, r.chained, err = n.waitChained(ctx, 2*time.Minute); err != nil {
		return err
	}
	r.primary, err = libcni.ConfListFromBytes(n.Primary)
	return err
}

// istio-cni's client-side limit (its node agent's buildKubeClient sets
// it; the chart has no setting for it).
const (
	istioKubeClientQPS   = 80
	istioKubeClientBurst = 160
)

// enroll measures istio-cni enrolling running pods as ours is measured
// (enrollRunning). istio-cni finds a running pod's netns by scanning
// /host/proc, a proc mount of its own PID namespace, for a process whose
// cgroup path carries the pod's UID; so the pods' processes start in
// install-cni's PID namespace (PID 1 there stays install-cni, the
// node's), in the kubelet's cgroupfs layout. They are torn down through
// the primary chain before install-cni stops.
func (a *peerAgent) enroll(ctx context.Context, r *backendRun) (err error) {
	n := a.node
	pods, err := newEnrollNode(filepath.Join(r.dir, "kubesim"), r.client, r.res.Node, n.BinDir, a.chained,
		fmt.Sprintf("/proc/%d/ns/pid", n.agentPid))
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pods.Close(r.primary)) }()
	r.res.KubeClientQPS, r.res.KubeClientBurst = istioKubeClientQPS, istioKubeClientBurst
	return r.enrollRunning(ctx, pods, istioKubeClientQPS, istioKubeClientBurst)
}

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
