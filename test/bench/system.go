package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// lifecycle is what differs between the systems the benchmark compares
// (ours with a rules backend, Istio's istio-cni in a mode): how one is
// built, started and stopped, and how its enrollment of running pods is
// measured. backendRun drives every system through the same steps.
type lifecycle interface {
	// prepare builds what lasts across the system's starts: its node
	// (directories, primary conflist, ServiceAccount), r.auditLog and
	// r.cni.
	prepare(ctx context.Context, r *backendRun) error
	// start starts the agent and a fresh ztunnel stand-in and returns
	// once the agent is ready and has chained its plugin last into the
	// primary conflist; it sets r's per-start fields (agent, agentPid,
	// zt, chained, primary, res.Detected).
	start(ctx context.Context, r *backendRun) error
	// enroll measures enrolling running pods; it runs once, on the
	// started system, after its last latency rep.
	enroll(ctx context.Context, r *backendRun) error
	// stop stops the stand-in and the agent as the kubelet stops a pod
	// (SIGTERM) and says how the agent ended; a no-op when stopped.
	stop(r *backendRun) error
	// close removes what prepare and enroll built; the agent is stopped.
	close(r *backendRun) error
}

// backendRun is one system's run (one column): its own node directory,
// agent process, stand-in and pods, and its latency figures pooled over
// its reps.
type backendRun struct {
	o          Options
	sz         sizes
	logf       func(string, ...any)
	env        *kubeenv.Env
	client     kubernetes.Interface
	dir        string
	refPlugins string
	audit      string
	res        *BackendResult
	kind       lifecycle

	// Set by prepare.
	agentEnv map[string]string
	// metricsURL is where the agent serves /metrics (its own address).
	metricsURL string
	log        string
	auditLog   *auditLog
	cni        *libcni.CNIConfig
	pluginLog  *os.File
	// netnsDir, when set, is a shared mount where every sandbox's netns is
	// bound too, and named (see latencyRun.netnsDir).
	netnsDir string
	figures  []*figure

	// Set by every start.
	agent *childproc.Proc
	// agentPid, when set, is the agent's process under agent (a peer
	// started through unshare).
	agentPid         int
	zt               *ztunnel.StandIn
	chained, primary *libcni.NetworkConfigList

	started, failed, closed bool
}

// pid is the agent's process.
func (r *backendRun) pid() int {
	if r.agentPid != 0 {
		return r.agentPid
	}
	return r.agent.Pid()
}

// interleave runs the systems' latency reps interleaved: rep after rep,
// every system in turn (the order rotating each rep, so that none is
// always first) is started, runs one rep of every latency figure and is
// stopped; after its last rep it also runs its enrollment. Systems cannot
// run side by side (their host rules would share one network namespace),
// so slow drift of the machine lands on every column alike. A system that
// fails is reported in its column and left out of later reps; the others
// go on.
func interleave(ctx context.Context, systems []*backendRun, reps int) {
	for _, s := range systems {
		if err := s.prepare(ctx); err != nil {
			s.fail(err)
		}
	}
	for rep := range reps {
		for _, i := range repOrder(len(systems), rep) {
			s := systems[i]
			if s.failed || ctx.Err() != nil {
				continue
			}
			s.logf("== rep %d/%d: %s", rep+1, reps, s.res.Name)
			if err := s.rep(ctx, rep); err != nil {
				s.fail(fmt.Errorf("rep %d: %w", rep+1, err))
			}
		}
	}
	for _, s := range systems {
		if err := s.close(); err != nil {
			s.fail(err)
		}
	}
}

// repOrder is the order n systems run in at rep: rotated by one every
// rep.
func repOrder(n, rep int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = (i + rep) % n
	}
	return out
}

// fail records err in the system's column; it takes no further part.
func (r *backendRun) fail(err error) {
	r.failed = true
	r.res.Error = strings.TrimPrefix(r.res.Error+"; "+err.Error(), "; ")
	r.logf("%s failed: %v", r.res.Name, err)
}

// prepare builds the system's node and the latency figures' namespaces.
func (r *backendRun) prepare(ctx context.Context) (err error) {
	r.res.Node = "bench-" + r.res.Name
	// Without it every token renewal is a refused request in the figures.
	if err := createNode(ctx, r.client, r.res.Node); err != nil {
		return err
	}
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return err
	}
	if r.pluginLog, err = os.Create(filepath.Join(r.dir, "plugin-stderr.log")); err != nil {
		return err
	}
	if err := r.kind.prepare(ctx, r); err != nil {
		return err
	}
	namespaces := map[string]string{}
	for _, kind := range []string{"ambient", "non-ambient"} {
		var labels map[string]string
		if kind == "ambient" {
			labels = map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}
		}
		if namespaces[kind], err = createNamespace(ctx, r.client, "lat-"+kind+"-"+r.res.Name, labels); err != nil {
			return err
		}
	}
	for _, c := range []int{1, 8} {
		for _, kind := range []string{"ambient", "non-ambient"} {
			n := r.sz.seq
			if c > 1 {
				n = r.sz.conc
			}
			r.figures = append(r.figures, &figure{kind: kind, concurrency: c, pods: n, namespace: namespaces[kind], windows: map[string][]*window{}})
		}
	}
	return nil
}

// rep is one rep of the system: start, one rep of every latency figure,
// after the last rep the enrollment, stop; once done or failed its node
// is removed at once, so that its pods do not burden the others' reps.
func (r *backendRun) rep(ctx context.Context, rep int) (err error) {
	last := rep == r.sz.reps-1
	defer func() {
		err = errors.Join(err, r.stop())
		if last || err != nil {
			err = errors.Join(err, r.close())
		}
	}()
	if err := r.start(ctx); err != nil {
		return err
	}
	for _, f := range r.figures {
		if err := r.latency(ctx, f, rep); err != nil {
			return fmt.Errorf("%s pods, %d at a time: %w", f.kind, f.concurrency, err)
		}
	}
	if last {
		for _, f := range r.figures {
			r.record(f)
		}
		if err := r.kind.enroll(ctx, r); err != nil {
			return err
		}
	}
	if r.agent.Exited() {
		return fmt.Errorf("the agent exited during the rep: %v; log %s", r.agent.Err(), r.log)
	}
	return nil
}

// start starts the system and waits until it is ready, its stand-in
// has a snapshot and the agent is settled; how long that took is
// recorded. The first start also records the idle memory.
func (r *backendRun) start(ctx context.Context) error {
	t0 := time.Now()
	r.started = true
	if err := r.kind.start(ctx, r); err != nil {
		return err
	}
	r.res.AgentPID = r.pid()
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	err := r.zt.Wait(wctx, r.zt.Ready)
	cancel()
	if err != nil {
		return fmt.Errorf("the ztunnel stand-in got no snapshot: %w", err)
	}
	if err := r.settle(ctx); err != nil {
		return err
	}
	took := time.Since(t0)
	r.res.StartSeconds = append(r.res.StartSeconds, took.Seconds())
	r.logf("%s ready and settled in %.1f s (backend %s)", r.res.Name, took.Seconds(), r.res.Detected)
	if len(r.res.StartSeconds) == 1 {
		return r.readIdle(ctx, r.res.Name+" ("+r.res.Detected+") ready")
	}
	return nil
}

// stop stops a started system; how long that took is recorded.
func (r *backendRun) stop() error {
	if !r.started {
		return nil
	}
	r.started = false
	t0 := time.Now()
	err := r.kind.stop(r)
	r.res.StopSeconds = append(r.res.StopSeconds, time.Since(t0).Seconds())
	return err
}

// close stops the system if needed and removes its node; a no-op when
// closed.
func (r *backendRun) close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	err := errors.Join(r.stop(), r.kind.close(r))
	if r.pluginLog != nil {
		err = errors.Join(err, r.pluginLog.Close())
	}
	return err
}

// starts sums the systems' starts and their stops between reps: the cost
// of interleaving. A system's last stop, after its enrollment (an
// uninstall with its running pods), a run without interleaving has too.
func starts(systems []*backendRun) StartCost {
	var c StartCost
	for _, s := range systems {
		c.Starts += len(s.res.StartSeconds)
		for _, t := range s.res.StartSeconds {
			c.StartSeconds += t
		}
		for _, t := range s.res.StopSeconds[:max(len(s.res.StopSeconds)-1, 0)] {
			c.StopSeconds += t
		}
	}
	return c
}

// newSystem is the run of one system in the run's work directory.
func newSystem(o Options, sz sizes, logf func(string, ...any), env *kubeenv.Env, work, refPlugins, audit string, res *BackendResult, kind lifecycle) *backendRun {
	return &backendRun{
		o: o, sz: sz, logf: logf, env: env, client: env.Client, dir: filepath.Join(work, res.Name),
		refPlugins: refPlugins, audit: audit, res: res, kind: kind,
	}
}
