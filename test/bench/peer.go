package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// runPeer measures Istio's istio-cni as run measures ours: its own
// simulated node, the same reference chain, API server and ztunnel stand-in,
// the same latency blocks against its own interleaved baseline, then the
// same enrollment of running pods (enrollPeer).
func (r *backendRun) runPeer(ctx context.Context, p Peer, installCNI, plugin, istioVer string) (err error) {
	var cleanups []func() error
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			err = errors.Join(err, cleanups[i]())
		}
	}()
	r.res.Node = "bench-" + p.Name
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return err
	}
	chart, err := renderIstioChart(ctx, istioVer, p.NativeNftables)
	if err != nil {
		return err
	}
	r.logf("starting Istio's install-cni with its chart's ambient environment (log %s)", filepath.Join(r.dir, "install-cni.log"))
	n, err := startIstio(ctx, r, installCNI, plugin, chart)
	if err != nil {
		return err
	}
	cleanups = append(cleanups, n.Close)
	r.agentEnv = n.Env
	zt := ztunnel.New(ztunnel.Config{SocketPath: n.ZDSSocket, Logger: slog.New(slog.DiscardHandler)})
	ztCtx, ztCancel := context.WithCancel(context.Background())
	ztDone := make(chan error, 1)
	go func() { ztDone <- zt.Run(ztCtx) }() // owner: this run; the cleanup waits
	cleanups = append(cleanups, func() error { ztCancel(); return <-ztDone })
	r.zt = zt
	chainedBytes, chained, err := n.waitChained(ctx, 2*time.Minute)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	err = zt.Wait(wctx, zt.Ready)
	cancel()
	if err != nil {
		return fmt.Errorf("the ztunnel stand-in got no snapshot from istio-cni: %w", err)
	}
	primaryList, err := libcni.ConfListFromBytes(n.Primary)
	if err != nil {
		return err
	}
	r.res.Detected = map[bool]string{false: "iptables", true: "nftables"}[p.NativeNftables]
	r.agent, r.agentPid = n.proc, n.agentPid
	r.res.AgentPID = n.agentPid
	r.metricsURL = istioMetricsURL
	if u := "system:serviceaccount:" + istioNamespace + ":" + chart.ServiceAccount; u != istioUser {
		return fmt.Errorf("the Istio chart's ServiceAccount is %s, the audit policy logs %s", u, istioUser)
	}
	r.auditLog = newAuditLogUser(r.audit, istioUser)

	if err := r.readIdle(ctx, "istio-cni ready ("+r.res.Detected+")"); err != nil {
		return err
	}

	pluginLog, err := os.Create(filepath.Join(r.dir, "plugin-stderr.log"))
	if err != nil {
		return err
	}
	defer pluginLog.Close()
	cni := libcni.NewCNIConfigWithCacheDir([]string{n.BinDir}, filepath.Join(r.dir, "cni-cache"),
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: pluginLog}, PluginDecoder: version.PluginDecoder{}})
	r.netnsDir = n.NetnsDir
	namespaces := map[string]string{}
	for _, kind := range []string{"ambient", "non-ambient"} {
		var labels map[string]string
		if kind == "ambient" {
			labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
		}
		if namespaces[kind], err = createNamespace(ctx, r.client, "lat-"+kind+"-"+p.Name, labels); err != nil {
			return err
		}
	}
	for _, c := range []int{1, 8} {
		for _, kind := range []string{"ambient", "non-ambient"} {
			n := r.sz.seq
			if c > 1 {
				n = r.sz.conc
			}
			if err := r.latency(ctx, cni, chained, primaryList, r.res.Node, namespaces[kind], kind, c, n); err != nil {
				return fmt.Errorf("%s pods, %d at a time: %w", kind, c, err)
			}
		}
	}
	if err := r.enrollPeer(ctx, n, chainedBytes, primaryList); err != nil {
		return err
	}
	if n.proc.Exited() {
		return fmt.Errorf("the Istio install-cni exited during the run: %v; log %s", n.proc.Err(), n.LogPath)
	}
	return nil
}

// istio-cni's client-side limit (its node agent's buildKubeClient sets
// it; the chart has no setting for it).
const (
	istioKubeClientQPS   = 80
	istioKubeClientBurst = 160
)

// enrollPeer measures istio-cni enrolling running pods as ours is
// measured (enrollRunning). istio-cni finds a running pod's netns by
// scanning /host/proc, a proc mount of its own PID namespace, for a
// process whose cgroup path carries the pod's UID; so the pods'
// processes start in install-cni's PID namespace (PID 1 there stays
// install-cni, the node's), in the kubelet's cgroupfs layout. They are
// torn down through the primary chain before install-cni stops.
func (r *backendRun) enrollPeer(ctx context.Context, n *istioNode, chained []byte, primary *libcni.NetworkConfigList) (err error) {
	pods, err := newEnrollNode(filepath.Join(r.dir, "kubesim"), r.client, r.res.Node, n.BinDir, chained,
		fmt.Sprintf("/proc/%d/ns/pid", n.agentPid))
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pods.Close(primary)) }()
	r.res.KubeClientQPS, r.res.KubeClientBurst = istioKubeClientQPS, istioKubeClientBurst
	return r.enrollRunning(ctx, pods, istioKubeClientQPS, istioKubeClientBurst)
}
