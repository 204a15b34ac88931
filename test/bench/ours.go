package bench

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// ourAgent is our install-cni with one rules backend, on a simulated
// node as the shipped chart runs it.
type ourAgent struct {
	shipped *simnode.Shipped
	backend Backend
	// subnet is the node's pod network: each system's bridge stays
	// between its reps, beside the others'.
	subnet netip.Prefix
	node   *simnode.Node
	// pods is set by enroll: the simulated kubelet and its running pods,
	// removed by close.
	pods *enrollNode
}

func (a *ourAgent) prepare(ctx context.Context, r *backendRun) error {
	settings := a.backend.settings()
	if r.o.Quick {
		// A smoke run: drift found in seconds, not within the minute.
		settings = maps.Clone(settings)
		if settings == nil {
			settings = map[string]string{}
		}
		settings["verify-period"] = quickVerifyPeriod.String()
	}
	sim, err := simnode.Prepare(ctx, simnode.Options{
		Env: r.env, Chart: a.shipped, InstallCNI: r.o.InstallCNI, Plugin: r.o.Plugin,
		ReferencePlugins: r.refPlugins, Dir: r.dir, Name: r.res.Node, Settings: settings,
		RunOnTmpfs: true, Subnet: a.subnet,
	})
	if err != nil {
		return err
	}
	a.node = sim
	r.agentEnv, r.log = sim.AgentEnv, sim.LogPath
	r.res.KubeClientQPS, r.res.KubeClientBurst = float64(sim.Config.KubeClientQPS), sim.Config.KubeClientBurst
	r.metricsURL = sim.MetricsURL
	r.auditLog = newAuditLog(r.audit, r.res.Node)
	r.cni = sim.CNI(r.pluginLog)
	r.logf("%s: our install-cni with the chart's environment (log %s)", r.res.Name, sim.LogPath)
	return nil
}

func (a *ourAgent) start(ctx context.Context, r *backendRun) (err error) {
	sim := a.node
	if r.primary, err = libcni.ConfListFromBytes(sim.Primary); err != nil {
		return err
	}
	if r.agent, err = sim.StartAgent(); err != nil {
		return err
	}
	if err := sim.WaitReady(ctx, 2*time.Minute); err != nil {
		return err
	}
	r.zt = sim.StartStandIn(ztunnel.Faults{})
	r.res.Detected = detectedBackend(r.log)
	chainedBytes, err := os.ReadFile(filepath.Join(sim.ConfDir, simnode.PrimaryConf))
	if err != nil {
		return err
	}
	if r.chained, err = libcni.ConfListFromBytes(chainedBytes); err != nil {
		return err
	}
	if len(r.chained.Plugins) != 2 || r.chained.Plugins[1].Network.Type != sim.Config.PluginType {
		return fmt.Errorf("the installer did not chain %s last into %s:\n%s", sim.Config.PluginType, simnode.PrimaryConf, chainedBytes)
	}
	sim.Chained = chainedBytes
	return nil
}

func (a *ourAgent) stop(*backendRun) error {
	return errors.Join(a.node.StopStandIn(), a.node.StopAgent())
}

// close tears the enrollment's pods down by the primary chain alone, as
// after an uninstall (the agent is stopped: no agent work for thousands
// of DELs), then the node.
func (a *ourAgent) close(r *backendRun) error {
	var err error
	if a.pods != nil {
		err = a.pods.Close(r.primary)
	}
	if a.node != nil {
		err = errors.Join(err, a.node.Close())
	}
	return err
}

// enroll measures namespace flips over running pods on the simulated
// kubelet, started through the chained conflist (not enrolled at ADD:
// their namespace is not labelled yet), then labelled.
func (a *ourAgent) enroll(ctx context.Context, r *backendRun) (err error) {
	if a.pods, err = newEnrollNode(filepath.Join(r.dir, "kubesim"), r.client, r.res.Node, a.node.BinDir, a.node.Chained, ""); err != nil {
		return err
	}
	// The idle agent's CPU before any pod runs, for the verifier's cost.
	idle, err := r.idleCPU(ctx)
	if err != nil {
		return err
	}
	if err := r.enrollRunning(ctx, a.pods, float64(a.node.Config.KubeClientQPS), a.node.Config.KubeClientBurst); err != nil {
		return err
	}
	return r.verifierFigures(ctx, a.pods, idle)
}
