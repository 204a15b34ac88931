package bench

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/libcni"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
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
	// Set by enroll: the simulated kubelet and its running pods, removed
	// by close.
	owner   *kubesim.Owner
	kubelet *kubesim.Node
	running []*kubesim.Pod
}

func (a *ourAgent) prepare(ctx context.Context, r *backendRun) error {
	sim, err := simnode.Prepare(ctx, simnode.Options{
		Env: r.env, Chart: a.shipped, InstallCNI: r.o.InstallCNI, Plugin: r.o.Plugin,
		ReferencePlugins: r.refPlugins, Dir: r.dir, Name: r.res.Node, Settings: a.backend.settings(),
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
	if a.kubelet != nil {
		a.kubelet.Conf = r.primary
		err = teardown(a.kubelet, a.running)
	}
	if a.owner != nil {
		err = errors.Join(err, kubesim.Catch(func() error { a.owner.Close(); return nil }))
	}
	if a.node != nil {
		err = errors.Join(err, a.node.Close())
	}
	return err
}

// enroll measures namespace flips over running pods on the simulated
// kubelet, started through the chained conflist (not enrolled at ADD:
// their namespace is not labelled yet), then labelled.
func (a *ourAgent) enroll(ctx context.Context, r *backendRun) error {
	sim := a.node
	a.owner = &kubesim.Owner{Dir: filepath.Join(r.dir, "kubesim")}
	if err := kubesim.Catch(func() error {
		a.kubelet = kubesim.NewNode(a.owner, r.client, r.res.Node, []string{sim.BinDir}, sim.Chained)
		return nil
	}); err != nil {
		return err
	}
	order := []int{len(r.sz.enroll) - 1}
	for i := range len(r.sz.enroll) - 1 {
		order = append(order, i)
	}
	// The large flip first, so the RSS after it is the agent's with
	// exactly that many pods enrolled.
	type flip struct {
		ns   string
		pods int
		uids []types.UID
	}
	var flips []flip
	for _, i := range order {
		n := r.sz.enroll[i]
		ns, err := createNamespace(ctx, r.client, fmt.Sprintf("enroll-%d-%s", n, r.res.Name), nil)
		if err != nil {
			return err
		}
		r.logf("starting %d running pods", n)
		pods, err := startPods(ctx, a.kubelet, ns, n)
		for _, p := range pods {
			if p != nil {
				a.running = append(a.running, p)
			}
		}
		if err != nil {
			return fmt.Errorf("start running pods: %w", err)
		}
		var uids []types.UID
		for _, p := range pods {
			uids = append(uids, p.Obj.UID)
		}
		flips = append(flips, flip{ns, n, uids})
	}
	enrolls := make([]Enroll, len(r.sz.enroll))
	// Between flips the client's token bucket refills (burst/QPS): a
	// flip starts with the burst available, as one after a quiet spell
	// does on a node.
	cfg := sim.Config
	refill := time.Duration(float64(cfg.KubeClientBurst) / float64(cfg.KubeClientQPS) * float64(time.Second))
	for k, f := range flips {
		if err := r.settle(ctx); err != nil {
			return err
		}
		if err := sleep(ctx, refill); err != nil {
			return err
		}
		var stopProfile func() ([]string, error)
		var err error
		if r.o.Profile && k == 0 {
			if stopProfile, err = r.profile(fmt.Sprintf("enroll-%d", f.pods)); err != nil {
				return err
			}
		}
		cpu0, err := ReadCPU(r.pid())
		if err != nil {
			return err
		}
		mark, err := r.auditLog.mark()
		if err != nil {
			return err
		}
		times, err := enrollFlip(ctx, r.client, f.ns, f.pods, 10*time.Minute, r.zt, f.uids)
		took := times.enabled
		if err != nil {
			return fmt.Errorf("enroll %d running pods: %w", f.pods, err)
		}
		if err := r.settle(ctx); err != nil {
			return err
		}
		cpu1, err := ReadCPU(r.pid())
		if err != nil {
			return err
		}
		if stopProfile != nil {
			files, err := stopProfile()
			if err != nil {
				return err
			}
			r.res.Profiles = append(r.res.Profiles, files...)
		}
		reqs := r.auditLog.since(mark)
		e := Enroll{
			Pods: f.pods, Seconds: took.Seconds(), MsPerPod: ms(took) / float64(f.pods),
			CPUMsPerPod: ms(cpu1.Sub(cpu0).Total()) / float64(f.pods),
			APIPerPod:   float64(len(reqs)) / float64(f.pods), APIRequests: summarize(reqs), APIServerMs: meanServerMs(reqs),
			APIPerSecond: float64(len(reqs)) / took.Seconds(), Running: len(a.running),
			CapturedSeconds: times.captured.Seconds(),
		}
		r.logf("enrolled %d running pods in %.2f s (%.1f ms per pod, %.2f API requests per pod; all served by ztunnel after %.2f s)", f.pods, e.Seconds, e.MsPerPod, e.APIPerPod, e.CapturedSeconds)
		if k == 0 {
			if r.res.MemoryPods, err = r.memory(); err != nil {
				return err
			}
			r.res.RSSPodsMB, r.res.RSSPods = r.res.MemoryPods.RSSMiB, f.pods
		}
		enrolls[order[k]] = e
	}
	r.res.Enroll = enrolls
	return nil
}
